#include "grpo/grpo.h"

#include <cmath>
#include <limits>
#include <tuple>

#include "common/checks.h"
#include "common/sampler.h"
#include "common/row_stats.h"

namespace rl_losses {

PolicyResults grpo_forward(RowSource& src, const at::Tensor& target, const GrpoArgs& a, const OptTensor& row_stats,
                           const GrpoBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, a.logits_scale_factor);
  check_clip(op, a.clip, a.beta, a.ref_log_probs.has_value());
  check_divisor(op, a.divisor);
  check_row_stats(op, row_stats, f);
  const PolicyOptions<double> opt = make_policy_options(op, a.policy, &a.fused, &a.clip, a.beta,
                                                        a.rollout_log_probs.has_value());
  check_token_ratio_loss_type(op, opt, a.policy);
  const bool sequence_rollout = sequence_level_rollout(a.policy);
  const bool vespo = opt.loss_type == kVespo;
  TORCH_CHECK(!a.document_index || sequence_rollout || vespo, op, ": document_index groups the tokens of a "
              "sequence-level rollout_correction or of loss_type 'vespo'; got it with rollout_correction = '",
              a.policy.rollout_correction.value_or("None"), "' and loss_type '", a.policy.loss_type, "'");
  TORCH_CHECK(!a.num_documents || a.document_index, op, ": num_documents = ", a.num_documents.value_or(0),
              " counts the ids of document_index, which is not given");

  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  GrpoRows rows;
  rows.opt = opt;
  rows.advantages = check_per_token(op, "advantages", broadcast_per_sequence(a.advantages, target), target, acc);
  if (a.old_log_probs) rows.old_log_probs = check_per_token(op, "old_log_probs", *a.old_log_probs, target, acc);
  if (a.ref_log_probs) rows.ref_log_probs = check_per_token(op, "ref_log_probs", *a.ref_log_probs, target, acc);
  if (a.loss_weights) rows.loss_weights = check_per_token(op, "loss_weights", *a.loss_weights, target, acc);
  at::Tensor rollout;
  if (a.rollout_log_probs) rollout = check_per_token(op, "rollout_log_probs", *a.rollout_log_probs, target, acc);
  at::Tensor counts;
  if (a.label_counts) counts = check_label_counts(op, *a.label_counts, target, acc);
  rows.out = src.row_outputs({f.n_rows, kGrpoFields});
  rows.log_probs = src.row_outputs({f.n_rows});
  // The statistics hold Σp·x when the entropy is a metric or, with its gradient, a term of the loss.
  rows.entropy = a.compute_entropy || opt.entropy_coefficient != 0;

  RowPassArgs args = make_row_pass_args(f, a.logits_scale_factor);
  set_sampler_params(args, op, a.sampler, target, f.n_rows, opts, row_stats.has_value());
  if (row_stats) args.stats_in = *row_stats;
  args.entropy = rows.entropy && !row_stats;
  // The statistics as a pass of their own (one more read of the logits, as GSPO's) where a step before the loss
  // pass needs every token's log-prob; the loss pass then reads them.
  const auto statistics_first = [&] {
    if (args.stats_in.defined()) return;
    at::Tensor stats = src.row_outputs({f.n_rows, RowStats<double>::kFields});
    if (f.n_rows > 0) src.run(args, false, [&](RowPassArgs& a) { backend.stats(a, stats); });
    args.stats_in = stats;
    args.entropy = false;
  };
  if (sequence_rollout || vespo) {
    // The sequences' sums (docs/policy_losses.md), before the loss pass. Where they need every token's
    // log-prob (vespo's log-ratios lp − old; on-policy, the rollout ratios with old = lp), the statistics come
    // first; otherwise the sums take only inputs and the loss stays one pass over the logits.
    const SequenceIds seq = sequence_ids(op, a.document_index, a.num_documents, target,
                                         vespo ? "loss_type 'vespo'" : "a sequence-level rollout_correction");
    const bool on_policy = !rows.old_log_probs.defined();
    const bool needs_log_probs = (vespo && !on_policy) || (on_policy && rollout.defined());
    if (needs_log_probs) statistics_first();
    GrpoSequences q;
    q.opt = opt;
    q.target = f.target1d;
    q.ids = seq.ids;
    q.row_length = seq.row_length;
    q.count = seq.count;
    if (needs_log_probs) q.stats = args.stats_in;
    q.old_log_probs = rows.old_log_probs;
    q.rollout_log_probs = rollout;
    q.advantages = rows.advantages;
    q.sequence_rollout = sequence_rollout;
    q.safe_sequence = new_empty({f.n_rows}, opts.dtype(at::kLong));
    q.terms = new_empty({f.n_rows, kSeqSums}, opts);
    q.sums = new_empty({seq.count, kSeqSums}, opts);
    if (sequence_rollout) rows.sequence_log_rho = new_empty({f.n_rows}, opts);
    if (vespo) {
      rows.vespo_phi = new_empty({f.n_rows}, opts);
      rows.sequence_share = new_empty({f.n_rows}, opts);
    }
    backend.sequences(q, rows);
  }
  if (cov_loss_type(opt.loss_type)) {
    // clip_cov's / kl_cov's subset, from every labelled token's log-prob (docs/policy_losses.md).
    statistics_first();
    at::Tensor lp = new_empty({f.n_rows}, opts);
    backend.log_probs(args.stats_in, f.target1d, lp);
    rows.cov_selected = cov_selection(a.policy, opt, lp, rows.old_log_probs.defined() ? rows.old_log_probs : lp,
                                      rows.advantages, f.target1d.ge(0));
  }
  // Token-level correction weights (and, with vespo, their metrics: vespo folds them into φ).
  if (!sequence_rollout) rows.rollout_log_probs = rollout;
  // The labelled count, a one-block launch, is the kernel right before the loss pass, here as without the
  // sequence steps: the cluster kernel is launched while the kernel before it still runs (dependent launch),
  // and a 64-block one (GrpoSequenceStep) there measured 25% slower (docs/design.md, 2026-11-24: the SMs
  // holding one of its blocks when the cluster kernel's CTAs are placed).
  // The metrics need the labelled count; a given divisor is written by the same launch (no fill kernel).
  at::Tensor n_labelled;
  if (a.divisor) {
    std::tie(n_labelled, rows.divisor) = labelled_count_and_constant(f.target1d, acc, *a.divisor);
  } else {
    n_labelled = labelled_count(f.target1d, acc);
    rows.divisor = n_labelled;
  }
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
  return policy_results(scalars, rows.log_probs.view(target.sizes()));
}

}  // namespace rl_losses
