// policy_token_loss on CUDA: one thread per token (elementwise; the math is policy_token_at, shared with the CPU).
// Registered in cuda_registration.cpp.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>

#include "common/cuda_backends.h"
#include "policy_token/policy_token.h"

namespace rl_losses {
namespace {

template <typename T>
__global__ void policy_token_kernel(PolicyOptions<T> o, PolicyTokenPtrs<T> p, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) policy_token_at(o, p, i);
}

}  // namespace

void policy_token_cuda(const PolicyTokenInputs& in) {
  const int64_t n = in.log_probs.numel();
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(1) << 16);
  AT_DISPATCH_FLOATING_TYPES(in.log_probs.scalar_type(), "policy_token_loss", [&] {
    policy_token_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        policy_options_as<scalar_t>(in.opt), policy_token_ptrs<scalar_t>(in), n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace rl_losses
