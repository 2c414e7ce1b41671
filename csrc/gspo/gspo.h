// GSPO (docs/math.md): the sequence-level, geometric-mean importance ratio over packed documents.
// Pass 1 (the statistics row pass) reads the logits once; the per-token log-probs, the per-document sums
// (GspoSum) and each token's gradient coefficient are then O(N + S) steps on the device; pass 2 reads the logits
// again and writes the gradient. Between the two, the document sums may be replaced by their all-reduce over a
// sequence-data-parallel group (`document_sums`), which is how documents split across ranks get one ratio, one
// rollout ratio, one VESPO weight and one importance-weighted KL gradient.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/policy.h"
#include "common/row_pass.h"
#include "common/row_source.h"
#include "op_args.h"

namespace rl_losses {

// Columns of the per-document sums (the SDP all-reduce payload), u_t = m_t/N_t (label_counts) or m_t (divided by
// the document's count once summed), κ'_t = u_t (weighting "document") or m_t ("token"):
//   kGspoLogRatio         Σ u_t·(lp_t − o_t)           log R_s
//   kGspoAdvantage        Σ u_t·A_t                    Ā_s
//   kGspoCount            Σ m_t                        the labelled tokens
//   kGspoRolloutLogRatio  Σ m_t·(o_t − rollout_t)      log ρ_s (a sequence-level rollout correction), or
//                         Σ κ'_t·ω_t                   (a token-level one) the weight the gradient through R_s carries
//   kGspoVespoLogW        Σ m_t·clamp(lp_t − o_t, ±20) (+ Σ m_t·clamp(log ω_t, log 1e-8, 20))   VESPO's log w
//   kGspoKlShare          Σ κ'_t·KL_t                  the importance-weighted KL's gradient through R_s
// The first three are the sums of the original (S, 3) document_sums, still accepted where the others are unused.
enum GspoSum : int { kGspoLogRatio = 0, kGspoAdvantage, kGspoCount, kGspoRolloutLogRatio, kGspoVespoLogW,
                     kGspoKlShare, kGspoSums };
constexpr int kGspoBasicSums = 3;
// Columns of the per-document metrics, summed over the documents.
enum GspoDocField : int { kGspoLow = 0, kGspoHigh, kGspoKlOld, kGspoHasLabel, kGspoLabelledRatio, kGspoDocFields };
// After those sums: the labelled-document count (>= 1) and the divisor D.
enum GspoTotal : int { kGspoLabelledDocs = kGspoDocFields, kGspoDivisor, kGspoTotals };
// Columns of the per-token outputs summed for the metrics.
enum GspoTokenField : int { kGspoTokenLoss = 0, kGspoTokenLogProb, kGspoTokenEntropy, kGspoTokenLabelled,
                            kGspoTokenKl, kGspoTokenRolloutRatio, kGspoTokenRolloutWeight, kGspoTokenRolloutCorrected,
                            kGspoTokenVespoPhi, kGspoTokenClipLow, kGspoTokenClipHigh, kGspoTokenFields };
// Everything between the two row passes, as tensors of the accumulation dtype (int64 for ids): the inputs,
// then what each step writes. Optional ones are undefined when absent.
struct GspoState {
  PolicyOptions<double> opt;  // the loss type and the policy family's options (common/policy.h)
  int64_t num_documents;
  at::Tensor stats;          // (N, 5) row statistics; undefined: log_probs is an input (gspo_document_sums)
  at::Tensor target, document, advantages, old_log_probs;  // (N,); old_log_probs undefined: on-policy
  at::Tensor ref_log_probs, rollout_log_probs;  // (N,) or undefined
  bool sequence_rollout = false;  // ρ per document (kGspoRolloutLogRatio) rather than per token
  bool kl_share = false;          // the importance-weighted KL differentiated through R_s (kGspoKlShare)
  at::Tensor label_counts;   // (N,) or undefined: each document's labelled tokens on this rank
  at::Tensor given_sums;     // (S, kGspoSums) document_sums (the SDP all-reduce), or undefined
  std::optional<double> divisor;
  bool token_advantages = false, token_weighting = false;
  // GspoTokenTerms
  at::Tensor log_probs, entropy, safe_document, terms;  // (N,), (N,) or undefined, (N,), (N, kGspoSums)
  at::Tensor local_sums;                                // (S, kGspoSums): the terms summed per document
  // GspoDocumentStep, GspoDocumentTotals
  at::Tensor sums, fields, ratios, totals;  // (S, kGspoSums), (S, kGspoDocFields), (S,), (kGspoTotals,)
  // GspoTokenStep
  at::Tensor token_out, coef;  // (N, kGspoTokenFields), (N,)
  at::Tensor entropy_h;        // (N,) the entropy bonus's gradient coefficient h_t, or undefined
};
// Per token: m_t (labelled, not padding), its log-prob from the row statistics (and entropy) unless given,
// its document with padding sent to document 0 (its terms are zero), and its terms of the document sums
// (GspoSum), with u_t = m_t / N_t when label_counts gives N_t, else u_t = m_t (the document step divides by the
// count once the document is summed).
template <typename acc_t>
struct GspoTokenTerms {
  PolicyOptions<acc_t> opt;
  const acc_t* stats;  // (N, 5), or null: log_probs holds the log-probs already
  const int64_t* target;
  const int64_t* document;
  const acc_t* advantages;
  const acc_t* old_log_probs;  // or null: on-policy
  const acc_t* label_counts;   // or null
  const acc_t* rollout_log_probs;  // or null
  const acc_t* ref_log_probs;      // or null
  bool sequence_rollout, kl_share, token_weighting;
  int64_t num_documents;
  acc_t* log_probs;
  acc_t* entropy;  // or null
  int64_t* safe_document;
  acc_t* terms;  // (N, kGspoSums)
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const int64_t s = document[i];
#if defined(__CUDA_ARCH__)
    // The CPU checks the range up front; on the device an out-of-range id must not index past a buffer.
    CUDA_KERNEL_ASSERT(s < num_documents && "rl_losses: a document index is >= num_documents");
#endif
    const bool on = target[i] >= 0 && s >= 0;
    acc_t lp;
    if (stats != nullptr) {
      const RowStats<acc_t> st = load_stats(stats, i);
      lp = on ? st.log_prob(st.label) : acc_t(0);
      log_probs[i] = lp;
      if (entropy != nullptr) entropy[i] = on ? st.entropy() : acc_t(0);
    } else {
      lp = log_probs[i];
    }
    const acc_t u = !on ? acc_t(0) : label_counts == nullptr ? acc_t(1) : acc_t(1) / at_least_one(label_counts[i]);
    acc_t* t = terms + i * kGspoSums;
    // On-policy (old = sg(lp)) the log-ratio is 0 in value; geo_mean's is the mean of the clipped δ̃.
    const acc_t delta = on && old_log_probs != nullptr ? lp - old_log_probs[i] : acc_t(0);
    t[kGspoLogRatio] = u * (opt.loss_type == kGeoMean ? geo_mean_log_ratio(opt, delta, advantages[i]) : delta);
    t[kGspoAdvantage] = on ? u * advantages[i] : acc_t(0);
    t[kGspoCount] = on ? acc_t(1) : acc_t(0);
    const acc_t old = old_log_probs != nullptr ? old_log_probs[i] : lp;
    const acc_t log_rho = on && rollout_log_probs != nullptr ? old - rollout_log_probs[i] : acc_t(0);
    t[kGspoRolloutLogRatio] = sequence_rollout                           ? log_rho
                              : on && rollout_log_probs != nullptr ? (token_weighting ? acc_t(1) : u) *
                                                                         rollout_weight(opt, log_rho)
                                                                   : acc_t(0);
    acc_t log_w = acc_t(0);
    if (on && opt.loss_type == kVespo) {
      if (old_log_probs != nullptr) log_w = vespo_log_ratio_term(lp - old);  // on-policy: 0
      if (!sequence_rollout) log_w += vespo_rollout_term(opt, log_rho);
    }
    t[kGspoVespoLogW] = log_w;
    t[kGspoKlShare] = on && kl_share ? (token_weighting ? acc_t(1) : u) *
                                           kl_estimate(opt.kl_estimator, lp, ref_log_probs[i]).value
                                     : acc_t(0);
    safe_document[i] = s >= 0 ? s : 0;
  }
};

