// The options of the policy-loss family shared by GRPO and GSPO (docs/policy_losses.md): the loss type, the
// rollout-engine correction, the KL estimator and the entropy bonus. Host side: the schema's arguments (op_args.h:
// RL_LOSSES_CLIP, RL_LOSSES_POLICY_OPTIONS, RL_LOSSES_FUSED_POLICY_OPTIONS) are validated here, in one place, and
// turned into the PolicyOptions the kernels see (common/policy_math.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>
#include <vector>

#include "common/math.h"
#include "common/row_pass.h"
#include "op_args.h"

namespace rl_losses {

// Whether the rollout correction is taken per token or per sequence (ρ_s: the product of the token ratios
// over the sequence, TRL's definition).
inline bool sequence_level_rollout(const PolicyArgs& a) {
  return a.rollout_correction && a.rollout_correction->rfind("sequence_", 0) == 0;
}

// The kernels' options in their accumulation type, field by field.
template <typename T>
PolicyOptions<T> policy_options_as(const PolicyOptions<double>& o) {
  return {.clip = {.epsilon_low = T(o.clip.epsilon_low), .epsilon_high = T(o.clip.epsilon_high), .delta = T(o.clip.delta)},
          .loss_type = o.loss_type,
          .sapo_tau_pos = T(o.sapo_tau_pos),
          .sapo_tau_neg = T(o.sapo_tau_neg),
          .dro_beta = T(o.dro_beta),
          .clip_ratio_c = T(o.clip_ratio_c),
          .ppo_kl_coef = T(o.ppo_kl_coef),
          .beta = T(o.beta),
          .kl_estimator = o.kl_estimator,
          .kl_importance_weighted = o.kl_importance_weighted,
          .rollout_mode = o.rollout_mode,
          .rollout_cap = T(o.rollout_cap),
          .rollout_lo = T(o.rollout_lo),
          .rollout_hi = T(o.rollout_hi),
          .entropy_coefficient = T(o.entropy_coefficient),
          .vespo_k_pos = T(o.vespo_k_pos),
          .vespo_lambda_pos = T(o.vespo_lambda_pos),
          .vespo_k_neg = T(o.vespo_k_neg),
          .vespo_lambda_neg = T(o.vespo_lambda_neg)};
}

// Which of GRPO's and GSPO's scalars a call returns: every one but the metrics of an option that is off: the
// entropy's without compute_entropy or an entropy bonus, the KL's without ref_log_probs, the rollout correction's
// without one, vespo's for the other loss types; without compute_metrics, the loss, new_logprobs and the entropy
// asked for alone (rl_losses/_inputs.py states the same rule for the wrappers and the fake kernels).
inline std::array<bool, kPolicyScalars> policy_metrics_on(const PolicyOptions<double>& o, bool compute_entropy,
                                                          bool compute_metrics, bool has_ref_log_probs) {
  std::array<bool, kPolicyScalars> on;
  on.fill(compute_metrics);
  on[kPolicyLoss] = on[kPolicyNewLogProbs] = true;
  on[kPolicyEntropy] = compute_entropy || (compute_metrics && o.entropy_coefficient != 0);
  on[kPolicyKl] = compute_metrics && has_ref_log_probs;
  on[kPolicyRolloutRatio] = on[kPolicyRolloutWeight] = on[kPolicyRolloutCorrected] =
      compute_metrics && o.rollout_mode != kRolloutNone;
  on[kPolicyVespoPhi] = compute_metrics && o.loss_type == kVespo;
  return on;
}

// The results of GRPO and GSPO by name: the scalars with the per-token log-probs (GSPO adds its document_ratios);
// those not returned (policy_metrics_on) undefined: None.
inline PolicyResults policy_results(const PolicyScalarOutputs& s, const at::Tensor& log_probs) {
  PolicyResults r;
  r.loss = s.t[kPolicyLoss];
  r.new_logprobs = s.t[kPolicyNewLogProbs];
  r.clipped_fraction_low = s.t[kPolicyClipLow];
  r.clipped_fraction_high = s.t[kPolicyClipHigh];
  r.kl_old = s.t[kPolicyKlOld];
  r.entropy = s.t[kPolicyEntropy];
  r.log_probs = log_probs;
  r.ratio_mean = s.t[kPolicyRatioMean];
  r.kl = s.t[kPolicyKl];
  r.rollout_ratio_mean = s.t[kPolicyRolloutRatio];
  r.rollout_weight_mean = s.t[kPolicyRolloutWeight];
  r.rollout_corrected_fraction = s.t[kPolicyRolloutCorrected];
  r.vespo_phi_seq_mean = s.t[kPolicyVespoPhi];
  return r;
}

// The clipped objective's checks (grpo, gspo, policy_token_loss): ε_l in [0, 1), ε_h >= 0, δ > 1 + ε_h or unset, and
// β >= 0 with ref_log_probs wherever it is > 0.
void check_clip(const char* op, const ClipArgs& clip, double beta, bool has_ref_log_probs);

// Validates every option (messages name the argument and its value) and returns the kernels' options.
// `fused`: the fused ops' options (null: policy_token_loss, which has none); `clip`: the clipped objective's (null:
// gspo_document_sums, whose sums no clip reads); `has_rollout`: rollout_log_probs was given.
PolicyOptions<double> make_policy_options(const char* op, const PolicyArgs& a, const FusedPolicyArgs* fused,
                                          const ClipArgs* clip, double beta, bool has_rollout);

// GSPO's refusal of the loss types over each token's own log-probs (gpg, dro, dppo_tv, dppo_kl): its ratio is the
// sequence's; GRPO and policy_token_loss have them.
void check_sequence_ratio_loss_type(const char* op, const PolicyOptions<double>& o, const PolicyArgs& a);
// GRPO's refusal of geo_mean, whose ratio is a sequence's.
void check_token_ratio_loss_type(const char* op, const PolicyOptions<double>& o, const PolicyArgs& a);

// clip_cov's and kl_cov's subset of the tokens (docs/policy_losses.md, verl's compute_policy_loss_clip_cov /
// _kl_cov), on (N,) vectors of one device: the log-probs ℓ, old log-probs (ℓ itself on-policy), advantages A and
// the mask m (bool; nothing outside it is read). cov_t = (A_t − mean_m A)·(ℓ_t − mean_m ℓ) over the whole batch;
// kl_cov takes the k = max(⌊kl_cov_ratio·Σm⌋, 1) tokens of largest cov (ties: the first in index order); clip_cov a
// uniformly random k = max(⌊clip_cov_ratio·Σm⌋, 1) of its candidates (masked in, not clipped by the PPO clip,
// clip_cov_lb < cov < clip_cov_ub), all of them if fewer: those of the k smallest keys of torch.rand(N,
// dtype=float64) from the default generator of the tensors' device, drawn on every call. Returns the (N,) bool flags
// the per-token math reads (policy_token's `cov_selected`). No host synchronisation: k and the ranks stay on the
// device. Also the indices of the cov_subset_bound(a, o, N) tokens of lowest rank, among which every selected token
// is (grpo's fix-up of the selected rows after its loss pass).
struct CovSelection {
  at::Tensor selected;  // (N,) bool
  at::Tensor first;     // (cov_subset_bound(a, o, N),) int64, distinct
};
CovSelection cov_selection(const PolicyArgs& a, const PolicyOptions<double>& o, const at::Tensor& log_probs,
                           const at::Tensor& old_log_probs, const at::Tensor& advantages, const at::Tensor& mask);
// A bound on the subset's size k for any mask over n_tokens tokens, known on the host: max(⌊ratio·n_tokens⌋, 1),
// at most n_tokens (0 without a token).
int64_t cov_subset_bound(const PolicyArgs& a, const PolicyOptions<double>& o, int64_t n_tokens);

// Per-sequence advantages broadcast to the tokens: (B,) for (B, T) labels (any batch shape: advantages shaped
// like the labels' leading dimensions) become (B, T); a tensor shaped like the labels is returned as is.
at::Tensor broadcast_per_sequence(const at::Tensor& t, const at::Tensor& target);

// The sequences of GRPO's sequence-level options (a sequence-level rollout correction, vespo): from
// document_index (negative = padding; `ids` flattened, int64; the count is num_documents, or else max + 1, read
// on the host: the one synchronisation of a call, which num_documents avoids) or,
// without it, the rows of the labels' leading dimensions ((B, T) labels: sequence = row b, B sequences; `ids`
// undefined and `row_length` = T: the kernels take i / T).
struct SequenceIds {
  at::Tensor ids;
  int64_t row_length = 0;
  int64_t count = 0;
};
SequenceIds sequence_ids(const char* op, const std::optional<at::Tensor>& document_index,
                         std::optional<int64_t> num_documents, const at::Tensor& target, const char* why);

// verl's rollout rejection (rollout_rs, rollout_rs_threshold: docs/policy_losses.md), parsed as verl's
// _parse_rollout_rs_thresholds: one rule per distinct mode, each keeping a token (level kToken) or a sequence
// where lo <= its statistic <= hi; k1's bounds are the logs of the threshold's ratio bounds ("lo_hi", or "hi" with
// lo = 1/hi), k2's and k3's an upper bound.
struct RejectionRule {
  enum Level : int { kToken, kSeqSum, kSeqMean, kSeqMax } level;
  int estimator;  // 1, 2 or 3: k1 = −δ, k2 = δ²/2, k3 = e^δ − 1 − δ of δ = clamp(old − rollout, ±20) (bypass: lp)
  double lo, hi;
};
// The rules of rollout_rs and rollout_rs_threshold (none without rollout_rs); checks that the old (unless
// bypass_mode: then the rules judge the current log-probs) and rollout log-probs are given.
std::vector<RejectionRule> rollout_rejection_rules(const char* op, const OptString& rollout_rs,
                                                   const OptString& rollout_rs_threshold, bool has_old,
                                                   bool has_rollout, bool bypass_mode);
inline bool has_sequence_rule(const std::vector<RejectionRule>& rules) {
  for (const RejectionRule& r : rules) {
    if (r.level != RejectionRule::kToken) return true;
  }
  return false;
}
// The token rules of `rules`, as the row pass takes them (token_kept): none `on` without one.
TokenRejection<double> token_rejection(const std::vector<RejectionRule>& rules);
template <typename T>
TokenRejection<T> token_rejection_as(const TokenRejection<double>& r) {
  return {{r.on[0], r.on[1], r.on[2]}, {T(r.lo[0]), T(r.lo[1]), T(r.lo[2])}, {T(r.hi[0]), T(r.hi[1]), T(r.hi[2])}};
}
// The rules that judge a sequence (all but the token rules).
std::vector<RejectionRule> sequence_rules(const std::vector<RejectionRule>& rules);
// The op's pre-pass: the labels with every token a rule rejects set to −100 (O(N) ATen steps on the (N,) inputs, no
// read of the logits). `seq`: the sequences of the sequence rules (labelled tokens with a negative id belong to none:
// only the token rules judge them).
at::Tensor reject_rollout_tokens(const std::vector<RejectionRule>& rules, const at::Tensor& target1d,
                                 const at::Tensor& old_log_probs, const at::Tensor& rollout_log_probs,
                                 const SequenceIds& seq);
// Each token's sequence (0 where it has none) and whether it has one, for the per-sequence sums of the pre-pass.
std::pair<at::Tensor, at::Tensor> sequence_of_tokens(const SequenceIds& seq, int64_t n, const at::Device& device);
// label_counts (each token's document's labelled count) less the tokens of that document the pre-pass rejected.
at::Tensor recount_labels(const at::Tensor& counts, const at::Tensor& target1d, const at::Tensor& kept,
                          const SequenceIds& seq);

}  // namespace rl_losses
