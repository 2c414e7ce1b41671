// GRPO: the per-token importance ratio under the policy family's loss types (ppo_clip, cispo, sapo, vespo and
// verl's gpg, dro, dppo_tv, dppo_kl, clip_cov, kl_cov), rollout correction, KL penalty and entropy bonus
// (docs/policy_losses.md), fused with its metrics. The row-pass epilogue and the device-independent forward shared
// by the CPU and CUDA registrations.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/policy.h"
#include "common/row_pass.h"
#include "common/row_source.h"
#include "grpo/grpo_cov.h"

namespace rl_losses {

// Columns of the per-token output the epilogue writes (zeros on unlabelled tokens); the log-probs, an output
// of their own, go to a separate array.
enum GrpoField : int { kGrpoLoss = 0, kGrpoRatio, kGrpoLow, kGrpoHigh, kGrpoKlOld, kGrpoEntropy, kGrpoKl,
                       kGrpoRolloutRatio, kGrpoRolloutWeight, kGrpoRolloutCorrected, kGrpoFields };

// Per labelled token: the policy objective of its loss type, the rollout weight, the KL penalty and the entropy
// bonus (common/math.h: policy_token), times w_t/D.
// kEntropyBonus: compiled with the gradient's entropy term (one more FMA per logit), taken only when
// entropy_coefficient != 0, so that plain GRPO keeps the kernel it had.
template <typename acc_t, bool kEntropyBonus = false>
struct GrpoEpilogue {
  static constexpr bool kMayUseEntropy = true, kMayUseSmoothing = false, kMayUseEntropyGrad = kEntropyBonus;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  static constexpr bool kSkipsUnlabelled = true;  // a masked token's outputs and gradient are zeros
  static constexpr bool kMaySample = true;
  PolicyOptions<acc_t> opt;
  const acc_t* advantages;
  const acc_t* old_log_probs;      // null: on-policy, old = sg(lp)
  const acc_t* ref_log_probs;      // null without a reference
  const acc_t* rollout_log_probs;  // null without a token-level rollout correction
  const acc_t* sequence_log_rho;   // null without a sequence-level one: log ρ of each token's sequence
  const acc_t* vespo_phi;          // loss type vespo: φ_t of each token (GrpoSequenceStep), else null
  const bool* cov_selected;        // clip_cov / kl_cov: the token is in the subset (cov_selection), else null
  const acc_t* loss_weights;       // null: the label mask
  const acc_t* divisor;            // 0-dim D
  acc_t* out;                      // (N, kGrpoFields)
  acc_t* log_probs;                // (N,)
  bool entropy;                    // the statistics hold Σp·x (entropy metric or bonus)
  // bypass_mode's token rules, judged here on the current log-prob against these rollout log-probs (null: none).
  // A token they reject is left as an unlabelled one (outputs 0, no gradient) but for its log-prob, which the
  // sequence rules read after the pass; its rollout weight column 0 (1 on every kept token: bypass_mode takes no
  // rollout correction) tells the op which they were.
  const acc_t* judged_rollout_log_probs;
  TokenRejection<acc_t> rejection;

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    acc_t* o = out + row * kGrpoFields;
    // An unlabelled row, or one the token rules reject (its log-prob kept): zero outputs, no gradient.
    const auto outside = [&](acc_t log_prob) -> GradCoef<acc_t> {
      for (int k = 0; k < kGrpoFields; ++k) o[k] = acc_t(0);
      log_probs[row] = log_prob;
      return {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
    };
    if (label < 0) return outside(acc_t(0));
    const acc_t lp = st.log_prob(st.label);
    if (judged_rollout_log_probs != nullptr && !token_kept(rejection, lp, judged_rollout_log_probs[row])) {
      return outside(lp);
    }
    const acc_t adv = advantages[row];
    const acc_t old = old_log_probs != nullptr ? old_log_probs[row] : lp;
    const acc_t log_rho = sequence_log_rho != nullptr    ? sequence_log_rho[row]
                          : rollout_log_probs != nullptr ? old - rollout_log_probs[row]
                                                         : acc_t(0);
    const acc_t rw = rollout_weight(opt, log_rho);
    // VESPO folds the rollout weights into φ (TRL, Liger): its surrogate is not multiplied by them.
    const bool vespo = vespo_phi != nullptr;
    const acc_t ref = ref_log_probs != nullptr ? ref_log_probs[row] : acc_t(0);
    const PolicyTokenTerms<acc_t> t = policy_token(opt, lp, old, adv, ref_log_probs != nullptr, ref,
                                                   vespo ? acc_t(1) : rw, vespo ? vespo_phi[row] : acc_t(1),
                                                   cov_selected != nullptr && cov_selected[row]);
    const acc_t w = (loss_weights ? loss_weights[row] : acc_t(1)) / *divisor;
    const acc_t h = entropy ? st.entropy() : acc_t(0);
    const acc_t c = opt.entropy_coefficient;
    o[kGrpoLoss] = zero_or_product(w, t.t.loss - c * h);
    log_probs[row] = lp;
    o[kGrpoRatio] = t.t.ratio;
    o[kGrpoLow] = t.clipped_low ? acc_t(1) : acc_t(0);
    o[kGrpoHigh] = t.clipped_high ? acc_t(1) : acc_t(0);
    o[kGrpoKlOld] = k3(old - lp);
    o[kGrpoEntropy] = h;
    o[kGrpoKl] = t.kl;
    const bool corrected = opt.rollout_mode != kRolloutNone;
    o[kGrpoRolloutRatio] = corrected ? ::exp(log_rho) : acc_t(1);
    o[kGrpoRolloutWeight] = rw;
    o[kGrpoRolloutCorrected] = corrected && rw != o[kGrpoRolloutRatio] ? acc_t(1) : acc_t(0);
    // −c·H_t has ∂/∂x_j = c·p_j·(log p_j + H_t): the h term and c·H_t in a.
    const acc_t coef = zero_or_product(w, t.t.coef);
    return {coef + w * c * h, -coef, acc_t(0), w * c};
  }
};

// The scalar outputs from the per-token ones, in one reduction (a runner's sum_then): the loss sums the token
// shares, the other means divide by the labelled count; new_logprobs is the mean over documents of their
// mean log-prob (label_counts given) or the token mean.
template <typename T>
struct GrpoMetrics {
  using acc_t = T;
  enum : int { kLogProb = kGrpoFields, kDocLogProb, kDocWeight, kPhiShare, kSequenceShare, kTerms };
  const acc_t* out;         // (N, kGrpoFields)
  const acc_t* log_probs;   // (N,)
  const int64_t* target;    // (N,)
  const acc_t* counts;      // (N,) label_counts, or null
  const acc_t* n_labelled;  // 0-dim, >= 1
  const acc_t* vespo_phi;       // (N,) φ_t, or null (not vespo)
  const acc_t* sequence_share;  // (N,) m_t / n_s (vespo): a sequence's shares sum to 1
  PolicyScalarPtrs<acc_t> dst;
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const {
    for (int k = 0; k < kGrpoFields; ++k) v[k] = out[i * kGrpoFields + k];
    v[kLogProb] = log_probs[i];
    // Each token weighs 1 / (its document's labelled tokens), so a document's weights sum to 1.
    const acc_t w = counts != nullptr && target[i] >= 0 ? acc_t(1) / at_least_one(counts[i]) : acc_t(0);
    v[kDocLogProb] = w * log_probs[i];
    v[kDocWeight] = w;
    // vespo/phi_seq_mean (TRL's metric): the mean of φ over the labelled sequences.
    v[kPhiShare] = vespo_phi != nullptr ? vespo_phi[i] * sequence_share[i] : acc_t(0);
    v[kSequenceShare] = vespo_phi != nullptr ? sequence_share[i] : acc_t(0);
  }
  C10_HOST_DEVICE void finish(const acc_t* s) const {
    const acc_t n = *n_labelled;
    dst.set(kPolicyLoss, s[kGrpoLoss]);
    dst.set(kPolicyNewLogProbs, counts != nullptr
                                    ? s[kDocLogProb] / (s[kDocWeight] > acc_t(1e-30) ? s[kDocWeight] : acc_t(1e-30))
                                    : s[kLogProb] / n);
    dst.set(kPolicyClipLow, s[kGrpoLow] / n);
    dst.set(kPolicyClipHigh, s[kGrpoHigh] / n);
    dst.set(kPolicyKlOld, s[kGrpoKlOld] / n);
    dst.set(kPolicyEntropy, s[kGrpoEntropy] / n);
    dst.set(kPolicyRatioMean, s[kGrpoRatio] / n);
    dst.set(kPolicyKl, s[kGrpoKl] / n);
    dst.set(kPolicyRolloutRatio, s[kGrpoRolloutRatio] / n);
    dst.set(kPolicyRolloutWeight, s[kGrpoRolloutWeight] / n);
    dst.set(kPolicyRolloutCorrected, s[kGrpoRolloutCorrected] / n);
    dst.set(kPolicyVespoPhi, s[kPhiShare] / at_least_one(s[kSequenceShare]));
  }
};

// GRPO's sequence-level options (a sequence-level rollout correction, loss type vespo), O(N + S) on the device
// in a fixed three launches and a memset, before the loss pass: per token its terms of its sequence's sums
// (GrpoSequenceTerms), their sums per sequence, then per token what the loss pass reads (GrpoSequenceStep).
// Columns of the per-sequence sums:
//   kSeqRolloutLogRatio  Σ m_t·(o_t − rollout_t)   log ρ_s: the sequence's rollout ratio is the product of its
//                                                  token ratios (TRL's, verl's definition)
//   kSeqVespoLogW        Σ m_t·clamp(lp_t − o_t, ±20) (+ Σ m_t·clamp(log ω_t, log 1e-8, 20), token modes)
//   kSeqCount            Σ m_t
enum GrpoSequenceSum : int { kSeqRolloutLogRatio = 0, kSeqVespoLogW, kSeqCount, kSeqSums };

template <typename acc_t>
struct GrpoSequenceTerms {
  PolicyOptions<acc_t> opt;
  const int64_t* target;           // (N,)
  const int64_t* sequence;         // (N,) ids (negative: padding), or null: sequence = i / row_length
  int64_t row_length;
  int64_t num_sequences;
  const acc_t* stats;              // (N, 5), or null where no log-prob is needed
  const acc_t* old_log_probs;      // (N,) or null: on-policy, o = lp
  const acc_t* rollout_log_probs;  // (N,) or null
  bool sequence_rollout;
  int64_t* safe_sequence;          // (N,) padding sent to sequence 0 (its terms are zero)
  acc_t* terms;                    // (N, kSeqSums)
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const int64_t s = sequence != nullptr ? sequence[i] : i / row_length;
#if defined(__CUDA_ARCH__)
    CUDA_KERNEL_ASSERT(s < num_sequences && "rl_losses: a document index is >= the number of sequences");
#endif
    safe_sequence[i] = s >= 0 ? s : 0;
    acc_t* t = terms + i * kSeqSums;
    if (target[i] < 0 || s < 0) {
      for (int k = 0; k < kSeqSums; ++k) t[k] = acc_t(0);
      return;
    }
    acc_t lp = acc_t(0);
    if (stats != nullptr) {
      const RowStats<acc_t> st = load_stats(stats, i);
      lp = st.log_prob(st.label);
    }
    const acc_t old = old_log_probs != nullptr ? old_log_probs[i] : lp;
    const acc_t log_rho = rollout_log_probs != nullptr ? old - rollout_log_probs[i] : acc_t(0);
    t[kSeqRolloutLogRatio] = sequence_rollout ? log_rho : acc_t(0);
    acc_t log_w = acc_t(0);
    if (opt.loss_type == kVespo) {
      if (old_log_probs != nullptr) log_w = vespo_log_ratio_term(lp - old);  // on-policy: 0
      if (!sequence_rollout) log_w += vespo_rollout_term(opt, log_rho);
    }
    t[kSeqVespoLogW] = log_w;
    t[kSeqCount] = acc_t(1);
  }
};