// Per document: the sums the loss uses (document_sums if given, else this rank's, divided by the document's
// count when the terms were not), R_s, and the metrics (docs/math.md).
template <typename acc_t>
struct GspoDocumentStep {
  PolicyOptions<acc_t> opt;
  const acc_t* local;  // (S, kGspoSums)
  const acc_t* given;  // (S, kGspoSums) or null
  bool divide;         // divide kGspoLogRatio and kGspoAdvantage by the count (no label_counts)
  bool divide_kl;      // kGspoKlShare too (weighting "document")
  bool divide_rollout;  // the token-level rollout share too (weighting "document", token-level correction)
  acc_t* sums;    // (S, kGspoSums)
  acc_t* fields;  // (S, kGspoDocFields)
  acc_t* ratios;  // (S,)
  C10_HOST_DEVICE void operator()(int64_t s) const {
    acc_t d[kGspoSums];
    for (int k = 0; k < kGspoSums; ++k) d[k] = (given != nullptr ? given : local)[s * kGspoSums + k];
    if (given == nullptr && divide) {
      const acc_t count = at_least_one(d[kGspoCount]);
      d[kGspoLogRatio] /= count;
      d[kGspoAdvantage] /= count;
      if (divide_kl) d[kGspoKlShare] /= count;
      if (divide_rollout) d[kGspoRolloutLogRatio] /= count;
    }
    for (int k = 0; k < kGspoSums; ++k) sums[s * kGspoSums + k] = d[k];
    const bool has = d[kGspoCount] > acc_t(0);
    const acc_t ratio = ::exp(d[kGspoLogRatio]);
    ratios[s] = ratio;
    acc_t* o = fields + s * kGspoDocFields;
    o[kGspoLow] = has && policy_clipped_low(opt, ratio, d[kGspoAdvantage]) ? acc_t(1) : acc_t(0);
    o[kGspoHigh] = has && policy_clipped_high(opt, ratio, d[kGspoAdvantage]) ? acc_t(1) : acc_t(0);
    o[kGspoKlOld] = has ? k3(-d[kGspoLogRatio]) : acc_t(0);
    o[kGspoHasLabel] = has ? acc_t(1) : acc_t(0);
    o[kGspoLabelledRatio] = has ? ratio : acc_t(0);
  }
};

