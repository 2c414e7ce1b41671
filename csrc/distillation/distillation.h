// Distillation against a teacher's logits (docs/distillation_dpo.md): forward / reverse KL, the soft-label
// cross-entropy and the generalised JSD, over the student's logits and the teacher's of the same shape.
//
// Passes per row: statistics of both softmaxes at once (DistillStats; given as `row_stats` under tensor
// parallelism), for JSD the sums that need both normalised rows (`jsd_sums`, idem), the row step
// (DistillRowStep: loss and gradient table), then the student's gradient, written once. The CPU runs them row
// by row (a row stays in cache); CUDA runs each pass over all rows as its own kernel.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "distillation/distillation_math.h"

namespace rl_losses {

// Everything the back-end reads and writes. Tensors of the accumulation dtype unless said; optional ones are
// undefined when absent.
struct DistillState {
  DistillOptions<double> opt;
  at::Tensor logits, teacher;  // (N, V), unit column stride (any float dtype each)
  at::Tensor mask;             // (N,) 0/1, or undefined
  at::Tensor divisor;          // 0-dim D
  at::Tensor stats;            // (N, 7): computed here, or given (then `stats_given`)
  at::Tensor jsd_sums;         // (N, 2) for JSD: computed here, or given (then `jsd_given`)
  bool stats_given = false, jsd_given = false;
  at::Tensor row_loss, divergence;  // (N,)
  at::Tensor grad_rows;             // (N, kDistGradFields)
  at::Tensor grad;                  // (N, V) in the logits dtype, or undefined: no gradient
};

// The back-end of one device. `stats` fills state.stats for every row, `jsd_sums` fills state.jsd_sums (given
// the statistics); `rows` runs whatever of the passes is not given, the row step, and the gradient if asked.
struct DistillBackend {
  void (*stats)(const DistillState&);
  void (*jsd_sums)(const DistillState&);
  void (*rows)(const DistillState&);
};

DistillKind parse_distill_kind(const char* op, const std::string& kind, double beta);

// The public op's outputs (loss, divergence); the gradient, when asked, into `grad` (the logits' own storage
// with inplace_backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor> distillation_forward(
    const at::Tensor& logits, const at::Tensor& teacher_logits, const std::string& kind, double beta,
    double temperature, double logits_scale_factor, const std::optional<at::Tensor>& loss_mask,
    std::optional<double> divisor, const std::optional<at::Tensor>& row_stats,
    const std::optional<at::Tensor>& jsd_sums, bool compute_grad, bool inplace, const DistillBackend& backend);

// The statistics-only ops of tensor parallelism (this shard's partial statistics / JSD sums).
at::Tensor distillation_stats_op(const at::Tensor& logits, const at::Tensor& teacher_logits, double temperature,
                                 double logits_scale_factor, const DistillBackend& backend);
at::Tensor distillation_jsd_sums_op(const at::Tensor& logits, const at::Tensor& teacher_logits,
                                    const at::Tensor& row_stats, double beta, double temperature,
                                    double logits_scale_factor, const DistillBackend& backend);

template <const DistillBackend& (*kBackend)()>
struct DistillOps {
  using Opt = std::optional<at::Tensor>;
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& logits, const at::Tensor& teacher,
                                                                c10::string_view kind, double beta, double t,
                                                                double s, const Opt& mask, std::optional<double> d,
                                                                const Opt& stats, const Opt& sums, bool compute_grad) {
    return distillation_forward(logits, teacher, std::string(kind), beta, t, s, mask, d, stats, sums, compute_grad,
                                false, kBackend());
  }
  static std::tuple<at::Tensor, at::Tensor> forward_inplace(const at::Tensor& logits, const at::Tensor& teacher,
                                                            c10::string_view kind, double beta, double t, double s,
                                                            const Opt& mask, std::optional<double> d,
                                                            const Opt& stats, const Opt& sums) {
    auto [loss, divergence, grad] = distillation_forward(logits, teacher, std::string(kind), beta, t, s, mask, d,
                                                         stats, sums, true, true, kBackend());
    return {loss, divergence};
  }
  static at::Tensor stats(const at::Tensor& logits, const at::Tensor& teacher, double t, double s) {
    return distillation_stats_op(logits, teacher, t, s, kBackend());
  }
  static at::Tensor jsd_sums(const at::Tensor& logits, const at::Tensor& teacher, const at::Tensor& row_stats,
                             double beta, double t, double s) {
    return distillation_jsd_sums_op(logits, teacher, row_stats, beta, t, s, kBackend());
  }
};

// The options in the accumulation type.
template <typename acc_t>
DistillOptions<acc_t> distill_options_as(const DistillOptions<double>& o) {
  return {o.kind, acc_t(o.scale), acc_t(o.inv_temperature), acc_t(o.beta), acc_t(o.log_beta),
          acc_t(o.log_one_minus_beta)};
}

template <typename acc_t>
DistillRowStep<acc_t> make_distill_row_step(const DistillState& s) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<acc_t>() : nullptr; };
  return {distill_options_as<acc_t>(s.opt), ptr(s.stats), ptr(s.jsd_sums), ptr(s.mask),
          ptr(s.divisor), ptr(s.row_loss), ptr(s.divergence), ptr(s.grad_rows)};
}

// Dispatch over the student's and the teacher's dtypes (fp32/bf16/fp16/fp64 each).
#define RL_LOSSES_DISPATCH_DISTILL(STUDENT, TEACHER, ...)                                                    \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, STUDENT, "distillation", [&] {                  \
    using student_t = scalar_t;                                                                              \
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TEACHER, "distillation", [&] {                \
      using teacher_t = scalar_t;                                                                            \
      using acc_t = typename acc_type<student_t>::type;                                                      \
      __VA_ARGS__();                                                                                         \
    });                                                                                                      \
  })

}  // namespace rl_losses