template <typename acc_t>
struct GrpoSequenceStep {
  PolicyOptions<acc_t> opt;
  const int64_t* safe_sequence;  // (N,)
  const acc_t* terms;            // (N, kSeqSums): kSeqCount says whether the token counts
  const acc_t* sums;             // (S, kSeqSums)
  const acc_t* advantages;       // (N,)
  bool sequence_rollout;
  acc_t* sequence_log_rho;       // (N,) or null
  acc_t* phi;                    // (N,) or null (not vespo)
  acc_t* sequence_share;         // (N,) with phi
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const bool on = terms[i * kSeqSums + kSeqCount] > acc_t(0);
    const acc_t* d = sums + safe_sequence[i] * kSeqSums;
    if (sequence_log_rho != nullptr) sequence_log_rho[i] = on ? d[kSeqRolloutLogRatio] : acc_t(0);
    if (phi != nullptr) {
      // A sequence-level correction enters log w once, as its weight ω_s (Liger's (B, 1) vllm_is_ratio).
      const acc_t log_w =
          d[kSeqVespoLogW] + (sequence_rollout ? vespo_rollout_term(opt, d[kSeqRolloutLogRatio]) : acc_t(0));
      phi[i] = on ? vespo_phi(opt, log_w, advantages[i]) : acc_t(0);
      sequence_share[i] = on ? acc_t(1) / at_least_one(d[kSeqCount]) : acc_t(0);
    }
  }
};

