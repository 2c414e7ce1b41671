// Several losses in one pass over the logits (Fast-LLM's monolithic head; docs/distillation_dpo.md): label
// cross-entropy (with smoothing), z-loss and GRPO or GSPO, each with its weight and divisor. Every term's
// gradient is (a, b, c) of the row pass (row_pass.h), so the terms add up in one epilogue: the statistics are
// computed once, the logits read once (where the CE/GRPO row kernel fuses) and one summed gradient written once.
// Each term's value is an output of its own. The policy terms take the policy family's per-token options (op_args.h:
// RL_LOSSES_POLICY_OPTIONS, and the token-level rollout correction with rollout_log_probs; GSPO's term the
// sequence-level one too) and verl's rollout rejection (rollout_rs: the rejected tokens weigh 0 in the term, as
// unlabelled in grpo_loss / gspo_loss), each term equal to its op with the same options.
//
// GSPO needs every document's sequence ratio before any gradient, so with a GSPO term the head costs what GSPO
// alone costs: GSPO's statistics pass (or the given, all-reduced statistics), GSPO's own per-document steps
// (gspo/gspo.h: GspoTokenTerms, GspoDocumentStep, GspoTokenStep), then one head pass over the rows with those
// statistics given, whose epilogue adds GSPO's per-token coefficient to the other terms' (a, b, c).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <optional>
#include <string>
#include <tuple>

#include "common/policy.h"
#include "common/row_pass.h"
#include "common/row_source.h"
#include "gspo/gspo.h"
#include "op_args.h"

namespace rl_losses {

enum FusedHeadTerm : int { kHeadLabel = 0, kHeadZLoss, kHeadGrpo, kHeadGspo, kHeadDistill, kHeadTerms };
// FusedHeadEpilogue::part's parts: the terms but distillation in two dependent chains.
enum FusedHeadPart : int { kHeadLabelPart = 0, kHeadPolicyPart, kHeadParts };

// A row that no term uses (no label and no z-loss) is skipped unread, as GRPO alone skips it. The z-loss also
// covers unlabelled tokens (its own mask): the row pass gets a stand-in label 0 on those rows, so that they
// are read, and the epilogue reads the true labels from `labels` (the stand-in's one-hot term has weight 0).
// So the head reads exactly the rows its terms need, which is the rows GRPO alone reads when the z-loss mask
// is the label mask.
template <typename acc_t>
struct FusedHeadEpilogue {
  static constexpr bool kMayUseEntropy = false, kMayUseSmoothing = true;
  static constexpr bool kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  static constexpr bool kSkipsUnlabelled = true;
  CrossEntropyOptions<acc_t> ce;  // λ = 1, ε, ζ = 0, V
  PolicyOptions<acc_t> grpo;  // the GRPO term's (make_policy_options)
  acc_t weight[kHeadTerms];
  // Each term's D (divisor_of): 0-dim on the device where it counts tokens, else null and the value the host knew
  // (given, or the z-loss's N); neither for GSPO (its shares are divided already), distillation, or a term whose
  // weight is 0.
  const acc_t* divisor[kHeadTerms];
  acc_t divisor_value[kHeadTerms];
  const int64_t* labels;             // (N,) the true labels (the row pass's may be a stand-in, see above)
  const acc_t* z_mask;               // (N,) 0/1: the z-loss's tokens; null: every token
  const acc_t* advantages;           // null unless the GRPO term is on
  const acc_t* old_log_probs;
  const acc_t* ref_log_probs;  // null unless beta > 0
  const acc_t* rollout_log_probs;  // null without a (token-level) rollout correction
  const acc_t* loss_weights;   // null: the label mask
  const acc_t* gspo_out;       // (N, kGspoTokenFields) GspoTokenStep's outputs; null unless the GSPO term is on
  const acc_t* gspo_coef;      // (N,) its gradient coefficients
  acc_t* out;                  // (N, kHeadTerms): each term's share, unweighted (distillation's: its step's)
  acc_t* log_probs;            // (N,)

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t /*row pass's label*/,
                                             const RowStats<acc_t>& st) const {
    return terms(row, st, out + row * kHeadTerms, log_probs + row);
  }

  // The row's terms into o[kHeadTerms] and *lp (the distillation cluster kernel's CTAs but one: local ones): the
  // label part's, then the policy part's coefficients added (the same bits as adding the policy term's to the label
  // part's sum in place: GRPO and GSPO are exclusive, so the policy part holds one term).
  C10_HOST_DEVICE GradCoef<acc_t> terms(int64_t row, const RowStats<acc_t>& st, acc_t* o, acc_t* lp) const {
    o[kHeadDistill] = acc_t(0);
    const GradCoef<acc_t> g = part<kHeadLabelPart>(row, st, o, lp);
    const GradCoef<acc_t> p = part<kHeadPolicyPart>(row, st, o, lp);
    return {g.a + p.a, g.b + p.b, g.c + p.c};
  }