// Over the documents (a runner's sum_then): the metric sums, the labelled-document count and D.
template <typename T>
struct GspoDocumentTotals {
  using acc_t = T;
  static constexpr int kTerms = kGspoDocFields;
  const acc_t* fields;
  bool has_divisor;
  acc_t divisor;
  acc_t* totals;  // (kGspoTotals,)
  C10_HOST_DEVICE void terms(int64_t s, acc_t* v) const {
    for (int k = 0; k < kTerms; ++k) v[k] = fields[s * kGspoDocFields + k];
  }
  C10_HOST_DEVICE void finish(const acc_t* sum) const {
    for (int k = 0; k < kTerms; ++k) totals[k] = sum[k];
    const acc_t n = at_least_one(sum[kGspoHasLabel]);
    totals[kGspoLabelledDocs] = n;
    totals[kGspoDivisor] = has_divisor ? divisor : n;
  }
};
// Per token: its share of the loss, κ_t·f(R_s, A)/D, and its gradient coefficient κ_t·(−∂f/∂lp)/D, with
// A = Ā_s (or A_t for GSPO-token), κ_t = u_t (weighting "document") or m_t ("token") and f the surrogate of the
// loss type at the sequence ratio R_s (common/policy_math.h: policy_surrogate, whose ppo_clip caps R_s at δ as
// TRL's min(R_s, δ): no gradient above δ; vespo: −φ_s·A·lp_t), times the rollout weight (not vespo's: it is in
// φ), plus the token's own KL (β·KL_t, or β·R_s·KL_t importance weighted, R_s uncapped) and entropy bonus
// (−c·H_t), each weighted by κ_t as well. Summing the shares of a document's tokens gives f_s
// (or N_s·f_s) because Σ u_t = 1 over the whole document. The importance-weighted KL reaches every token of the
// document through R_s: ∂/∂lp_t of Σ_j κ_j·β·R_s·KL_j/D adds β·R_s·u_t·Σ_j κ_j·KL_j/D (kGspoKlShare) to the
// token's own term (GSPO-token: only its own, through its own ratio). geo_mean: f = −A·R_s, which reaches lp_t only
// where its δ̃_t is unclipped. Also the per-token terms of the metrics: u_t·lp_t, the entropy, m_t, KL, ρ, ω, u_t·φ,
// geo_mean's clipped flags.
template <typename acc_t>
struct GspoTokenStep {
  PolicyOptions<acc_t> opt;
  const acc_t* sums;               // (S, kGspoSums)
  const acc_t* local;              // (S, kGspoSums): the counts N_t when label_counts is null
  const int64_t* target;           // (N,)
  const int64_t* document;         // (N,)
  const acc_t* label_counts;       // (N,) or null
  const acc_t* advantages;         // (N,)
  const acc_t* log_probs;          // (N,)
  const acc_t* entropy;            // (N,) or null
  const acc_t* old_log_probs;      // (N,) or null: on-policy
  const acc_t* ref_log_probs;      // (N,) or null
  const acc_t* rollout_log_probs;  // (N,) or null
  const acc_t* totals;             // (kGspoTotals,)
  bool token_advantages;
  bool token_weighting;
  bool sequence_rollout;
  bool kl_share;
  acc_t* out;        // (N, kGspoTokenFields)
  acc_t* coef;       // (N,)
  acc_t* entropy_h;  // (N,) or null
  C10_HOST_DEVICE void operator()(int64_t i) const {
    acc_t* o = out + i * kGspoTokenFields;
    const int64_t s = document[i];
    if (target[i] < 0 || s < 0) {
      for (int k = 0; k < kGspoTokenFields; ++k) o[k] = acc_t(0);
      coef[i] = acc_t(0);
      if (entropy_h != nullptr) entropy_h[i] = acc_t(0);
      return;
    }
    const acc_t* d = sums + s * kGspoSums;
    const acc_t n_t = label_counts != nullptr ? label_counts[i] : local[s * kGspoSums + kGspoCount];
    const acc_t count = at_least_one(n_t);
    const acc_t kappa = (token_weighting ? acc_t(1) : acc_t(1) / count) / totals[kGspoDivisor];
    const acc_t adv = token_advantages ? advantages[i] : d[kGspoAdvantage];
    const acc_t lp = log_probs[i];
    const acc_t ratio = ::exp(d[kGspoLogRatio]);
    const acc_t old = old_log_probs != nullptr ? old_log_probs[i] : lp;
    const acc_t log_rho = sequence_rollout               ? d[kGspoRolloutLogRatio]
                          : rollout_log_probs != nullptr ? old - rollout_log_probs[i]
                                                         : acc_t(0);
    const acc_t rw = rollout_weight(opt, log_rho);
    const bool geo_mean = opt.loss_type == kGeoMean;
    const bool inside = !geo_mean || geo_mean_inside(opt, lp - old, advantages[i]);  // R_s depends on lp_t
    PolicyToken<acc_t> t;
    acc_t phi = acc_t(0);
    if (opt.loss_type == kVespo) {
      // A sequence-level correction enters log w once, as the document's weight ω_s.
      phi = vespo_phi(opt, d[kGspoVespoLogW] + (sequence_rollout ? vespo_rollout_term(opt, log_rho) : acc_t(0)),
                      adv);
      t = vespo_surrogate(phi, ratio, adv, lp);
    } else {
      t = geo_mean ? geo_mean_surrogate(ratio, adv, inside) : policy_surrogate(opt, ratio, adv, lp);
      // The token's share of the loss is weighted by its own ω_t, but f(R_s) reaches lp_t through R_s from every
      // token of the document: with token-level weights its gradient carries the document's Σ κ'_u·ω_u / N_s
      // (GSPO-token: the token's own ratio, and CISPO: −sg(w)·A·lp_t, reach it directly, so its own ω_t).
      acc_t grad_weight = rw;
      if (!sequence_rollout && rollout_log_probs != nullptr && !token_advantages && opt.loss_type != kCispo) {
        grad_weight = token_weighting ? d[kGspoRolloutLogRatio] / count : d[kGspoRolloutLogRatio];
      }
      t.loss = zero_or_product(rw, t.loss);
      t.coef = zero_or_product(grad_weight, t.coef);
    }
    acc_t kl = acc_t(0);
    if (ref_log_probs != nullptr) {
      KlTerm<acc_t> k = kl_estimate(opt.kl_estimator, lp, ref_log_probs[i]);
      if (opt.kl_importance_weighted) {
        // R·KL. Through the token's own log-prob: GSPO-token's ratio sg(R_s)·exp(lp_t − sg(lp_t)) gives
        // R·(KL + ∂KL); the document's R_s gives R·∂KL here and the rest through kGspoKlShare below.
        k.slope = zero_or_product(ratio, token_advantages ? k.slope + k.value : k.slope);
        k.value = zero_or_product(ratio, k.value);
      }
      kl = k.value;
      if (opt.beta != acc_t(0)) {
        t.loss += opt.beta * k.value;
        t.coef -= opt.beta * k.slope;
      }
    }
    const acc_t h = entropy != nullptr ? entropy[i] : acc_t(0);
    o[kGspoTokenLoss] = zero_or_product(kappa, t.loss - opt.entropy_coefficient * h);
    o[kGspoTokenLogProb] = lp / count;
    o[kGspoTokenEntropy] = h;
    o[kGspoTokenLabelled] = acc_t(1);
    o[kGspoTokenKl] = kl;
    const bool corrected = opt.rollout_mode != kRolloutNone;
    o[kGspoTokenRolloutRatio] = corrected ? ::exp(log_rho) : acc_t(1);
    o[kGspoTokenRolloutWeight] = rw;
    o[kGspoTokenRolloutCorrected] = corrected && rw != o[kGspoTokenRolloutRatio] ? acc_t(1) : acc_t(0);
    o[kGspoTokenVespoPhi] = phi / count;
    const bool outside = geo_mean && geo_mean_outside(opt, lp - old);
    o[kGspoTokenClipLow] = outside && advantages[i] < acc_t(0) ? acc_t(1) : acc_t(0);
    o[kGspoTokenClipHigh] = outside && advantages[i] > acc_t(0) ? acc_t(1) : acc_t(0);
    coef[i] = zero_or_product(kappa, t.coef);
    if (kl_share && inside) {
      const acc_t share = d[kGspoKlShare] / (count * totals[kGspoDivisor]);
      coef[i] -= zero_or_product(opt.beta * share, ratio);
    }
    if (entropy_h != nullptr) entropy_h[i] = kappa * opt.entropy_coefficient;
  }
};

