#include "gspo/gspo.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/TensorOperators.h>

#include <cmath>
#include <limits>

#include "common/checks.h"
#include "common/sampler.h"

namespace rl_losses {

void set_policy_inputs(const char* op, GspoState& g, const OptTensor& ref_log_probs, const OptTensor& rollout_log_probs,
                       const PolicyArgs& policy, const at::Tensor& target, at::ScalarType acc) {
  // (rollout_rs alone reads them in the pre-pass, not as a correction)
  if (rollout_log_probs && g.opt.rollout_mode != kRolloutNone) {
    g.rollout_log_probs = check_per_token(op, "rollout_log_probs", *rollout_log_probs, target, acc);
  }
  if (ref_log_probs) g.ref_log_probs = check_per_token(op, "ref_log_probs", *ref_log_probs, target, acc);
  g.sequence_rollout = sequence_level_rollout(policy);
  g.kl_share = g.opt.kl_importance_weighted && g.opt.beta != 0 && g.ref_log_probs.defined() && !g.token_advantages;
}

void check_geo_mean(const char* op, const PolicyOptions<double>& o, bool token_advantages, const PolicyArgs& policy) {
  if (o.loss_type != kGeoMean) return;
  TORCH_CHECK(!token_advantages, op, ": loss_type 'geo_mean' takes its document's mean advantage, got "
              "token_advantages = True");
  TORCH_CHECK(!policy.rollout_correction, op, ": loss_type 'geo_mean' takes no rollout_correction, got '",
              policy.rollout_correction.value_or(""), "'");
}

at::Tensor gspo_document_sums(const DocumentSumsArgs& a, const GspoBackend& backend) {
  constexpr const char* op = "gspo_document_sums";
  const at::Tensor& target = a.target;
  check_num_documents(op, a.num_documents);
  check_weighting(op, a.weighting);
  check_clip(op, a.clip, a.beta, a.ref_log_probs.has_value());
  const auto acc = acc_dtype(a.log_probs.scalar_type());
  GspoState g;
  g.opt = make_policy_options(op, a.policy, nullptr, &a.clip, a.beta, a.rollout_log_probs.has_value());
  check_sequence_ratio_loss_type(op, g.opt, a.policy);
  check_geo_mean(op, g.opt, a.token_advantages, a.policy);
  g.token_advantages = a.token_advantages;
  g.token_weighting = a.weighting == "token";
  g.num_documents = a.num_documents;
  g.log_probs = check_per_token(op, "log_probs", a.log_probs, target, acc);
  g.target = check_per_token_int(op, "target", target, target);
  g.advantages = check_per_token(op, "advantages", a.advantages, target, acc);
  if (a.old_log_probs) g.old_log_probs = check_per_token(op, "old_log_probs", *a.old_log_probs, target, acc);
  g.document = check_per_token_int(op, "document_index", a.document_index, target);
  g.label_counts = check_label_counts(op, a.label_counts, target, acc);
  set_policy_inputs(op, g, a.ref_log_probs, a.rollout_log_probs, a.policy, target, acc);
  g.terms = new_empty({target.numel(), kGspoSums}, g.advantages.options());
  g.local_sums = new_empty({g.num_documents, kGspoSums}, g.advantages.options());
  g.safe_document = new_empty({target.numel()}, g.document.options());
  backend.token_terms(g);
  return g.local_sums;
}

// The rollout rejection's pre-pass over the documents (O(N + S), no read of the logits): the tokens it rejects are
// unlabelled from here on, in the document sums, counts, coefficients and metrics; a document it empties no longer
// counts.
void reject_rollout_documents(const char* op, GspoState& g, const std::vector<RejectionRule>& rules,
                              const at::Tensor& target1d, const at::Tensor& target, const OptTensor& rollout_log_probs,
                              at::ScalarType acc, int64_t num_documents, const at::Tensor& judged) {
  if (rules.empty()) return;
  const at::Tensor rollout = g.rollout_log_probs.defined()  // checked already where a correction reads them too
                                 ? g.rollout_log_probs
                                 : check_per_token(op, "rollout_log_probs", *rollout_log_probs, target, acc);
  const SequenceIds documents{g.document, 0, num_documents};
  g.target = reject_rollout_tokens(rules, target1d, judged, rollout, documents);
  if (g.label_counts.defined()) g.label_counts = recount_labels(g.label_counts, target1d, g.target, documents);
}

PolicyResults gspo_forward(RowSource& src, const at::Tensor& target, const GspoArgs& a, const OptTensor& row_stats,
                           const OptTensor& document_sums, const GspoBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, a.logits_scale_factor);
  check_clip(op, a.clip, a.beta, a.ref_log_probs.has_value());
  check_divisor(op, a.divisor);
  check_row_stats(op, row_stats, f);
  check_weighting(op, a.weighting);
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  GspoState g;
  g.opt = make_policy_options(op, a.policy, &a.fused, &a.clip, a.beta, a.rollout_log_probs.has_value());
  check_sequence_ratio_loss_type(op, g.opt, a.policy);
  check_geo_mean(op, g.opt, a.token_advantages, a.policy);
  const bool bypass = a.fused.bypass_mode;
  const std::vector<RejectionRule> rules =
      rollout_rejection_rules(op, a.fused.rollout_rs, a.fused.rollout_rs_threshold, a.old_log_probs.has_value(),
                              a.rollout_log_probs.has_value(), bypass);
  TORCH_CHECK(rules.empty() || !document_sums, op, ": rollout_rs with document_sums (sequences split over ranks) is "
              "not fused: each rank's sums would need the whole sequence's rejection");
  g.target = f.target1d;
  g.document = check_per_token_int(op, "document_index", a.document_index, target);
  if (a.old_log_probs) g.old_log_probs = check_per_token(op, "old_log_probs", *a.old_log_probs, target, acc);
  if (bypass && !g.old_log_probs.defined()) {  // verl's old_log_prob := rollout's (make_policy_options: given)
    g.old_log_probs = check_per_token(op, "rollout_log_probs", *a.rollout_log_probs, target, acc);
  }
  if (a.label_counts) g.label_counts = check_label_counts(op, *a.label_counts, target, acc);
  g.divisor = a.divisor;
  g.token_advantages = a.token_advantages;
  g.token_weighting = a.weighting == "token";
  set_policy_inputs(op, g, a.ref_log_probs, a.rollout_log_probs, a.policy, target, acc);

