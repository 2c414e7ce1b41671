// CUDA registration of `row_stats` and `_scale_grad_`.
#include <torch/library.h>

#include "common/row_pass_cuda.cuh"
#include "common/row_stats.h"

namespace rl_losses {
namespace {

void stats_cuda(const RowPassArgs& args, const at::Tensor& out) {
  cuda::row_pass_cuda(args, "row_stats", [&](auto* tag) {
    using acc_t = std::remove_pointer_t<decltype(tag)>;
    return StoreStatsEpilogue<acc_t>{out.data_ptr<acc_t>()};
  });
}

// grad *= g, with g read on the device: when g == 1 (plain loss.backward()) every block returns at once,
// so the common case costs one tiny launch instead of a full read and write of the gradient.
template <typename scalar_t, typename g_t>
__global__ void scale_rows_kernel(scalar_t* grad, int64_t n_rows, int64_t cols, int64_t row_stride,
                                  const g_t* g_ptr) {
  const float g = static_cast<float>(*g_ptr);
  if (g == 1.0f) return;
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    scalar_t* r = grad + row * row_stride;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) r[j] = static_cast<scalar_t>(static_cast<float>(r[j]) * g);
  }
}

void scale_grad_cuda(const at::Tensor& grad, const at::Tensor& grad_output) {
  if (grad.numel() == 0) return;
  if (grad_output.numel() != 1 || grad_output.dim() != 0) {
    grad.mul_(grad_output.unsqueeze(-1));
    return;
  }
  TORCH_CHECK(grad_output.is_cuda(), "_scale_grad_: grad_output must be on the gradient's device");
  const c10::cuda::OptionalCUDAGuard guard(grad.device());
  const int64_t cols = grad.size(-1);
  at::Tensor g2 = grad.view({-1, cols});
  const int64_t n_rows = g2.size(0);
  const int threads = cols >= 1024 ? 1024 : 128;
  const int64_t blocks = std::min<int64_t>(n_rows, at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "_scale_grad_", [&] {
    using scalar = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(grad_output.scalar_type(), "_scale_grad_", [&] {
      scale_rows_kernel<scalar, scalar_t><<<blocks, threads, 0, stream>>>(
          g2.data_ptr<scalar>(), n_rows, cols, g2.stride(0), grad_output.const_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  m.impl("row_stats", &row_stats_op<stats_cuda>);
  m.impl("_scale_grad_", &scale_grad_cuda);
}

}  // namespace rl_losses
