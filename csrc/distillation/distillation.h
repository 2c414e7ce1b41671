// Distillation against a teacher's logits (docs/distillation_dpo.md): forward / reverse KL, the soft-label
// cross-entropy and the generalised JSD, over the student's logits and the teacher's of the same shape.
//
// Passes per row: statistics of both softmaxes at once (DistillStats; given as `row_stats` under tensor
// parallelism), for JSD the sums that need both normalised rows (`jsd_sums`, idem), the row step
// (DistillRowStep: loss and gradient table), then the student's gradient, written once. The CPU runs them row
// by row (a row stays in cache); CUDA runs them in one cluster kernel where it applies (sm_90, with a gradient:
// distillation_cluster.cuh), else each pass over all rows as its own kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <optional>
#include <string>
#include <utility>

#include "distillation/distillation_math.h"
#include "op_args.h"

namespace rl_losses {

// Everything the back-end reads and writes. Tensors of the accumulation dtype unless said; optional ones are
// undefined when absent.
struct DistillState {
  DistillOptions<double> opt;
  at::Tensor logits, teacher;  // (N, V), unit column stride (any float dtype each)
  at::Tensor mask;             // (N,) 0/1, or undefined
  at::Tensor divisor;          // 0-dim D where the device counts it (the mask's rows), or undefined: divisor_value
  double divisor_value = 1.0;  // D known on the host (given, or N): no launch to fill a tensor with it
  at::Tensor stats;            // (N, 7): computed here, or given (then `stats_given`)
  at::Tensor jsd_sums;         // (N, 2) for JSD: computed here, or given (then `jsd_given`)
  bool stats_given = false, jsd_given = false;
  at::Tensor row_loss, divergence;  // (N,)
  at::Tensor grad_rows;             // (N, kDistGradFields)
  at::Tensor grad;                  // (N, V) in the logits dtype, or undefined: no gradient
  // The fused head's other terms on these rows (fused_head/), or undefined: (N, kDistHeadFields) coefficients that
  // the gradient pass adds (distill_head_grad), and the labels (N,) int64 that their b·[j = label] reads.
  at::Tensor head_coef, head_labels;
};

// The back-end of one device. `stats` fills state.stats for every row, `jsd_sums` fills state.jsd_sums (given
// the statistics); `rows` runs whatever of the passes is not given, the row step, and the gradient if asked;
// `grad` the gradient pass alone, from grad_rows (and head_coef), which the caller filled.
struct DistillBackend {
  void (*stats)(const DistillState&);
  void (*jsd_sums)(const DistillState&);
  void (*rows)(const DistillState&);
  void (*grad)(const DistillState&);
};
const DistillBackend& distill_backend_cpu();

DistillKind parse_distill_kind(const char* op, const std::string& kind, double beta);
// β in [0, 1] (distillation's and the top-K op's; `name`: the op's name for it).
void check_distill_beta(const char* op, double beta, const char* name = "beta");
// The term's checks and state of the distillation op and of the fused head's distillation term (`op` and the
// names of its β and its mask in the messages): the rows of both logits, the options, the mask and the divisor D
// (given, or the mask's rows, at least 1); the statistics, row outputs and gradient table allocated, not filled.
// `is_view`: the logits' rows are a view of them (inplace_backward needs it).
struct DistillTermArgs {
  const at::Tensor& logits;
  const at::Tensor& teacher;
  const std::string& kind;
  double beta, temperature, scale;
  const OptTensor& mask;
  std::optional<double> divisor;
  const char* beta_name;
  const char* mask_name;
};
DistillState distill_term_state(const char* op, const DistillTermArgs& a, bool* is_view = nullptr);
// The kernels' options of a kind and β (log β and log(1−β) for JSD, where 0 < β < 1), temperature and scale.
DistillOptions<double> make_distill_options(DistillKind kind, double beta, double temperature, double scale);

// distillation's arguments (op_args.h), and those of its tensor-parallel statistics ops.
#define RL_LOSSES_DISTILLATION_ARGS(X) \
  RL_LOSSES_DISTILL_INPUT(X) RL_LOSSES_DISTILLATION_KEYWORDS(X) RL_LOSSES_DISTILL_HOOKS(X)
RL_LOSSES_ARG_GROUP(DistillationArgs, RL_LOSSES_DISTILLATION_ARGS)
#define RL_LOSSES_DISTILL_STATS_ARGS(X) RL_LOSSES_DISTILL_INPUT(X) RL_LOSSES_DISTILL_SOFTMAX(X)
RL_LOSSES_ARG_GROUP(DistillStatsArgs, RL_LOSSES_DISTILL_STATS_ARGS)
#define RL_LOSSES_DISTILL_JSD_ARGS(X) \
  RL_LOSSES_DISTILL_INPUT(X) RL_LOSSES_DISTILL_STATS_INPUT(X) RL_LOSSES_DISTILL_BETA(X) RL_LOSSES_DISTILL_SOFTMAX(X)
RL_LOSSES_ARG_GROUP(DistillJsdArgs, RL_LOSSES_DISTILL_JSD_ARGS)
RL_LOSSES_RESULT_GROUP(DistillResults, RL_LOSSES_DISTILL_RESULTS)
RL_LOSSES_RESULT_GROUP(DistillJsdResult, RL_LOSSES_DISTILL_JSD_RESULTS)

// The public op's results (loss, divergence) and the gradient, when asked: into `grad` (the logits' own storage
// with inplace_backward), else an empty placeholder.
std::pair<DistillResults, at::Tensor> distillation_forward(const DistillationArgs& a, bool compute_grad, bool inplace,
                                                           const DistillBackend& backend);

// The statistics-only ops of tensor parallelism (this shard's partial statistics / JSD sums).
at::Tensor distillation_stats_op(const DistillStatsArgs& a, const DistillBackend& backend);
at::Tensor distillation_jsd_sums_op(const DistillJsdArgs& a, const DistillBackend& backend);

// The registered kernels of one back-end (boxed, arguments by name: common/schema.h).
template <const DistillBackend& (*kBackend)()>
struct DistillKernels {
  template <bool kInplace>
  static void forward(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    const bool compute_grad = !kInplace && args.read<ComputeGradArg>().compute_grad;
    const auto [results, grad] = distillation_forward(args.read<DistillationArgs>(), compute_grad, kInplace,
                                                      kBackend());
    results.write(args);
    if (!kInplace) GradResult{grad}.write(args);
    args.push_results();
  }
  static void stats(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    StatsResult{distillation_stats_op(args.read<DistillStatsArgs>(), kBackend())}.write(args);
    args.push_results();
  }
  static void jsd_sums(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    DistillJsdResult{distillation_jsd_sums_op(args.read<DistillJsdArgs>(), kBackend())}.write(args);
    args.push_results();
  }
};

// The options in the accumulation type.
template <typename acc_t>
DistillOptions<acc_t> distill_options_as(const DistillOptions<double>& o) {
  return {.kind = o.kind,
          .scale = acc_t(o.scale),
          .inv_temperature = acc_t(o.inv_temperature),
          .beta = acc_t(o.beta),
          .log_beta = acc_t(o.log_beta),
          .log_one_minus_beta = acc_t(o.log_one_minus_beta)};
}

template <typename acc_t>
DistillRowStep<acc_t> make_distill_row_step(const DistillState& s) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<acc_t>() : nullptr; };
  return {distill_options_as<acc_t>(s.opt), ptr(s.stats), ptr(s.jsd_sums), ptr(s.mask),
          ptr(s.divisor), acc_t(s.divisor_value), ptr(s.row_loss), ptr(s.divergence), ptr(s.grad_rows)};
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
