#include "combined/fused_head.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/checks.h"

namespace rl_losses {

std::vector<at::Tensor> fused_head_forward(RowSource& src, const at::Tensor& target, double label_weight,
                                           double label_smoothing, std::optional<double> label_divisor,
                                           double z_loss_weight, std::optional<double> z_loss_divisor,
                                           const std::optional<at::Tensor>& z_loss_mask, double grpo_weight,
                                           const std::optional<at::Tensor>& advantages,
                                           const std::optional<at::Tensor>& old_log_probs,
                                           const std::optional<at::Tensor>& ref_log_probs,
                                           const std::optional<at::Tensor>& loss_weights, double epsilon_low,
                                           double epsilon_high, std::optional<double> delta, double beta,
                                           std::optional<double> grpo_divisor, double logits_scale_factor,
                                           const std::optional<at::Tensor>& row_stats,
                                           const FusedHeadBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  const double weights[kHeadTerms] = {label_weight, z_loss_weight, grpo_weight};
  const char* names[kHeadTerms] = {"label_weight", "z_loss_weight", "grpo_weight"};
  for (int k = 0; k < kHeadTerms; ++k) {
    TORCH_CHECK(std::isfinite(weights[k]) && weights[k] >= 0, op, ": ", names[k], " must be finite and >= 0, got ",
                weights[k]);
  }
  TORCH_CHECK(std::isfinite(label_smoothing) && label_smoothing >= 0 && label_smoothing < 1, op,
              ": label_smoothing must be in [0, 1), got ", label_smoothing);
  check_divisor(op, label_divisor);
  check_divisor(op, z_loss_divisor);
  check_divisor(op, grpo_divisor);
  check_row_stats(op, row_stats, f);
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  FusedHeadRows rows;
  rows.ce = {1.0, label_smoothing, 0.0, static_cast<double>(f.vocab_total)};
  rows.grpo = {{epsilon_low, epsilon_high, delta ? *delta : std::numeric_limits<double>::infinity()},
               kPpoClip, 1.0, 1.0, beta, kKlK3, false, kRolloutNone, 1.0, 0.0, 0.0, 0.0};
  for (int k = 0; k < kHeadTerms; ++k) rows.weight[k] = weights[k];
  if (grpo_weight != 0) {
    check_epsilons(op, epsilon_low, epsilon_high);
    TORCH_CHECK(!delta || (std::isfinite(*delta) && *delta > 1 + epsilon_high), op,
                ": delta must exceed 1 + epsilon_high = ", 1 + epsilon_high, ", got ", delta ? *delta : 0.0);
    TORCH_CHECK(std::isfinite(beta) && beta >= 0, op, ": beta must be >= 0, got ", beta);
    TORCH_CHECK(advantages && old_log_probs, op, ": grpo_weight = ", grpo_weight,
                " > 0 needs advantages and old_log_probs");
    TORCH_CHECK(beta == 0 || ref_log_probs, op, ": beta = ", beta, " > 0 needs ref_log_probs");
    rows.advantages = check_per_token(op, "advantages", *advantages, target, acc);
    rows.old_log_probs = check_per_token(op, "old_log_probs", *old_log_probs, target, acc);
    if (beta != 0) rows.ref_log_probs = check_per_token(op, "ref_log_probs", *ref_log_probs, target, acc);
    if (loss_weights) rows.loss_weights = check_per_token(op, "loss_weights", *loss_weights, target, acc);
  }
  if (z_loss_weight != 0 && z_loss_mask) {
    const at::Tensor& m = *z_loss_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isIntegralType(m.scalar_type(), false), op,
                ": z_loss_mask must be a bool or integer tensor, got ", m.scalar_type());
    TORCH_CHECK(m.device() == f.options.device() && m.sizes() == target.sizes(), op,
                ": z_loss_mask must have the target's shape ", target.sizes(), " and device ", f.options.device(),
                ", got ", m.sizes(), " on ", m.device());
    rows.z_mask = m.reshape({-1}).ne(0).to(acc).contiguous();
  }
  // Each divisor: given, or the number of the term's tokens (at least 1; no host synchronisation): the labelled
  // ones for CE and GRPO, those of z_loss_mask (every token without one) for the z-loss.
  at::Tensor n_labelled;
  const std::optional<double> divisors[kHeadTerms] = {label_divisor, z_loss_divisor, grpo_divisor};
  for (int k = 0; k < kHeadTerms; ++k) {
    if (divisors[k]) {
      rows.divisor[k] = at::full({}, *divisors[k], opts);
    } else if (k == kHeadZLoss) {
      rows.divisor[k] = rows.z_mask.defined() ? sum_1d(rows.z_mask).clamp_min(1)
                                              : at::full({}, static_cast<double>(std::max<int64_t>(f.n_rows, 1)), opts);
    } else {
      if (!n_labelled.defined()) n_labelled = labelled_count(f.target1d, acc);
      rows.divisor[k] = n_labelled;
    }
  }
  rows.out = at::empty({f.n_rows, kHeadTerms}, opts);
  rows.log_probs = at::empty({f.n_rows}, opts);
  for (auto& t : rows.scalars) t = at::empty({}, opts);

  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  rows.labels = f.target1d;
  if (row_stats) args.stats_in = *row_stats;
  if (z_loss_weight != 0) {
    // The z-loss's unlabelled tokens get the stand-in label 0, so that the row pass reads them (the epilogue
    // reads the true labels); the other unlabelled rows stay skipped.
    at::Tensor z_only = f.target1d < 0;
    if (rows.z_mask.defined()) z_only = z_only.logical_and(rows.z_mask != 0);
    args.target = at::where(z_only, at::zeros({}, f.target1d.options()), f.target1d);
    // The row pass takes the label's logit from the statistics, which, given (tensor parallelism), hold 0 on
    // those rows: the shard holding column 0 puts its logit there (read before any in-place gradient).
    if (row_stats && f.vocab_start == 0 && f.n_rows > 0 && f.vocab > 0) {
      at::Tensor label_logit = f.logits2d.select(1, 0).to(acc) * logits_scale_factor;
      args.stats_in = row_stats->clone(at::MemoryFormat::Contiguous);
      args.stats_in.select(1, 4).copy_(at::where(z_only, label_logit, args.stats_in.select(1, 4)));
    }
  }
  args.smoothing = label_smoothing != 0 && label_weight != 0;
  if (f.n_rows > 0) {
    src.run(args, src.wants_grad(), [&](RowPassArgs& a) {
      split_stats_pass_on_cuda(a);
      backend.rows(a, rows);
    });
  }
  backend.totals(rows);
  std::vector<at::Tensor> out(std::begin(rows.scalars), std::end(rows.scalars));
  out.push_back(rows.log_probs.view(target.sizes()));
  return out;
}

}  // namespace rl_losses