// Each token's log-prob from the statistics (0 where unlabelled): what cov_selection reads where it comes before the
// loss pass (the fused lm_head, inplace_backward).
template <typename acc_t>
struct GrpoStatsLogProb {
  const acc_t* stats;     // (N, 5)
  const int64_t* target;  // (N,)
  acc_t* out;             // (N,)
  C10_HOST_DEVICE void operator()(int64_t i) const {
    const RowStats<acc_t> st = load_stats(stats, i);
    out[i] = target[i] >= 0 ? st.log_prob(st.label) : acc_t(0);
  }
};

// The tensors of the sequence-level steps (undefined where absent), and their outputs.
struct GrpoSequences {
  PolicyOptions<double> opt;
  at::Tensor target, ids;  // (N,) int64; ids undefined: the rows of length row_length
  int64_t row_length = 0, count = 0;
  at::Tensor stats, old_log_probs, rollout_log_probs, advantages;
  bool sequence_rollout = false;
  at::Tensor safe_sequence, terms, sums;  // (N,), (N, kSeqSums), (S, kSeqSums)
};

struct GrpoRows {
  PolicyOptions<double> opt;
  at::Tensor advantages, old_log_probs, ref_log_probs, rollout_log_probs, sequence_log_rho, loss_weights;  // (N,)
  at::Tensor vespo_phi, sequence_share;  // (N,), vespo only
  at::Tensor cov_selected;               // (N,) bool, clip_cov / kl_cov only
  at::Tensor divisor;
  at::Tensor out;        // (N, kGrpoFields)
  at::Tensor log_probs;  // (N,)
  bool entropy;
  at::Tensor judged_rollout_log_probs;  // (N,): bypass_mode's token rules judged in the pass (GrpoEpilogue)
  TokenRejection<double> rejection{};
};

