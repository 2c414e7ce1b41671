#include "topk_distillation/topk_distillation.h"

#include <ATen/ops/isnan.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/TensorOperators.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "common/checks.h"

namespace rl_losses {

namespace {

// How far above 1 a row's teacher mass may be (the engine's log-probs rounded) before it is refused.
constexpr double kTeacherMassTolerance = 1e-3;

TopkTail parse_tail(const char* op, const std::string& tail) {
  if (tail == "none") return TopkTail::kNone;
  if (tail == "renormalize") return TopkTail::kRenormalize;
  if (tail == "tail") return TopkTail::kTail;
  TORCH_CHECK(false, op, ": tail must be 'none', 'renormalize' or 'tail', got '", tail, "'");
}

// kind and β as distillation's (its kinds but cross_entropy; jsd at β = 0 or 1 is the forward or the reverse KL).
DistillOptions<double> parse_options(const char* op, const std::string& kind, double beta) {
  check_distill_beta(op, beta);
  TORCH_CHECK(kind == "forward_kl" || kind == "reverse_kl" || kind == "jsd", op,
              ": kind must be 'forward_kl', 'reverse_kl' or 'jsd', got '", kind, "'");
  return make_distill_options(parse_distill_kind(op, kind, beta), beta, 1.0, 1.0);
}

// teacher_ids (int64) and teacher_log_probs (floating), both shaped target's batch dims + (K,), 1 <= K <= V.
void check_teacher_shapes(const char* op, const at::Tensor& ids, const at::Tensor& lp, const at::Tensor& target,
                          const FlatLogits& f) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, ": teacher_ids must be int64, got ",
              c10::toString(ids.scalar_type()));
  TORCH_CHECK(at::isFloatingType(lp.scalar_type()), op, ": teacher_log_probs must be a floating-point tensor, got ",
              c10::toString(lp.scalar_type()));
  TORCH_CHECK(ids.device() == target.device(), op, ": teacher_ids is on ", ids.device(), " but target is on ",
              target.device());
  TORCH_CHECK(lp.device() == target.device(), op, ": teacher_log_probs is on ", lp.device(), " but target is on ",
              target.device());
  TORCH_CHECK(ids.dim() == target.dim() + 1 && ids.sizes().slice(0, target.dim()) == target.sizes(), op,
              ": teacher_ids must have shape (batch..., K) with batch shape ", target.sizes(), ", got ", ids.sizes());
  TORCH_CHECK(lp.sizes() == ids.sizes(), op, ": teacher_log_probs has shape ", lp.sizes(), " but teacher_ids has ",
              ids.sizes());
  const int64_t k = ids.size(-1);
  TORCH_CHECK(k >= 1 && k <= f.vocab_total, op, ": teacher_ids must hold 1 <= K <= vocab_size ids per row, got K = ",
              k, " with vocab_size ", f.vocab_total);
}

// Whether the teacher's values are read on the host: always on the CPU; on a GPU (a synchronisation) only with
// RL_LOSSES_CHECK_INPUTS=1, as the labels' range check (docs/api.md); without it an id out of range trips the
// gather's device-side assert, and the other checks are not made.
bool check_values(const at::Tensor& ids) {
  if (ids.is_cpu()) return true;
  const char* v = std::getenv("RL_LOSSES_CHECK_INPUTS");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// The values of the labelled rows (an unlabelled row is not read): ids in [0, V) and distinct, log-probs not NaN,
// mass at most 1 + kTeacherMassTolerance. The offending row is read only on failure.
void check_teacher_values(const char* op, const at::Tensor& ids, const at::Tensor& lp, const at::Tensor& target1d,
                          int64_t vocab) {
  const at::Tensor keep = (target1d >= 0).unsqueeze(1);
  const at::Tensor out_of_range = ((ids < 0) | (ids >= vocab)) & keep;
  const at::Tensor sorted = std::get<0>(ids.sort(1));
  const at::Tensor repeated = (sorted.slice(1, 1) == sorted.slice(1, 0, -1)) & keep;
  const at::Tensor nan = at::isnan(lp) & keep;
  const at::Tensor log_mass = at::logsumexp(at::where(keep, lp, -std::numeric_limits<double>::infinity()), 1);
  const at::Tensor heavy = log_mass > std::log1p(kTeacherMassTolerance);
  const at::Tensor flags =
      at::stack({out_of_range.any(), repeated.any(), nan.any(), heavy.any()}).cpu();
  const bool* f = flags.const_data_ptr<bool>();
  if (f[0]) {
    const at::Tensor at_ = out_of_range.nonzero()[0].cpu();
    const int64_t r = at_[0].item<int64_t>(), i = at_[1].item<int64_t>();
    TORCH_CHECK(false, op, ": teacher_ids: id ", ids[r][i].item<int64_t>(), " at row ", r, ", position ", i,
                " is out of range for vocab_size ", vocab);
  }
  if (f[1]) {
    const at::Tensor at_ = repeated.nonzero()[0].cpu();
    const int64_t r = at_[0].item<int64_t>();
    TORCH_CHECK(false, op, ": teacher_ids: row ", r, " holds id ", sorted[r][at_[1].item<int64_t>()].item<int64_t>(),
                " more than once (a row's K ids must be distinct)");
  }
  if (f[2]) {
    const at::Tensor at_ = nan.nonzero()[0].cpu();
    TORCH_CHECK(false, op, ": teacher_log_probs: NaN at row ", at_[0].item<int64_t>(), ", position ",
                at_[1].item<int64_t>());
  }
  if (f[3]) {
    const int64_t r = heavy.nonzero()[0][0].item<int64_t>();
    TORCH_CHECK(false, op, ": teacher_log_probs: the probabilities of row ", r, " sum to ",
                std::exp(log_mass[r].item<double>()), ", above 1 + ", kTeacherMassTolerance);
  }
}

// t as a contiguous (n, k) tensor of `dtype`, with no ATen call where it is one already (each, a no-op too, costs a
// GPU's host a few us).
at::Tensor rows_of_k(const at::Tensor& t, int64_t n, int64_t k, at::ScalarType dtype) {
  const at::Tensor r = t.dim() == 2 ? t : t.reshape({n, k});
  return (r.scalar_type() == dtype ? r : r.to(dtype)).contiguous();
}

}  // namespace