  // The terms in two parts, each a dependent chain of its own from the row's statistics: the label CE and the z-loss
  // (kHeadLabelPart: o[kHeadLabel], o[kHeadZLoss] and *lp), the policy term (kHeadPolicyPart: o[kHeadGrpo],
  // o[kHeadGspo]). The distillation cluster kernel runs each in a warp of its own, so that the row, which every
  // warp of the cluster waits for, takes the longest chain rather than their sum.
  template <int kPart>
  C10_HOST_DEVICE GradCoef<acc_t> part(int64_t row, const RowStats<acc_t>& st, acc_t* o, acc_t* lp) const {
    GradCoef<acc_t> g{acc_t(0), acc_t(0), acc_t(0)};
    const int64_t label = labels[row];
    if constexpr (kPart == kHeadLabelPart) {
      o[kHeadLabel] = o[kHeadZLoss] = *lp = acc_t(0);
      const bool z_on = weight[kHeadZLoss] != acc_t(0) && (z_mask == nullptr || z_mask[row] != acc_t(0));
      if (label < 0 && !z_on) return g;
      const acc_t lse = st.lse();
      if (z_on) {
        const acc_t inv_d = acc_t(1) / divisor_of(divisor[kHeadZLoss], divisor_value[kHeadZLoss]);
        o[kHeadZLoss] = lse * lse * inv_d;
        g.a += acc_t(2) * lse * weight[kHeadZLoss] * inv_d;
      }
      if (label < 0) return g;
      const acc_t label_lp = st.log_prob(st.label);
      *lp = label_lp;
      if (weight[kHeadLabel] != acc_t(0)) {
        const acc_t inv_d = acc_t(1) / divisor_of(divisor[kHeadLabel], divisor_value[kHeadLabel]);
        o[kHeadLabel] = cross_entropy_loss(ce, lse, label_lp, st.sum_x) * inv_d;
        const GradCoef<acc_t> t = cross_entropy_grad(ce, lse, weight[kHeadLabel] * inv_d);
        g = {g.a + t.a, g.b + t.b, g.c + t.c};
      }
      return g;
    } else {
      o[kHeadGrpo] = o[kHeadGspo] = acc_t(0);
      if (label < 0) return g;
      if (weight[kHeadGrpo] != acc_t(0)) {
        // The rollout weight of log ρ = old − rollout, as GrpoEpilogue's (1 without a correction).
        const acc_t old = old_log_probs[row];
        const acc_t rw = rollout_log_probs != nullptr ? rollout_weight(grpo, old - rollout_log_probs[row]) : acc_t(1);
        const PolicyToken<acc_t> t =
            policy_token(grpo, st.log_prob(st.label), old, advantages[row], ref_log_probs != nullptr,
                         ref_log_probs != nullptr ? ref_log_probs[row] : acc_t(0), rw).t;
        const acc_t w = (loss_weights != nullptr ? loss_weights[row] : acc_t(1)) /
                        divisor_of(divisor[kHeadGrpo], divisor_value[kHeadGrpo]);
        o[kHeadGrpo] = zero_or_product(w, t.loss);  // a zero weight masks the token, even at an overflowed ratio
        const acc_t coef = zero_or_product(weight[kHeadGrpo] * w, t.coef);
        g = {coef, -coef, acc_t(0)};
      }
      if (weight[kHeadGspo] != acc_t(0)) {
        // The token's share κ_t·f(R_s, A)/D and its coefficient, as the GSPO op computes them (0 off the documents).
        o[kHeadGspo] = gspo_out[row * kGspoTokenFields + kGspoTokenLoss];
        const acc_t coef = weight[kHeadGspo] * gspo_coef[row];
        g = {coef, -coef, acc_t(0)};
      }
      return g;
    }
  }
};

// Over the tokens: each term's loss and the weighted total, 0-dim each (a term whose weight is 0 has no output: null).
template <typename T>
struct FusedHeadTotals {
  using acc_t = T;
  static constexpr int kTerms = kHeadTerms;
  const acc_t* out;
  acc_t weight[kHeadTerms];
  acc_t* dst[kHeadTerms + 1];  // total, then the terms
  C10_HOST_DEVICE void terms(int64_t i, acc_t* v) const {
    for (int k = 0; k < kTerms; ++k) v[k] = out[i * kHeadTerms + k];
  }
  C10_HOST_DEVICE void finish(const acc_t* s) const {
    acc_t total = acc_t(0);
    for (int k = 0; k < kTerms; ++k) {
      if (dst[k + 1] != nullptr) *dst[k + 1] = s[k];
      total += weight[k] * s[k];
    }
    *dst[0] = total;
  }
};