// Over the tokens (a runner's sum_then): the scalar outputs.
template <typename T>
struct GspoMetrics {
  using acc_t = T;
  static constexpr int kTerms = kGspoTokenFields;
  const acc_t* out;     // (N, kGspoTokenFields)
  const acc_t* totals;  // (kGspoTotals,)
  bool entropy;
  PolicyScalarPtrs<acc_t> dst;
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const {
    for (int k = 0; k < kTerms; ++k) v[k] = out[i * kGspoTokenFields + k];
  }
  C10_HOST_DEVICE void finish(const acc_t* s) const {
    const acc_t n = totals[kGspoLabelledDocs];
    const acc_t labelled = at_least_one(s[kGspoTokenLabelled]);
    dst.set(kPolicyLoss, s[kGspoTokenLoss]);
    dst.set(kPolicyNewLogProbs, s[kGspoTokenLogProb] / n);
    // Per document, or (geo_mean, as verl) per token: the other is 0.
    dst.set(kPolicyClipLow, totals[kGspoLow] / n + s[kGspoTokenClipLow] / labelled);
    dst.set(kPolicyClipHigh, totals[kGspoHigh] / n + s[kGspoTokenClipHigh] / labelled);
    dst.set(kPolicyKlOld, totals[kGspoKlOld] / n);
    dst.set(kPolicyEntropy, entropy ? s[kGspoTokenEntropy] / labelled : acc_t(0));
    dst.set(kPolicyRatioMean, totals[kGspoLabelledRatio] / n);
    dst.set(kPolicyKl, s[kGspoTokenKl] / labelled);
    dst.set(kPolicyRolloutRatio, s[kGspoTokenRolloutRatio] / labelled);
    dst.set(kPolicyRolloutWeight, s[kGspoTokenRolloutWeight] / labelled);
    dst.set(kPolicyRolloutCorrected, s[kGspoTokenRolloutCorrected] / labelled);
    dst.set(kPolicyVespoPhi, s[kGspoTokenVespoPhi] / n);
  }
};

