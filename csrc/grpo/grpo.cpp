#include "grpo/grpo.h"

#include <cmath>
#include <limits>

#include "common/checks.h"

namespace rl_losses {

std::vector<at::Tensor> grpo_forward(RowSource& src, const at::Tensor& target, const at::Tensor& advantages,
                                     const at::Tensor& old_log_probs, const std::optional<at::Tensor>& ref_log_probs,
                                     const std::optional<at::Tensor>& loss_weights,
                                     const std::optional<at::Tensor>& label_counts, double epsilon_low,
                                     double epsilon_high, std::optional<double> delta, double beta,
                                     std::optional<double> divisor, double logits_scale_factor, bool compute_entropy,
                                     const std::optional<at::Tensor>& row_stats, const GrpoBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  check_epsilons(op, epsilon_low, epsilon_high);
  TORCH_CHECK(!delta || std::isfinite(*delta), op, ": delta must be finite (leave it unset for no cap), got ",
              delta ? *delta : 0.0);
  TORCH_CHECK(!delta || *delta > 1 + epsilon_high, op, ": delta must exceed 1 + epsilon_high = ", 1 + epsilon_high,
              ", got ", delta ? *delta : 0.0);
  TORCH_CHECK(std::isfinite(beta) && beta >= 0, op, ": beta must be >= 0, got ", beta);
  TORCH_CHECK(beta == 0 || ref_log_probs.has_value(), op, ": beta = ", beta, " > 0 needs ref_log_probs");
  check_divisor(op, divisor);
  check_row_stats(op, row_stats, f);

  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  GrpoRows rows;
  rows.opt = {{epsilon_low, epsilon_high, delta ? *delta : std::numeric_limits<double>::infinity()}, beta};
  rows.advantages = check_per_token(op, "advantages", advantages, target, acc);
  rows.old_log_probs = check_per_token(op, "old_log_probs", old_log_probs, target, acc);
  if (beta != 0) rows.ref_log_probs = check_per_token(op, "ref_log_probs", *ref_log_probs, target, acc);
  if (loss_weights) rows.loss_weights = check_per_token(op, "loss_weights", *loss_weights, target, acc);
  at::Tensor counts;
  if (label_counts) {
    counts = check_label_counts(op, *label_counts, target, acc);
  }
  const at::Tensor n_labelled = labelled_count(f.target1d, acc);
  rows.divisor = divisor ? at::full({}, *divisor, opts) : n_labelled;
  rows.out = at::empty({f.n_rows, kGrpoFields}, opts);
  rows.log_probs = at::empty({f.n_rows}, opts);
  rows.entropy = compute_entropy;

  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  if (row_stats) args.stats_in = *row_stats;
  args.entropy = compute_entropy && !row_stats;
  if (f.n_rows > 0) {
    src.run(args, src.wants_grad(), [&](RowPassArgs& a) {
      split_stats_pass_on_cuda(a);
      backend.rows(a, rows);
    });
  }

  // Metrics (docs/math.md) in one reduction over the per-token outputs: no extra pass over the vocabulary, and
  // one launch where a column sum and a division per metric took one each (2-3 us apiece on a GPU).
  const PolicyScalarOutputs scalars(opts);
  backend.metrics(rows, f.target1d, counts, n_labelled, scalars);
  return scalars.with_log_probs(rows.log_probs.view(target.sizes()));
}

}  // namespace rl_losses