  // The number of documents: given, implied by document_sums, or max(document_index) + 1 (which
  // synchronises with the device: pass num_documents to avoid it).
  std::optional<int64_t> given = a.num_documents;
  if (!given && document_sums) given = document_sums->size(0);
  const int64_t n_docs = document_count(op, g.document, given);
  g.num_documents = n_docs;
  // Advantages per token, per sequence ((B,) for (B, T) labels) or per document ((num_documents,)).
  at::Tensor adv = broadcast_per_sequence(a.advantages, target);
  if (adv.dim() == 1 && adv.sizes() != target.sizes() && adv.size(0) == n_docs && adv.device() == g.document.device()) {
    adv = adv.index_select(0, at::where(g.document >= 0, g.document, at::zeros_like(g.document))).view(target.sizes());
  }
  g.advantages = check_per_token(op, "advantages", adv, target, acc);
  // bypass_mode's rules judge the current log-probs: after the statistics pass (below), free of another read.
  if (!bypass) reject_rollout_documents(op, g, rules, f.target1d, target, a.rollout_log_probs, acc, n_docs,
                                        g.old_log_probs);
  if (document_sums) {
    // (S, 3), the sums without the policy family's columns, is accepted where those are unused.
    const bool basic = !g.rollout_log_probs.defined() && g.opt.loss_type != kVespo && !g.kl_share;
    const int64_t cols = document_sums->dim() == 2 ? document_sums->size(1) : -1;
    TORCH_CHECK(document_sums->dim() == 2 && document_sums->size(0) == n_docs &&
                    (cols == kGspoSums || (basic && cols == kGspoBasicSums)) &&
                    document_sums->scalar_type() == acc && document_sums->device() == opts.device(),
                op, ": document_sums must be (", n_docs, ", ", int(kGspoSums), ") ", acc, " on ", opts.device(),
                basic ? " (or with its first 3 columns only)" : "", ", got ", document_sums->sizes(), " ",
                document_sums->scalar_type(), " on ", document_sums->device());
    g.given_sums = cols == kGspoSums ? document_sums->contiguous()
                                     : at::cat({*document_sums, at::zeros({n_docs, kGspoSums - cols}, opts)}, 1);
  }