// The back-end: the two row passes and the O(N + S) steps between and after them, on one device.
struct GspoBackend {
  void (*stats)(const RowPassArgs&, const at::Tensor& out);
  void (*grad)(const RowPassArgs&, const GspoState&);         // PolicyCoefEpilogue
  void (*token_terms)(const GspoState&);                      // GspoTokenTerms and their sums per document
  // token_terms, GspoDocumentStep, GspoDocumentTotals, GspoTokenStep [and GspoMetrics]: one chain of steps
  void (*steps)(const GspoState&, const PolicyScalarOutputs* metrics);
};

// gspo's and linear_gspo's arguments but the source's and the hooks (op_args.h).
#define RL_LOSSES_GSPO_ARGS(X) RL_LOSSES_POLICY_INPUTS(X) RL_LOSSES_GSPO_DOCUMENTS(X) RL_LOSSES_GSPO_KEYWORDS(X)
RL_LOSSES_ARG_GROUP(GspoOwnArgs, RL_LOSSES_GSPO_ARGS)
struct GspoArgs : GspoOwnArgs {
  ClipArgs clip;
  PolicyArgs policy;
  FusedPolicyArgs fused;
  SamplerArgs sampler;
  void read(schema::Args& args) {
    GspoOwnArgs::read(args);
    clip.read(args);
    policy.read(args);
    fused.read(args);
    sampler.read(args);
  }
};

