// CUDA back-ends of `row_stats` and `_scale_grad_` (registered in csrc/cuda_registration.cpp), and the
// CUDA side of split_stats_pass_on_cuda (row_pass.h).
#include <ATen/Dispatch.h>

#include "common/cuda/warp_stats.cuh"
#include "common/cuda_backends.h"
#include "common/policy_cov.h"
#include "common/rollout_statistic.h"
#include "common/row_pass_cuda.cuh"
#include "common/row_stats.h"

namespace rl_losses {

bool cuda_fuses_row_pass(const RowPassArgs& args) { return cuda::row_cluster_shape(args).ctas != 0; }

void labelled_count_cuda(const at::Tensor& target1d, const at::Tensor& out) {
  labelled_count_on<CudaRunner>(target1d, out);
}

void labelled_count_and_constant_cuda(const at::Tensor& target1d, const at::Tensor& out,
                                      const at::Tensor& constant_out, double constant) {
  labelled_count_and_constant_on<CudaRunner>(target1d, out, constant_out, constant);
}

void cov_select_cuda(const CovSelectArgs& s) { cov_select<CudaRunner>(s); }

void rollout_statistic_cuda(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                            const at::Tensor& out) {
  rollout_statistic_on<CudaRunner>(estimator, log_probs, rollout_log_probs, out);
}

at::Tensor sequence_rule_cuda(int estimator, bool mean, double lo, double hi, const at::Tensor& log_probs,
                              const at::Tensor& rollout_log_probs, const at::Tensor& ids, const at::Tensor& in_sequence,
                              const at::Tensor& counted, int64_t count) {
  return sequence_rule_on<CudaRunner>(estimator, mean, lo, hi, log_probs, rollout_log_probs, ids, in_sequence, counted,
                                      count);
}

void sum_cuda(const at::Tensor& x, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "sum_1d", [&] {
    CudaRunner::sum_then(x.numel(), SumOf<scalar_t>{x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>()});
  });
}

void row_stats_cuda(const RowPassArgs& args, const at::Tensor& out) {
  cuda::row_pass_cuda(args, "row_stats", [&](auto* tag) {
    using acc_t = std::remove_pointer_t<decltype(tag)>;
    return StoreStatsEpilogue<acc_t>{out.data_ptr<acc_t>()};
  });
}

// `row_stats` with tp_blocks in the batch-invariant mode: rows of up to kWarpStatsMaxCols columns one warp each
// (cuda/warp_stats.cuh), wider ones as row_stats_cuda. (Not the statistics-only passes of the ops, which follow the
// fused pass's order.)
void row_stats_blocks_cuda(const RowPassArgs& args, const at::Tensor& out) {
  if (args.logits.size(1) > cuda::kWarpStatsMaxCols) return row_stats_cuda(args, out);
  RowPassArgs a = args;
  cuda::align_rows(a);
  RL_LOSSES_DISPATCH_LOGITS(a.logits.scalar_type(), "row_stats", [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const StoreStatsEpilogue<acc_t> epi{out.data_ptr<acc_t>()};
    dispatch_stat_flags<StoreStatsEpilogue<acc_t>>(a, [&](auto entropy, auto smoothing) {
      cuda::launch_warp_row_stats<scalar_t, int64_t, acc_t, decltype(entropy)::value, decltype(smoothing)::value>(
          a, epi);
    });
  });
}

// grad[r, :] *= g[r·g_stride]·unscale[r] (unscale null: 1; scaled_grad_value), with g read on the device:
// when one g (g_stride 0) is 1 (plain loss.backward()) and no row is pre-scaled every block returns at once, so
// the common case costs one tiny launch instead of a full read and write of the gradient; rows whose factor
// is 1 are skipped, and rows whose factor is 0 (grpo's bypass_mode rejection after its pass) are written as zeros
// without being read (block_zero_fill; the gradient of finite logits is finite, so that its product with 0 is 0).
// Stores alone do not wait on memory, where the element-wise load, multiply and store of each value does: rows
// rewritten that way (grpo's bypass_mode rows at d545817) cost about 1.5 ms for a fifth of a 16384 × 128256 bf16
// gradient on an H200, near a quarter of its bandwidth (benchmarks/results/h200-2026-11-27-policy-bypass.txt).
template <int kThreads, typename scalar_t, bool kPrescaled, typename g_t>
__global__ void __launch_bounds__(kThreads) scale_rows_kernel(scalar_t* grad, int64_t n_rows, int64_t cols,
                                                              int64_t row_stride, const g_t* g, int64_t g_stride,
                                                              const float* unscale) {
  cuda::wait_previous_grid();
  using acc_t = typename acc_type<scalar_t>::type;  // fp64 gradients are scaled in fp64
  if (!kPrescaled && g_stride == 0 && static_cast<acc_t>(*g) == acc_t(1)) return;
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    acc_t f = static_cast<acc_t>(g[row * g_stride]);
    if constexpr (kPrescaled) f *= static_cast<acc_t>(unscale[row]);
    if (f == acc_t(1)) continue;
    scalar_t* r = grad + row * row_stride;
    if (f == acc_t(0)) {
      cuda::block_zero_fill<kThreads>(r, cols);
      continue;
    }
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      r[j] = scaled_grad_value<scalar_t, acc_t, kPrescaled>(r[j], f);
    }
  }
}

// grad_output: one value (0-dim) or one per row, on the gradient's device; unscale: null or one factor per row
// (checked by the caller).
void scale_grad_cuda_rows(const at::Tensor& grad, const at::Tensor& grad_output, const float* unscale) {
  const int64_t cols = grad.size(-1);
  const at::Tensor g = grad_output.reshape({-1}).contiguous();
  const int64_t g_stride = g.numel() == 1 && grad_output.dim() == 0 ? 0 : 1;
  at::Tensor g2 = grad.view({-1, cols});
  const int64_t n_rows = g2.size(0);
  auto launch = [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    // Blocks that fill each SM once (2048 threads) for the loop over rows; more would only lengthen the launch
    // that plain loss.backward() (g == 1) makes, where every block returns at once.
    const int64_t blocks = std::min<int64_t>(
        n_rows, static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * (2048 / kThreads));
    const dim3 grid(static_cast<unsigned>(blocks));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "_scale_grad_", [&] {
      using scalar = scalar_t;
      AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "_scale_grad_", [&] {
        if (unscale != nullptr) {
          cuda::DependentLaunch(grid, kThreads, 0)(scale_rows_kernel<kThreads, scalar, true, scalar_t>,
                                                   g2.data_ptr<scalar>(), n_rows, cols, g2.stride(0),
                                                   g.const_data_ptr<scalar_t>(), g_stride, unscale);
        } else {
          cuda::DependentLaunch(grid, kThreads, 0)(scale_rows_kernel<kThreads, scalar, false, scalar_t>,
                                                   g2.data_ptr<scalar>(), n_rows, cols, g2.stride(0),
                                                   g.const_data_ptr<scalar_t>(), g_stride, unscale);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  };
  if (cols >= 1024) {
    launch(std::integral_constant<int, 1024>{});
  } else {
    launch(std::integral_constant<int, 128>{});
  }
}

}  // namespace rl_losses
