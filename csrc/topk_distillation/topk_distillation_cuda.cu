// CUDA back-end of topk_distillation (registered in csrc/cuda_registration.cpp): the steps of topk_distillation.h on
// CudaRunner: the gather (and JSD's step after the statistics) with a warp per row (its lanes' K/32 reads each in
// flight at once, their sums combined by shuffles), the row pass's kernels, the scatter with a thread per id.
#include "common/row_pass_cuda.cuh"
#include "topk_distillation/topk_distillation.h"

namespace rl_losses {
namespace {

template <typename T>
__device__ inline T shfl(T v, int m) {
  return __shfl_xor_sync(0xffffffffu, v, m);
}

template <typename acc_t>
__device__ inline TopkPartial<acc_t> shfl_xor(const TopkPartial<acc_t>& s, int m) {
  return {shfl(s.m, m), shfl(s.e, m), shfl(s.c, m), shfl(s.p, m), shfl(s.a, m), shfl(s.b, m), shfl(s.lp_min, m)};
}

template <typename acc_t>
__device__ inline TopkJsdPartial<acc_t> shfl_xor(const TopkJsdPartial<acc_t>& s, int m) {
  return {shfl(s.loss, m), shfl(s.s, m)};
}

constexpr int kGatherThreads = 256;

// Step 1 or 1b (G: TopkGather or TopkJsdStep), a warp per row.
template <typename G>
__global__ void __launch_bounds__(kGatherThreads) topk_gather_kernel(G g, int64_t n) {
  // No early trigger: the row pass's persistent cluster grid comes next, and scheduled over this grid's blocks
  // (thousands, on every SM) some of its clusters found no GPC with room and ran as a second wave, after the
  // others' whole share of rows (1.45x cross-entropy's time in a stream, 1.01x kernel by kernel).
  cuda::wait_for_previous_grid();
  const int64_t r = blockIdx.x * int64_t(kGatherThreads / 32) + threadIdx.x / 32;
  if (r >= n) return;  // the whole warp: one row per warp
  const int lane = threadIdx.x % 32;
  auto s = g.part(r, lane, 32);
  for (int m = 16; m > 0; m >>= 1) s = decltype(s)::combine(s, shfl_xor(s, m));
  if (lane == 0) g.store(r, s);
}

}  // namespace

void topk_distillation_rows_cuda(const RowPassArgs& args, const TopkRows& rows, bool gather) {
  topk_distillation_rows<CudaRunner>(args, rows, gather, [](const auto& g, int64_t n) {
    constexpr int64_t kRows = kGatherThreads / 32;
    cuda::DependentLaunch(dim3(static_cast<unsigned>((n + kRows - 1) / kRows)), kGatherThreads, 0)(
        topk_gather_kernel<std::decay_t<decltype(g)>>, g, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rl_losses