// gspo_document_sums' arguments (op_args.h).
#define RL_LOSSES_DOCUMENT_SUMS_ARGS(X)                                                                        \
  RL_LOSSES_DOCUMENT_SUMS_INPUT(X) RL_LOSSES_GSPO_WEIGHTING(X) RL_LOSSES_GSPO_TOKEN_ADVANTAGES(X)              \
  RL_LOSSES_POLICY_TENSORS(X) RL_LOSSES_KL_WEIGHT(X)
RL_LOSSES_ARG_GROUP(DocumentSumsOwnArgs, RL_LOSSES_DOCUMENT_SUMS_ARGS)
struct DocumentSumsArgs : DocumentSumsOwnArgs {
  ClipArgs clip;  // geo_mean clips each token's log-ratio inside its document's sums
  PolicyArgs policy;
  void read(schema::Args& args) {
    DocumentSumsOwnArgs::read(args);
    clip.read(args);
    policy.read(args);
  }
};

// The policy family's options of GspoState (gspo, gspo_document_sums, the fused head's GSPO term): rollout log-probs
// (checked), whether ρ is per document, whether the weighted KL's gradient needs R_s's per-document sum.
void set_policy_inputs(const char* op, GspoState& g, const OptTensor& ref_log_probs, const OptTensor& rollout_log_probs,
                       const PolicyArgs& policy, const at::Tensor& target, at::ScalarType acc);