  // Pass 1: row statistics (unless given, e.g. all-reduced over the tensor-parallel group).
  RowPassArgs args = make_row_pass_args(f, a.logits_scale_factor);
  set_sampler_params(args, op, a.sampler, target, f.n_rows, opts, row_stats.has_value());
  if (row_stats) {
    g.stats = *row_stats;
  } else {
    g.stats = src.row_outputs({f.n_rows, RowStats<double>::kFields});
    args.entropy = a.compute_entropy || g.opt.entropy_coefficient != 0;
    if (f.n_rows > 0) src.run(args, false, [&](RowPassArgs& a) { backend.stats(a, g.stats); });
    args.entropy = false;
  }

  // Between the passes, a chain of O(N + S) steps (one launch on a GPU at small shapes, where each launch costs the
  // host ~5 us): the per-token log-probs and document terms, their sums per document, each document's ratio and
  // metrics and their totals (with D), each token's loss share and gradient coefficient, then the metrics.
  // The steps' buffers that no result returns, in one allocation.
  const std::vector<at::Tensor> scratch =
      new_scratch(opts, {{f.n_rows, kGspoSums}, {n_docs, kGspoSums}, {n_docs, kGspoSums}, {n_docs, kGspoDocFields},
                         {kGspoTotals}, {f.n_rows, kGspoTokenFields}, {f.n_rows}});
  g.terms = scratch[0];
  g.local_sums = scratch[1];
  g.sums = scratch[2];
  g.fields = scratch[3];
  g.totals = scratch[4];
  g.token_out = scratch[5];
  g.coef = scratch[6];
  g.log_probs = new_empty({f.n_rows}, opts);
  if (a.compute_entropy || g.opt.entropy_coefficient != 0) g.entropy = new_empty({f.n_rows}, opts);
  g.safe_document = new_empty({f.n_rows}, g.document.options());
  g.ratios = new_empty({n_docs}, opts);
  if (g.opt.entropy_coefficient != 0) g.entropy_h = new_empty({f.n_rows}, opts);
  // The metrics (docs/math.md), one reduction over the tokens in the steps' chain.
  const PolicyScalarOutputs scalars(opts, policy_metrics_on(g.opt, a.compute_entropy, a.compute_metrics,
                                                             a.ref_log_probs.has_value()));
  if (bypass && !rules.empty()) {
    // The terms' log-probs judged; the steps then sum the terms again over the kept tokens (O(N + S)).
    backend.token_terms(g);
    reject_rollout_documents(op, g, rules, f.target1d, target, a.rollout_log_probs, acc, n_docs, g.log_probs);
  }
  backend.steps(g, &scalars);

  // Pass 2: the gradient.
  if (src.wants_grad() && f.n_rows > 0) {
    args.stats_in = g.stats;
    src.run(args, true, [&](RowPassArgs& a) { backend.grad(a, g); });
  }
  PolicyResults results = policy_results(scalars, g.log_probs.view(target.sizes()));
  results.document_ratios = g.ratios;
  return results;
}

}  // namespace rl_losses
