// CPU registration of `row_stats` and `_scale_grad_`; the CPU side of the small steps between passes.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>

#include "common/boxed_kernel.h"
#include "common/policy_cov.h"
#include "common/rollout_statistic.h"
#include "common/row_pass_cpu.h"
#include "common/row_stats.h"

namespace rl_losses {
namespace {

void stats_cpu(const RowPassArgs& args, const at::Tensor& out) {
  row_pass_cpu(args, "row_stats", [&](auto* tag) {
    using acc_t = std::remove_pointer_t<decltype(tag)>;
    return StoreStatsEpilogue<acc_t>{out.data_ptr<acc_t>()};
  });
}

// grad[r, :] *= g[r]·unscale[r] (g_stride 0: one g for every row; unscale null: 1), in the accumulation type:
// the product of the upstream gradient and the stored gradient is rounded once to the logits dtype. ATen's mul_
// would round a scalar g to fp16/bf16 first (2^16, GradScaler's default, is inf in fp16; 1/3 is 0.2% off in
// bf16), and with a per-row g it would allocate a float copy of the whole gradient. Rows whose factor is 1 are
// not touched; rows whose factor is 0 are zeroed.
template <typename scalar_t, bool kPrescaled, typename g_t>
void scale_rows_cpu(const at::Tensor& grad2d, const g_t* g, int64_t g_stride, const float* unscale) {
  using acc_t = typename acc_type<scalar_t>::type;
  scalar_t* base = grad2d.data_ptr<scalar_t>();
  const int64_t cols = grad2d.size(1), row_stride = grad2d.stride(0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, grad2d.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const acc_t f = static_cast<acc_t>(g[row * g_stride]) * (unscale ? static_cast<acc_t>(unscale[row]) : acc_t(1));
      if (f == acc_t(1)) continue;
      scalar_t* r = base + row * row_stride;
      if (f == acc_t(0)) {  // written, not read (as scale_rows_kernel: a finite gradient times 0)
        std::fill(r, r + cols, scalar_t(0));
        continue;
      }
      for (int64_t j = 0; j < cols; ++j) r[j] = scaled_grad_value<scalar_t, acc_t, kPrescaled>(r[j], f);
    }
  });
}

// Backward of every fused loss: the gradient was computed in the forward for an upstream gradient of 1;
// scale it by the real one (a scalar, or one value per row for reduction="none") and, for a pre-scaled fp16
// gradient, by its rows' 2^-k (row_unscale; row_pass.h, GradRowPrescaled). Skipped when all that is 1.
// Where the factor is not 1 a fp16/bf16 gradient is rounded twice (in the forward, then after the scaling);
// pre-scaled fp16 rows keep, in the forward's rounding, every value the single rounding of g·gradient keeps.
void scale_grad_cpu(const at::Tensor& grad, const at::Tensor& grad_output,
                    const std::optional<at::Tensor>& row_unscale) {
  at::AutoDispatchBelowADInplaceOrView guard;  // as the boxed kernels (common/boxed_kernel.h)
  if (grad.numel() == 0) return;
  const bool scalar = grad_output.numel() == 1 && grad_output.dim() == 0;
  const bool prescaled = row_unscale.has_value() && row_unscale->numel() > 0;
  if (scalar && !prescaled && grad_output.item<double>() == 1.0) return;  // a CPU scalar: no synchronisation
  const int64_t cols = grad.size(-1);
  const at::Tensor grad2d = grad.view({-1, cols});  // the gradient buffer, or logits flattenable to rows
  const at::Tensor g = grad_output.reshape({-1}).contiguous();
  check_scale_grad(grad2d, grad_output, row_unscale);
  const float* unscale = prescaled ? row_unscale->const_data_ptr<float>() : nullptr;
  RL_LOSSES_DISPATCH_LOGITS(grad.scalar_type(), "_scale_grad_", [&] {
    using grad_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "_scale_grad_", [&] {
      if (unscale) {
        scale_rows_cpu<grad_t, true>(grad2d, g.const_data_ptr<scalar_t>(), scalar ? 0 : 1, unscale);
      } else {
        scale_rows_cpu<grad_t, false>(grad2d, g.const_data_ptr<scalar_t>(), scalar ? 0 : 1, nullptr);
      }
    });
  });
}

}  // namespace

void labelled_count_cpu(const at::Tensor& target1d, const at::Tensor& out) {
  labelled_count_on<CpuRunner>(target1d, out);
}

void labelled_count_and_constant_cpu(const at::Tensor& target1d, const at::Tensor& out, const at::Tensor& constant_out,
                                     double constant) {
  labelled_count_and_constant_on<CpuRunner>(target1d, out, constant_out, constant);
}

void cov_select_cpu(const CovSelectArgs& s) { cov_select<CpuRunner>(s); }

void rollout_statistic_cpu(int estimator, const at::Tensor& log_probs, const at::Tensor& rollout_log_probs,
                           const at::Tensor& out) {
  rollout_statistic_on<CpuRunner>(estimator, log_probs, rollout_log_probs, out);
}

at::Tensor sequence_rule_cpu(int estimator, bool mean, double lo, double hi, const at::Tensor& log_probs,
                             const at::Tensor& rollout_log_probs, const at::Tensor& ids, const at::Tensor& in_sequence,
                             const at::Tensor& counted, int64_t count) {
  return sequence_rule_on<CpuRunner>(estimator, mean, lo, hi, log_probs, rollout_log_probs, ids, in_sequence, counted,
                                     count);
}

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("row_stats", boxed<&row_stats_kernel<stats_cpu>>());
  m.impl("_scale_grad_", &scale_grad_cpu);
}

}  // namespace rl_losses