// geo_mean (verl's, one advantage per sequence): GSPO's sequence ratio, clip inside; other options refused.
void check_geo_mean(const char* op, const PolicyOptions<double>& o, bool token_advantages, const PolicyArgs& policy);
// The rollout rejection's pre-pass over g's documents (gspo.cpp): g.target less the tokens `judged` rejects.
void reject_rollout_documents(const char* op, GspoState& g, const std::vector<RejectionRule>& rules,
                              const at::Tensor& target1d, const at::Tensor& target, const OptTensor& rollout_log_probs,
                              at::ScalarType acc, int64_t num_documents, const at::Tensor& judged);

// The per-document sums of this rank's tokens (see registration.cpp: gspo_document_sums).
at::Tensor gspo_document_sums(const DocumentSumsArgs& a, const GspoBackend& backend);
// The CPU back-end (gspo_cpu.cpp), shared by fused_head's CPU GSPO term (its kernels compiled once).
const GspoBackend& gspo_backend_cpu();

// The results of the `gspo` schema; the gradient, when the source wants one, is the source's. `document_sums`:
// the sequence-data-parallel hook (logits op only).
PolicyResults gspo_forward(RowSource& src, const at::Tensor& target, const GspoArgs& a, const OptTensor& row_stats,
                           const OptTensor& document_sums, const GspoBackend& backend);

// The loss of the registered kernels (common/loss_kernels.h), given a back-end; and gspo_document_sums' kernel.
template <const GspoBackend& (*kBackend)()>
struct GspoLoss {
  static constexpr const char* kName = "gspo";
  static constexpr const char* kLinearName = "linear_gspo";
  static PolicyResults run(RowSource& src, const at::Tensor& target, schema::Args& args, bool logits_op) {
    const OptTensor row_stats = logits_op ? args.read<RowStatsArg>().row_stats : std::nullopt;
    const OptTensor sums = logits_op ? args.read<GspoSumsArg>().document_sums : std::nullopt;
    return gspo_forward(src, target, args.read<GspoArgs>(), row_stats, sums, kBackend());
  }
  static void document_sums(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    DocumentSumsResult{gspo_document_sums(args.read<DocumentSumsArgs>(), kBackend())}.write(args);
    args.push_results();
  }
};

// The back-end functions, written once over a device runner (CpuRunner / CudaRunner).
template <typename Runner>
struct GspoBackendImpl {
  template <typename T>
  static T* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; }