// The per-row inputs a clip_cov / kl_cov sub-batch gathers (GrpoCovGather's order), of a GrpoRows or a const one.
template <class Rows>
auto grpo_row_inputs(Rows& r) {
  return std::array<decltype(&r.advantages), kGrpoCovInputs>{&r.advantages,       &r.old_log_probs,
                                                             &r.ref_log_probs,    &r.rollout_log_probs,
                                                             &r.sequence_log_rho, &r.loss_weights};
}

// grpo's clip_cov / kl_cov fix-up (grpo_cov.cpp): the first pass's rows and args, and the sub-batch's, whose row i
// is row index[i].
struct GrpoCovRows {
  at::Tensor index;     // (bound,) int64
  at::Tensor selected;  // (N,) bool
  const RowPassArgs& pass;
  const GrpoRows& rows;
  const RowPassArgs& sub_pass;
  const GrpoRows& sub;
};

template <typename acc_t, bool kEntropyBonus>
GrpoEpilogue<acc_t, kEntropyBonus> make_grpo_epilogue(const GrpoRows& r) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
  return {policy_options_as<acc_t>(r.opt), ptr(r.advantages), ptr(r.old_log_probs), ptr(r.ref_log_probs),
          ptr(r.rollout_log_probs), ptr(r.sequence_log_rho), ptr(r.vespo_phi),
          r.cov_selected.defined() ? r.cov_selected.const_data_ptr<bool>() : nullptr, ptr(r.loss_weights),
          r.divisor.const_data_ptr<acc_t>(),
          r.out.data_ptr<acc_t>(), r.log_probs.data_ptr<acc_t>(), r.entropy, ptr(r.judged_rollout_log_probs),
          token_rejection_as<acc_t>(r.rejection)};
}