TopkDistillationResults topk_distillation_forward(RowSource& src, const at::Tensor& target,
                                                  const TopkDistillationArgs& a, const TopkHooks& hooks,
                                                  TopkBackend backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  // A vocabulary shard holds neither the whole row's statistics nor every id's logit: both come as hooks.
  TORCH_CHECK(hooks.row_stats.has_value() == hooks.student_at_ids.has_value(), op,
              ": row_stats and student_at_ids are a vocabulary shard's hooks: give both or neither");
  TORCH_CHECK((f.vocab_start == 0 && f.vocab == f.vocab_total) || hooks.row_stats, op,
              ": a vocabulary shard (vocab_start=", f.vocab_start, ", vocab_size=", f.vocab_total,
              ") needs row_stats and student_at_ids (the whole vocabulary's; rl_losses.topk_distillation_loss(..., "
              "tp_group=) makes them)");
  const TopkTail tail = parse_tail(op, a.tail);
  const DistillOptions<double> opt = parse_options(op, a.kind, a.beta);
  check_scale(op, a.logits_scale_factor);
  check_divisor(op, a.divisor);
  check_teacher_shapes(op, a.teacher_ids, a.teacher_log_probs, target, f);
  check_row_stats(op, hooks.row_stats, f);
  const int64_t n = f.n_rows, k = a.teacher_ids.size(-1);
  const auto opts = src.acc_options();
  if (hooks.student_at_ids) {
    const at::Tensor& x = *hooks.student_at_ids;
    TORCH_CHECK(x.sizes() == a.teacher_ids.sizes(), op, ": student_at_ids has shape ", x.sizes(),
                " but teacher_ids has ", a.teacher_ids.sizes());
    TORCH_CHECK(x.scalar_type() == opts.dtype().toScalarType(), op,
                ": student_at_ids must be float32 (float64 for float64 logits), got ", x.scalar_type());
    TORCH_CHECK(x.device() == f.options.device(), op, ": student_at_ids is on ", x.device(), " but logits is on ",
                f.options.device());
  }
  // The buffers between the passes: one allocation (new_scratch); x only where no shard's hook gives it.
  const bool x_given = hooks.student_at_ids.has_value();
  const std::vector<at::Tensor> scratch =
      new_scratch(opts, {{x_given ? 0 : n, k}, {n, kTopkPrepFields}, {n, kTopkGradFields}});
  TopkRows rows{.opt = opt,
                .tail = tail,
                .ids = rows_of_k(a.teacher_ids, n, k, a.teacher_ids.scalar_type()),
                .log_probs = rows_of_k(a.teacher_log_probs, n, k, opts.dtype().toScalarType()),
                .x = x_given ? rows_of_k(*hooks.student_at_ids, n, k, opts.dtype().toScalarType()) : scratch[0],
                .x_given = x_given,
                .prep = scratch[1],
                .grad_rows = scratch[2],
                .divisor = a.divisor ? at::Tensor() : labelled_count(f.target1d, opts.dtype().toScalarType()),
                .divisor_value = a.divisor.value_or(1.0),
                .row_loss = src.row_outputs({n}),
                .divergence = src.row_outputs({n}),
                .student_mass = src.row_outputs({n}),
                .teacher_mass = src.row_outputs({n})};
  if (n > 0) {
    if (check_values(rows.ids)) check_teacher_values(op, rows.ids, rows.log_probs, f.target1d, f.vocab_total);
    RowPassArgs args = make_row_pass_args(f, a.logits_scale_factor);
    if (hooks.row_stats) args.stats_in = *hooks.row_stats;
    src.run(args, src.wants_grad(), [&](RowPassArgs& p) {
      // The first pass over these rows: it computes their statistics, or they were given (the logits op's one pass).
      const bool gather = p.compute_stats() || hooks.row_stats.has_value();
      if (p.compute_stats() && topk_needs_jsd_step(opt)) {
        stats_pass_first(p);
      } else {
        split_stats_pass_on_cuda(p);
      }
      backend(p, rows, gather);
    });
  }
  const auto batch = target.sizes();
  return {sum_1d(rows.row_loss), rows.divergence.view(batch), rows.student_mass.view(batch),
          rows.teacher_mass.view(batch)};
}

}  // namespace rl_losses