#define RL_LOSSES_DISPATCH_ACC(T, ...) AT_DISPATCH_FLOATING_TYPES(T.scalar_type(), "gspo", __VA_ARGS__)

  // GspoTokenTerms uses no statistics of an unlabelled token, so such rows are not read.
  static void stats(const RowPassArgs& args, const at::Tensor& out) {
    Runner::row_pass(args, "gspo", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return StoreStatsEpilogue<acc_t, true>{out.data_ptr<acc_t>()};
    });
  }
  static void grad(const RowPassArgs& args, const GspoState& g) {
    if (g.entropy_h.defined()) {
      Runner::row_pass(args, "gspo", [&](auto* tag) {
        using acc_t = std::remove_pointer_t<decltype(tag)>;
        return PolicyCoefEpilogue<acc_t, true>{g.coef.const_data_ptr<acc_t>(), ptr<acc_t>(g.entropy_h),
                                               ptr<acc_t>(g.entropy)};
      });
    } else {
      Runner::row_pass(args, "gspo", [&](auto* tag) {
        using acc_t = std::remove_pointer_t<decltype(tag)>;
        return PolicyCoefEpilogue<acc_t>{g.coef.const_data_ptr<acc_t>()};
      });
    }
  }
  // The steps between and after the passes (row_pass.h), each built once.
  template <typename T>
  static auto terms_steps(const GspoState& g) {
    return std::make_tuple(
        for_each_step(g.target.numel(),
                      GspoTokenTerms<T>{policy_options_as<T>(g.opt), ptr<T>(g.stats), ptr<int64_t>(g.target),
                                        ptr<int64_t>(g.document), ptr<T>(g.advantages), ptr<T>(g.old_log_probs),
                                        ptr<T>(g.label_counts), ptr<T>(g.rollout_log_probs), ptr<T>(g.ref_log_probs),
                                        g.sequence_rollout, g.kl_share, g.token_weighting, g.num_documents,
                                        ptr<T>(g.log_probs), ptr<T>(g.entropy), ptr<int64_t>(g.safe_document),
                                        ptr<T>(g.terms)}),
        SumByIndexStep<kGspoSums, T>{g.terms, g.safe_document, g.local_sums});
  }
  template <typename T>
  static auto document_steps(const GspoState& g) {
    const bool counted = !g.label_counts.defined();
    return std::make_tuple(
        for_each_step(g.num_documents,
                      GspoDocumentStep<T>{policy_options_as<T>(g.opt), ptr<T>(g.local_sums), ptr<T>(g.given_sums),
                                          counted, counted && !g.token_weighting,
                                          counted && !g.token_weighting && !g.sequence_rollout &&
                                              g.rollout_log_probs.defined(),
                                          ptr<T>(g.sums), ptr<T>(g.fields), ptr<T>(g.ratios)}),
        sum_then_step(g.num_documents,
                      GspoDocumentTotals<T>{ptr<T>(g.fields), g.divisor.has_value(),
                                            static_cast<T>(g.divisor.value_or(1.0)), ptr<T>(g.totals)}));
  }
  template <typename T>
  static auto token_step(const GspoState& g) {
    return for_each_step(g.target.numel(),
                         GspoTokenStep<T>{policy_options_as<T>(g.opt), ptr<T>(g.sums), ptr<T>(g.local_sums),
                                          ptr<int64_t>(g.target), ptr<int64_t>(g.document), ptr<T>(g.label_counts),
                                          ptr<T>(g.advantages), ptr<T>(g.log_probs), ptr<T>(g.entropy),
                                          ptr<T>(g.old_log_probs), ptr<T>(g.ref_log_probs), ptr<T>(g.rollout_log_probs),
                                          ptr<T>(g.totals), g.token_advantages, g.token_weighting, g.sequence_rollout,
                                          g.kl_share, ptr<T>(g.token_out), ptr<T>(g.coef), ptr<T>(g.entropy_h)});
  }
  template <typename T>
  static auto metrics_step(const GspoState& g, const PolicyScalarOutputs& dst) {
    return sum_then_step(g.target.numel(), GspoMetrics<T>{ptr<T>(g.token_out), ptr<T>(g.totals), g.entropy.defined(),
                                                          dst.ptrs<T>()});
  }
  static void token_terms(const GspoState& g) {
    RL_LOSSES_DISPATCH_ACC(g.terms, [&] { run_chain<Runner>(terms_steps<scalar_t>(g)); });
  }
  // One chain: the token terms, document and token steps, and the metrics (dst; nothing they read is the grad pass's).
  static void steps(const GspoState& g, const PolicyScalarOutputs* dst) {
    RL_LOSSES_DISPATCH_ACC(g.sums, [&] {
      using T = scalar_t;
      const auto head = std::tuple_cat(terms_steps<T>(g), document_steps<T>(g), std::make_tuple(token_step<T>(g)));
      if (dst == nullptr) return run_chain<Runner>(head);
      run_chain<Runner>(std::tuple_cat(head, std::make_tuple(metrics_step<T>(g, *dst))));
    });
  }
#undef RL_LOSSES_DISPATCH_ACC
  static constexpr GspoBackend backend() { return {&stats, &grad, &token_terms, &steps}; }
};

}  // namespace rl_losses
