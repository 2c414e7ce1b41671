#include "gspo/gspo.h"

#include <cmath>
#include <limits>

#include "common/checks.h"

namespace rl_losses {

namespace {

// GspoTokenTerms over every token, then their sums per document (this rank's): g.local_sums.
void sum_document_terms(GspoState& g, const GspoBackend& backend) {
  const auto opts = g.advantages.options();
  const int64_t n = g.target.numel();
  g.safe_document = at::empty({n}, g.document.options());
  g.terms = at::empty({n, kGspoSums}, opts);
  g.local_sums = at::empty({g.num_documents, kGspoSums}, opts);
  backend.token_terms(g);
}

// The policy family's options of GspoState: the rollout log-probs (checked), whether ρ is per document, and whether
// the importance-weighted KL's gradient through R_s needs its per-document sum.
void set_policy_inputs(const char* op, GspoState& g, const GspoPolicyInputs& policy, const at::Tensor& target,
                       at::ScalarType acc) {
  if (policy.rollout_log_probs) {
    g.rollout_log_probs = check_per_token(op, "rollout_log_probs", *policy.rollout_log_probs, target, acc);
  }
  if (policy.ref_log_probs) g.ref_log_probs = check_per_token(op, "ref_log_probs", *policy.ref_log_probs, target, acc);
  g.sequence_rollout = sequence_level_rollout(policy.args);
  g.kl_share = g.opt.kl_importance_weighted && g.opt.beta != 0 && g.ref_log_probs.defined() && !g.token_advantages;
}

}  // namespace

at::Tensor gspo_document_sums(const at::Tensor& log_probs, const at::Tensor& target, const at::Tensor& advantages,
                              const std::optional<at::Tensor>& old_log_probs, const at::Tensor& document_index,
                              const at::Tensor& label_counts, int64_t num_documents, const std::string& weighting,
                              bool token_advantages, const GspoPolicyInputs& policy, const GspoBackend& backend) {
  constexpr const char* op = "gspo_document_sums";
  check_num_documents(op, num_documents);
  TORCH_CHECK(weighting == "document" || weighting == "token", op,
              ": weighting must be 'document' or 'token', got '", weighting, "'");
  TORCH_CHECK(std::isfinite(policy.beta) && policy.beta >= 0, op, ": beta must be >= 0, got ", policy.beta);
  const auto acc = log_probs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  GspoState g;
  g.opt = make_policy_options(op, policy.args, 0.2, 0.2, std::nullopt, policy.beta,
                              policy.rollout_log_probs.has_value());
  g.token_advantages = token_advantages;
  g.token_weighting = weighting == "token";
  g.num_documents = num_documents;
  g.log_probs = check_per_token(op, "log_probs", log_probs, target, acc);
  g.target = check_per_token_int(op, "target", target, target);
  g.advantages = check_per_token(op, "advantages", advantages, target, acc);
  if (old_log_probs) g.old_log_probs = check_per_token(op, "old_log_probs", *old_log_probs, target, acc);
  g.document = check_per_token_int(op, "document_index", document_index, target);
  g.label_counts = check_label_counts(op, label_counts, target, acc);
  set_policy_inputs(op, g, policy, target, acc);
  sum_document_terms(g, backend);
  return g.local_sums;
}

std::vector<at::Tensor> gspo_forward(RowSource& src, const at::Tensor& target, const at::Tensor& advantages,
                                     const std::optional<at::Tensor>& old_log_probs, const at::Tensor& document_index,
                                     std::optional<int64_t> num_documents,
                                     const std::optional<at::Tensor>& label_counts, double epsilon_low,
                                     double epsilon_high, const std::string& weighting, bool token_advantages,
                                     std::optional<double> divisor, double logits_scale_factor, bool compute_entropy,
                                     const std::optional<at::Tensor>& row_stats,
                                     const std::optional<at::Tensor>& document_sums, const GspoPolicyInputs& policy,
                                     const GspoBackend& backend) {
  const char* op = src.op();
  const FlatLogits& f = src.flat();
  check_scale(op, logits_scale_factor);
  check_epsilons(op, epsilon_low, epsilon_high);
  check_delta(op, policy.delta, epsilon_high);
  check_divisor(op, divisor);
  check_row_stats(op, row_stats, f);
  TORCH_CHECK(weighting == "document" || weighting == "token", op,
              ": weighting must be 'document' or 'token', got '", weighting, "'");
  const double beta = policy.beta;
  check_beta(op, beta, policy.ref_log_probs.has_value());
  const auto opts = src.acc_options();
  const auto acc = opts.dtype().toScalarType();
  GspoState g;
  g.opt = make_policy_options(op, policy.args, epsilon_low, epsilon_high, policy.delta, beta,
                              policy.rollout_log_probs.has_value());
  g.target = f.target1d;
  g.document = check_per_token_int(op, "document_index", document_index, target);
  if (old_log_probs) g.old_log_probs = check_per_token(op, "old_log_probs", *old_log_probs, target, acc);
  if (label_counts) g.label_counts = check_label_counts(op, *label_counts, target, acc);
  g.divisor = divisor;
  g.token_advantages = token_advantages;
  g.token_weighting = weighting == "token";
  set_policy_inputs(op, g, policy, target, acc);

  // The number of documents: given, implied by document_sums, or max(document_index) + 1 (which
  // synchronises with the device: pass num_documents to avoid it).
  std::optional<int64_t> given = num_documents;
  if (!given && document_sums) given = document_sums->size(0);
  const int64_t n_docs = document_count(op, g.document, given);
  g.num_documents = n_docs;
  // Advantages per token, per sequence ((B,) for (B, T) labels) or per document ((num_documents,)).
  at::Tensor adv = broadcast_per_sequence(op, "advantages", advantages, target);
  if (adv.dim() == 1 && adv.sizes() != target.sizes() && adv.size(0) == n_docs && adv.device() == g.document.device()) {
    adv = adv.index_select(0, at::where(g.document >= 0, g.document, at::zeros_like(g.document))).view(target.sizes());
  }
  g.advantages = check_per_token(op, "advantages", adv, target, acc);
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
  RowPassArgs args = make_row_pass_args(f, logits_scale_factor);
  if (row_stats) {
    g.stats = *row_stats;
  } else {
    g.stats = src.row_outputs({f.n_rows, RowStats<double>::kFields});
    args.entropy = compute_entropy || g.opt.entropy_coefficient != 0;
    if (f.n_rows > 0) src.run(args, false, [&](RowPassArgs& a) { backend.stats(a, g.stats); });
    args.entropy = false;
  }

  // Between the passes, a fixed few launches of O(N + S) work (on a GPU each costs 2-3 us, which small
  // shapes feel): the per-token log-probs and document terms, their sums per document, each document's ratio
  // and metrics and their totals (with D), then each token's loss share and gradient coefficient.
  g.log_probs = at::empty({f.n_rows}, opts);
  if (compute_entropy || g.opt.entropy_coefficient != 0) g.entropy = at::empty({f.n_rows}, opts);
  sum_document_terms(g, backend);
  g.sums = at::empty({n_docs, kGspoSums}, opts);
  g.fields = at::empty({n_docs, kGspoDocFields}, opts);
  g.ratios = at::empty({n_docs}, opts);
  g.totals = at::empty({kGspoTotals}, opts);
  backend.documents(g);
  if (g.opt.entropy_coefficient != 0) g.entropy_h = at::empty({f.n_rows}, opts);
  g.token_out = at::empty({f.n_rows, kGspoTokenFields}, opts);
  g.coef = at::empty({f.n_rows}, opts);
  backend.tokens(g);

  // Pass 2: the gradient.
  if (src.wants_grad() && f.n_rows > 0) {
    args.stats_in = g.stats;
    src.run(args, true, [&](RowPassArgs& a) { backend.grad(a, g); });
  }

  // Metrics (docs/math.md), one reduction over the tokens.
  const PolicyScalarOutputs scalars(opts);
  backend.metrics(g, scalars);
  std::vector<at::Tensor> out = scalars.with_log_probs(g.log_probs.view(target.sizes()));
  out.push_back(g.ratios);
  out.push_back(scalars.t[kPolicyVespoPhi]);
  return out;
}

}  // namespace rl_losses
