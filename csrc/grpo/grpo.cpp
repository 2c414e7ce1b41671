#include "grpo/grpo.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "common/checks.h"
#include "common/sampler.h"
#include "common/row_stats.h"

namespace rl_losses {

namespace {

// The aggregation presets the op computes (rl_losses.aggregation.PRESETS).
constexpr const char* kAggregations[] = {"token_mean", "sequence_mean_token_mean", "sequence_sum_constant", "luspo"};

// The weights and divisor of an aggregation preset over the kept labels (docs/policy_losses.md): w = u·m, divided by
// the sequence's kept count for sequence_mean_token_mean (u: loss_weights, else 1); D given, else Σm for token_mean,
// the sequences holding a kept token (times the row length T for sequence_sum_constant) for the others.
std::pair<at::Tensor, at::Tensor> aggregate(const std::string& preset, const at::Tensor& kept_mask,
                                            const at::Tensor& given_weights, std::optional<double> divisor,
                                            const SequenceIds& seq, const at::TensorOptions& opts) {
  const at::Tensor m = kept_mask.to(opts.dtype());
  at::Tensor w = given_weights.defined() ? given_weights * m : m;
  if (preset == "token_mean") {
    return {w, divisor ? at::full({}, *divisor, opts) : m.sum().clamp_min(1)};
  }
  const auto [ids, in_sequence] = sequence_of_tokens(seq, kept_mask.numel(), kept_mask.device());
  w = w * in_sequence;
  const at::Tensor counts = at::zeros({seq.count}, opts).index_add(0, ids, m * in_sequence);
  if (preset == "sequence_mean_token_mean") w = w / counts.clamp_min(1).index_select(0, ids);
  if (divisor) return {w, at::full({}, *divisor, opts)};
  const int64_t constant = preset == "sequence_sum_constant" ? seq.row_length : 1;
  return {w, counts.gt(0).sum().to(opts.dtype()).clamp_min(1) * constant};
}

}  // namespace

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
  const bool bypass = a.fused.bypass_mode;
  const std::vector<RejectionRule> rules =
      rollout_rejection_rules(op, a.fused.rollout_rs, a.fused.rollout_rs_threshold, a.old_log_probs.has_value(),
                              a.rollout_log_probs.has_value(), bypass);
  TORCH_CHECK(rules.empty() || !vespo, op, ": rollout_rs does not apply to loss_type 'vespo' (its sequence weight "
              "would count the rejected tokens), got rollout_rs = '", a.fused.rollout_rs.value_or(""), "'");
  if (a.aggregation) {
    TORCH_CHECK(std::find(std::begin(kAggregations), std::end(kAggregations), *a.aggregation) !=
                    std::end(kAggregations),
                op, ": aggregation must be None, 'token_mean', 'sequence_mean_token_mean', 'sequence_sum_constant' or "
                "'luspo', got '", *a.aggregation, "'");
  }
  TORCH_CHECK(!a.aggregation || *a.aggregation != "sequence_sum_constant" || a.divisor || !a.document_index, op,
              ": aggregation 'sequence_sum_constant' over document_index needs divisor (B·max_completion_length): its "
              "constant is the row length of (B, T) labels only");
  const bool sequence_aggregation = a.aggregation && *a.aggregation != "token_mean";
  // label_counts with a rejection: each document's count less its rejected tokens.
  const bool recount = !rules.empty() && a.label_counts;
  TORCH_CHECK(!a.document_index || sequence_rollout || vespo || has_sequence_rule(rules) || sequence_aggregation ||
                  recount,
              op, ": document_index groups the tokens of a sequence-level rollout_correction, of loss_type 'vespo', "
              "of a sequence rollout_rs mode or of a sequence aggregation; got it with rollout_correction = '",
              a.policy.rollout_correction.value_or("None"), "', loss_type '", a.policy.loss_type, "', rollout_rs = '",
              a.fused.rollout_rs.value_or("None"), "' and aggregation '", a.aggregation.value_or("None"), "'");
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
  if (bypass && !rows.old_log_probs.defined()) rows.old_log_probs = rollout;  // verl's old_log_prob := rollout's
  at::Tensor counts;
  if (a.label_counts) counts = check_label_counts(op, *a.label_counts, target, acc);
  SequenceIds seq;
  if (sequence_rollout || vespo || has_sequence_rule(rules) || sequence_aggregation || recount) {
    seq = sequence_ids(op, a.document_index, a.num_documents, target,
                       vespo              ? "loss_type 'vespo'"
                       : sequence_rollout ? "a sequence-level rollout_correction"
                       : !rules.empty()   ? "rollout_rs (its sequence modes, or label_counts recounted)"
                                          : "a sequence aggregation");
  }
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
  // The rollout rejection's pre-pass: the tokens it rejects are unlabelled from here on, for the loss weights, the
  // counts and the metrics. The row pass still sees the source's labels (the fused lm_head gathers its rows
  // before); their weight 0 leaves them out of the loss and the gradient, and their outputs are cleared. It judges
  // the inputs old_log_probs, or in bypass_mode the current log-probs (docs/verl_menu.md, "verl's
  // bypass_mode"). Those come from the loss pass itself where the kept tokens' weights are the pass's (a given
  // divisor; sequence_mean_token_mean's per-sequence count changes only where a token rule rejects part of a
  // sequence): the token rules are judged in the pass (GrpoEpilogue: a rejected row writes no gradient), the
  // sequence rules, which need every token of a sequence, after it, where a rejected row's gradient can be zeroed
  // then (a factor of the backward's) or there is no gradient. Otherwise the statistics come first (one more read
  // of the logits: less than rescaling every kept row in the backward, a read and a write of the gradient).
  const bool bypass_rules = bypass && !rules.empty();
  const bool token_rule = std::any_of(rules.begin(), rules.end(),
                                      [](const RejectionRule& r) { return r.level == RejectionRule::kToken; });
  const bool reject_after = bypass_rules && a.divisor &&
                            (a.aggregation.value_or("") != "sequence_mean_token_mean" || !token_rule) &&
                            !cov_loss_type(opt.loss_type) &&
                            (!has_sequence_rule(rules) || !src.wants_grad() || src.grad_scaled_by_rows());
  if (reject_after && token_rule) {
    rows.judged_rollout_log_probs = rollout;
    rows.rejection = token_rejection(rules);
  }
  at::Tensor judged = rows.old_log_probs;
  if (bypass_rules && !reject_after) {
    statistics_first();
    judged = new_empty({f.n_rows}, opts);
    backend.log_probs(args.stats_in, f.target1d, judged);
  }
  at::Tensor kept = reject_after ? f.target1d : reject_rollout_tokens(rules, f.target1d, judged, rollout, seq);
  at::Tensor kept_mask_once;  // kept >= 0, computed once where a step below needs it
  const auto kept_mask = [&]() -> const at::Tensor& {
    if (!kept_mask_once.defined()) kept_mask_once = kept.ge(0);
    return kept_mask_once;
  };
  if (sequence_rollout || vespo) {
    // The sequences' sums (docs/policy_losses.md), before the loss pass. Where they need every token's
    // log-prob (vespo's log-ratios lp − old; on-policy, the rollout ratios with old = lp), the statistics come
    // first; otherwise the sums take only inputs and the loss stays one pass over the logits.
    const bool on_policy = !rows.old_log_probs.defined();
    const bool needs_log_probs = (vespo && !on_policy) || (on_policy && rollout.defined());
    if (needs_log_probs) statistics_first();
    GrpoSequences q;
    q.opt = opt;
    q.target = f.target1d;  // ρ_s over the tokens before rejection, as verl's rollout_is="sequence"
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
  // clip_cov's / kl_cov's subset, from every labelled token's log-prob (docs/policy_losses.md): after the loss pass,
  // which gives them, and a fix-up of the selected rows (grpo_cov_fix_up) where the pass sees the whole batch and
  // leaves the logits intact; the fused lm_head, whose chunks' gradients are consumed chunk by chunk, revisits
  // them itself (RowRevisit: their logits recomputed, their gradients' change added); otherwise (inplace_backward,
  // statistics already computed) from a statistics pass before the loss pass. So too for a subset bound past an
  // eighth of the rows: the fix-up moves its rows about five times (gather, pass, gradient, write-back) and holds
  // two buffers of them, where the statistics pass reads every row once.
  const bool cov = cov_loss_type(opt.loss_type);
  const int64_t cov_bound = cov ? cov_subset_bound(a.policy, opt, f.n_rows) : 0;
  const bool cov_after = cov && src.rows_revisitable() && cov_bound * 8 <= f.n_rows;
  const bool cov_revisit = cov && !cov_after && !args.stats_in.defined() && src.revisits(cov_bound);
  const at::Tensor cov_mask = cov_after || cov_revisit ? kept_mask() : at::Tensor();  // no launch between count and pass
  if (cov && !cov_after && !cov_revisit) {
    statistics_first();
    at::Tensor lp = new_empty({f.n_rows}, opts);
    backend.log_probs(args.stats_in, f.target1d, lp);
    rows.cov_selected = cov_selection(a.policy, opt, lp, rows.old_log_probs.defined() ? rows.old_log_probs : lp,
                                      rows.advantages, kept_mask())
                            .selected;
  }
  // Token-level correction weights (and, with vespo, their metrics: vespo folds them into φ).
  if (!sequence_rollout && opt.rollout_mode != kRolloutNone) rows.rollout_log_probs = rollout;
  // A rejected token weighs 0.
  const bool rejecting = !rules.empty();
  if (rejecting && !reject_after && !a.aggregation) {
    const at::Tensor m = kept_mask().to(acc);
    rows.loss_weights = rows.loss_weights.defined() ? rows.loss_weights * m : m;
  }
  if (recount && !reject_after) counts = recount_labels(counts, f.target1d, kept, seq);
  if (a.aggregation) {
    std::tie(rows.loss_weights, rows.divisor) = aggregate(*a.aggregation, kept_mask(), rows.loss_weights, a.divisor,
                                                          seq, opts);
  }
  // The labelled count, a one-block launch, is the kernel right before the loss pass, here as without the
  // sequence steps: the cluster kernel is launched while the kernel before it still runs (dependent launch),
  // and a 64-block one (GrpoSequenceStep) there measured 25% slower (docs/design.md, 2026-11-24: the SMs
  // holding one of its blocks when the cluster kernel's CTAs are placed).
  // The metrics need the labelled count; a given divisor is written by the same launch (no fill kernel).
  at::Tensor n_labelled;
  if (a.aggregation) {
    n_labelled = labelled_count(kept, acc);
  } else if (a.divisor) {
    std::tie(n_labelled, rows.divisor) = labelled_count_and_constant(kept, acc, *a.divisor);
  } else {
    n_labelled = labelled_count(kept, acc);
    rows.divisor = n_labelled;
  }
  const PolicyArgs& policy = a.policy;
  RowRevisit revisit;
  if (cov_revisit) revisit = grpo_cov_revisit(rows, policy, cov_mask, backend);
  if (f.n_rows > 0) {
    src.run(
        args, src.wants_grad(),
        [&](RowPassArgs& a) {
          split_stats_pass_on_cuda(a);
          backend.rows(a, rows);
          if (cov_after) grpo_cov_fix_up(a, rows, policy, cov_mask, backend);
        },
        cov_revisit ? &revisit : nullptr);
  }
  at::Tensor sequence_kept;  // bypass_mode's sequence rules' verdict, after the pass
  if (reject_after) {
    sequence_kept = reject_rollout_tokens(sequence_rules(rules), f.target1d, rows.log_probs, rollout, seq);
    kept = token_rule ? sequence_kept.masked_fill(rows.out.select(1, kGrpoRolloutWeight).eq(0), -100) : sequence_kept;
    kept_mask_once = at::Tensor();
    n_labelled = labelled_count(kept, acc);
    if (recount) counts = recount_labels(counts, f.target1d, kept, seq);
  }
  if (rejecting) {
    const at::Tensor rejected = kept_mask().logical_not();
    rows.out.masked_fill_(rejected.unsqueeze(1), 0);
    rows.log_probs.masked_fill_(rejected, 0);
    // bypass_mode's rows the sequence rules rejected after the pass: factor 0 in the backward (the other rows'
    // factors stay as the pass left them, ones or fp16's 2^-k, so that the backward skips them: the unlabelled rows
    // and those the token rules rejected in the pass too, whose gradient is 0 already; the factors are given on
    // either path, so that the outputs do not depend on it).
    if (bypass_rules && src.wants_grad() && src.grad_scaled_by_rows()) {
      at::Tensor& factors = src.grad_row_factors();
      if (reject_after && has_sequence_rule(rules)) factors.masked_fill_(sequence_kept.lt(0) & f.target1d.ge(0), 0);
    }
  }

  // Metrics (docs/math.md) in one reduction over the per-token outputs: no extra pass over the vocabulary, and
  // one launch where a column sum and a division per metric took one each (2-3 us apiece on a GPU).
  const PolicyScalarOutputs scalars(opts, policy_metrics_on(opt, a.compute_entropy, a.compute_metrics,
                                                           a.ref_log_probs.has_value()));
  backend.metrics(rows, kept, counts, n_labelled, scalars);
  return policy_results(scalars, rows.log_probs.view(target.sizes()));
}

}  // namespace rl_losses