// The back-end: the row pass and the metrics reduction, on one device.
struct GrpoBackend {
  void (*stats)(const RowPassArgs&, const at::Tensor& out);  // the statistics alone (see grpo_forward)
  void (*rows)(const RowPassArgs&, const GrpoRows&);
  void (*metrics)(const GrpoRows&, const at::Tensor& target1d, const at::Tensor& counts,
                  const at::Tensor& n_labelled, const PolicyScalarOutputs& dst);
  // GrpoSequenceTerms, the sums per sequence, GrpoSequenceStep (into the rows' sequence_log_rho / vespo_phi /
  // sequence_share, those defined).
  void (*sequences)(const GrpoSequences&, const GrpoRows&);
  void (*log_probs)(const at::Tensor& stats, const at::Tensor& target1d, const at::Tensor& out);  // GrpoStatsLogProb
  void (*cov_gather)(const GrpoCovRows&);      // GrpoCovGather
  void (*cov_write_back)(const GrpoCovRows&);  // GrpoCovWriteBack
};

template <typename Runner>
struct GrpoBackendImpl {
  static void stats(const RowPassArgs& args, const at::Tensor& out) {
    Runner::row_pass(args, "grpo", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return StoreStatsEpilogue<acc_t, true>{out.data_ptr<acc_t>()};
    });
  }
  static void rows(const RowPassArgs& args, const GrpoRows& r) {
    if (r.opt.entropy_coefficient != 0) {
      Runner::row_pass(args, "grpo", [&](auto* tag) {
        return make_grpo_epilogue<std::remove_pointer_t<decltype(tag)>, true>(r);
      });
    } else {
      Runner::row_pass(args, "grpo", [&](auto* tag) {
        return make_grpo_epilogue<std::remove_pointer_t<decltype(tag)>, false>(r);
      });
    }
  }
  static void metrics(const GrpoRows& r, const at::Tensor& target1d, const at::Tensor& counts,
                      const at::Tensor& n_labelled, const PolicyScalarOutputs& dst) {
    AT_DISPATCH_FLOATING_TYPES(r.out.scalar_type(), "grpo", [&] {
      const scalar_t* per_doc = counts.defined() ? counts.const_data_ptr<scalar_t>() : nullptr;
      auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<scalar_t>() : nullptr; };
      Runner::sum_then(r.out.size(0), GrpoMetrics<scalar_t>{r.out.const_data_ptr<scalar_t>(),
                                                            r.log_probs.const_data_ptr<scalar_t>(),
                                                            target1d.const_data_ptr<int64_t>(), per_doc,
                                                            n_labelled.const_data_ptr<scalar_t>(),
                                                            ptr(r.vespo_phi), ptr(r.sequence_share),
                                                            dst.ptrs<scalar_t>()});
    });
  }
  static void sequences(const GrpoSequences& q, const GrpoRows& r) {
    const int64_t n = q.target.numel();
    if (n == 0) return;
    AT_DISPATCH_FLOATING_TYPES(q.terms.scalar_type(), "grpo", [&] {
      using T = scalar_t;
      auto in = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; };
      auto out = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<T>() : nullptr; };
      const PolicyOptions<T> opt = policy_options_as<T>(q.opt);
      Runner::chain(
          for_each_step(n, GrpoSequenceTerms<T>{opt, q.target.const_data_ptr<int64_t>(),
                                                q.ids.defined() ? q.ids.const_data_ptr<int64_t>() : nullptr,
                                                q.row_length, q.count, in(q.stats), in(q.old_log_probs),
                                                in(q.rollout_log_probs), q.sequence_rollout,
                                                q.safe_sequence.data_ptr<int64_t>(), q.terms.data_ptr<T>()}),
          SumByIndexStep<kSeqSums, T>{q.terms, q.safe_sequence, q.sums},
          for_each_step(n, GrpoSequenceStep<T>{opt, q.safe_sequence.const_data_ptr<int64_t>(),
                                               q.terms.const_data_ptr<T>(), q.sums.const_data_ptr<T>(),
                                               in(q.advantages), q.sequence_rollout, out(r.sequence_log_rho),
                                               out(r.vespo_phi), out(r.sequence_share)}));
    });
  }
  static void log_probs(const at::Tensor& stats, const at::Tensor& target1d, const at::Tensor& out) {
    if (out.numel() == 0) return;
    AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "grpo", [&] {
      Runner::for_each(out.numel(), GrpoStatsLogProb<scalar_t>{stats.const_data_ptr<scalar_t>(),
                                                               target1d.const_data_ptr<int64_t>(),
                                                               out.data_ptr<scalar_t>()});
    });
  }
  static void cov_gather(const GrpoCovRows& c) {
    const RowPassArgs &a = c.pass, &s = c.sub_pass;
    const int64_t vocab = a.logits.size(1), width = std::max<int64_t>(vocab, 1);
    RL_LOSSES_DISPATCH_LOGITS(a.logits.scalar_type(), "grpo", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      GrpoCovGather<scalar_t, acc_t> f{width, vocab, c.index.const_data_ptr<int64_t>(),
                                       a.logits.const_data_ptr<scalar_t>(), a.logits.stride(0),
                                       s.logits.data_ptr<scalar_t>(), a.target.const_data_ptr<int64_t>(),
                                       s.target.data_ptr<int64_t>(), c.selected.const_data_ptr<bool>(),
                                       c.sub.cov_selected.data_ptr<bool>(), {}, {}};
      const auto in = grpo_row_inputs(c.rows);
      const auto out = grpo_row_inputs(c.sub);
      for (int k = 0; k < kGrpoCovInputs; ++k) {
        f.in[k] = in[k]->defined() ? in[k]->template const_data_ptr<acc_t>() : nullptr;
        f.sub_in[k] = out[k]->defined() ? out[k]->template data_ptr<acc_t>() : nullptr;
      }
      Runner::for_each(c.index.numel() * width, f);
    });
  }
  static void cov_write_back(const GrpoCovRows& c) {
    const RowPassArgs &a = c.pass, &s = c.sub_pass;
    const bool grad = a.write_grad() && a.grad.size(1) > 0, unscale = a.grad_row_unscale.defined();
    const int64_t width = grad ? a.grad.size(1) : 1;
    RL_LOSSES_DISPATCH_LOGITS(a.logits.scalar_type(), "grpo", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      Runner::for_each(c.index.numel() * width,
                       GrpoCovWriteBack<scalar_t, acc_t>{
                           width, kGrpoFields, c.index.const_data_ptr<int64_t>(),
                           c.sub.cov_selected.const_data_ptr<bool>(),
                           grad ? s.grad.const_data_ptr<scalar_t>() : nullptr,
                           grad ? a.grad.data_ptr<scalar_t>() : nullptr, grad ? a.grad.stride(0) : 0,
                           c.sub.out.const_data_ptr<acc_t>(), c.rows.out.data_ptr<acc_t>(),
                           c.sub.log_probs.const_data_ptr<acc_t>(), c.rows.log_probs.data_ptr<acc_t>(),
                           unscale ? s.grad_row_unscale.const_data_ptr<float>() : nullptr,
                           unscale ? a.grad_row_unscale.data_ptr<float>() : nullptr});
    });
  }
  static constexpr GrpoBackend backend() {
    return {&stats, &rows, &metrics, &sequences, &log_probs, &cov_gather, &cov_write_back};
  }
};