struct FusedHeadRows {
  CrossEntropyOptions<double> ce;
  PolicyOptions<double> grpo{};  // (read only with the GRPO term on)
  double weight[kHeadTerms];
  at::Tensor divisor[kHeadTerms];     // undefined: divisor_value
  double divisor_value[kHeadTerms] = {};
  at::Tensor labels;  // (N,) int64, the true labels
  at::Tensor z_mask;  // (N,) or undefined
  at::Tensor advantages, old_log_probs, ref_log_probs, rollout_log_probs, loss_weights;
  at::Tensor gspo_out, gspo_coef;  // GspoState's token_out and coef, or undefined
  at::Tensor out, log_probs;
  at::Tensor scalars[kHeadTerms + 1];
};

template <typename acc_t>
FusedHeadEpilogue<acc_t> make_fused_head_epilogue(const FusedHeadRows& r) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
  FusedHeadEpilogue<acc_t> e;
  e.labels = r.labels.const_data_ptr<int64_t>();
  e.ce = r.ce.template as<acc_t>();
  e.grpo = policy_options_as<acc_t>(r.grpo);
  for (int k = 0; k < kHeadTerms; ++k) {
    e.weight[k] = acc_t(r.weight[k]);
    e.divisor[k] = ptr(r.divisor[k]);
    e.divisor_value[k] = acc_t(r.divisor_value[k]);
  }
  e.z_mask = ptr(r.z_mask);
  e.advantages = ptr(r.advantages);
  e.old_log_probs = ptr(r.old_log_probs);
  e.ref_log_probs = ptr(r.ref_log_probs);
  e.rollout_log_probs = ptr(r.rollout_log_probs);
  e.loss_weights = ptr(r.loss_weights);
  e.gspo_out = ptr(r.gspo_out);
  e.gspo_coef = ptr(r.gspo_coef);
  e.out = r.out.data_ptr<acc_t>();
  e.log_probs = r.log_probs.data_ptr<acc_t>();
  return e;
}

// The distillation term (fused_head_distill.h).
struct DistillBackend;
struct FusedHeadDistillRows;

struct FusedHeadBackend {
  void (*rows)(const RowPassArgs&, const FusedHeadRows&);
  void (*totals)(const FusedHeadRows&);
  const GspoBackend& (*gspo)();  // the GSPO term: GSPO's statistics pass and its steps between the passes
  // The distillation term: distillation's passes, and the step between them (FusedHeadDistillStep); or all of them
  // and the gradient in one pass where `distill_fused` (null: none) applies and returns true.
  const DistillBackend& (*distill)();
  void (*distill_step)(const FusedHeadRows&, const FusedHeadDistillRows&);
  bool (*distill_fused)(const FusedHeadRows&, const FusedHeadDistillRows&);
};
// A device's FusedHeadBackend: FusedHeadBackendImpl (fused_head_distill.h).

// fused_head's arguments but the logits and the hooks (op_args.h).
RL_LOSSES_ARG_GROUP(FusedHeadOwnArgs, RL_LOSSES_FUSED_HEAD_KEYWORDS)
struct FusedHeadArgs : FusedHeadOwnArgs {
  ClipArgs clip;
  PolicyArgs policy;
  void read(schema::Args& args) {
    FusedHeadOwnArgs::read(args);
    clip.read(args);
    policy.read(args);
  }
};
RL_LOSSES_RESULT_GROUP(FusedHeadResults, RL_LOSSES_FUSED_HEAD_RESULTS)

// The results: loss (the weighted total), label_loss, z_loss, grpo_loss, gspo_loss, distillation_loss (unweighted,
// detached) and log_probs. Tensor parallelism: `row_stats` are the statistics all-reduced over the vocabulary shards (with Σx
// where the label term smooths), and the source's vocab_start / vocab_size place the shard; the op then reads its
// shard once, for the loss and the gradient.
FusedHeadResults fused_head_forward(RowSource& src, const at::Tensor& target, const FusedHeadArgs& a,
                                    const OptTensor& row_stats, const FusedHeadBackend& backend);

// The loss of the registered kernels (common/loss_kernels.h), given a back-end.
template <const FusedHeadBackend& (*kBackend)()>
struct FusedHeadLoss {
  static constexpr const char* kName = "fused_head";
  static FusedHeadResults run(RowSource& src, const at::Tensor& target, schema::Args& args, bool /*logits_op*/) {
    return fused_head_forward(src, target, args.read<FusedHeadArgs>(), args.read<RowStatsArg>().row_stats,
                              kBackend());
  }
};

}  // namespace rl_losses