// clip_cov's / kl_cov's subset and its rows, after a loss pass `a` over the whole batch (RowSource::rows_revisitable)
// run with no token selected: cov_selection over the pass's log-probs (masked by `mask`), then the same pass again
// over the rows that may hold a selected token, whose outputs, log-probs and gradient rows replace the first
// pass's where selected (grpo_cov.cpp).
void grpo_cov_fix_up(const RowPassArgs& a, GrpoRows& rows, const PolicyArgs& policy, const at::Tensor& mask,
                     const GrpoBackend& backend);

// The same for a source that revisits rows itself (the fused lm_head: RowRevisit): the subset selected once every
// row's log-prob exists (rows.cov_selected set, for the passes after it), its rows' pass with or without it. Holds
// references to `rows`, `policy` and `mask` for the source's run.
RowRevisit grpo_cov_revisit(GrpoRows& rows, const PolicyArgs& policy, const at::Tensor& mask,
                            const GrpoBackend& backend);

// grpo's and linear_grpo's arguments but the source's (op_args.h).
#define RL_LOSSES_GRPO_ARGS(X) RL_LOSSES_POLICY_INPUTS(X) RL_LOSSES_GRPO_KEYWORDS(X)
RL_LOSSES_ARG_GROUP(GrpoOwnArgs, RL_LOSSES_GRPO_ARGS)
struct GrpoArgs : GrpoOwnArgs {
  ClipArgs clip;
  PolicyArgs policy;
  FusedPolicyArgs fused;
  SamplerArgs sampler;
  void read(schema::Args& args) {
    GrpoOwnArgs::read(args);
    clip.read(args);
    policy.read(args);
    fused.read(args);
    sampler.read(args);
  }
};

// The results of the `grpo` schema; the gradient, when the source wants one, is the source's.
PolicyResults grpo_forward(RowSource& src, const at::Tensor& target, const GrpoArgs& a, const OptTensor& row_stats,
                           const GrpoBackend& backend);

// The loss of the registered kernels (common/loss_kernels.h), given a back-end.
template <const GrpoBackend& (*kBackend)()>
struct GrpoLoss {
  static constexpr const char* kName = "grpo";
  static constexpr const char* kLinearName = "linear_grpo";
  static PolicyResults run(RowSource& src, const at::Tensor& target, schema::Args& args, bool logits_op) {
    const OptTensor row_stats = logits_op ? args.read<RowStatsArg>().row_stats : std::nullopt;
    return grpo_forward(src, target, args.read<GrpoArgs>(), row_stats, kBackend());
  }
};

}  // namespace rl_losses
