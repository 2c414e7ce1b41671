#include "common/policy.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <utility>

#include "common/checks.h"

namespace rl_losses {

void check_clip(const char* op, const ClipArgs& clip, double beta, bool has_ref_log_probs) {
  check_epsilons(op, clip.epsilon_low, clip.epsilon_high);
  check_delta(op, clip.delta, clip.epsilon_high);
  check_beta(op, beta, has_ref_log_probs);
}

PolicyOptions<double> make_policy_options(const char* op, const PolicyArgs& a, const FusedPolicyArgs* fused,
                                          const ClipArgs* clip, double beta, bool has_rollout) {
  const FusedPolicyArgs no_fused{};
  const FusedPolicyArgs& f = fused ? *fused : no_fused;
  const bool has_delta = clip && clip->delta.has_value();
  const double delta = has_delta ? *clip->delta : 0.0;  // (0 where unset: it then prints nowhere)
  PolicyOptions<double> o{};
  if (clip) {
    o.clip = {.epsilon_low = clip->epsilon_low,
              .epsilon_high = clip->epsilon_high,
              .delta = has_delta ? delta : std::numeric_limits<double>::infinity()};
  }
  // The loss types by name, in PolicyLossType's order.
  constexpr const char* kLossTypeNames[] = {"ppo_clip", "cispo", "sapo", "vespo", "gpg", "dro", "dppo_tv", "dppo_kl",
                                            "geo_mean", "clip_cov", "kl_cov"};
  const auto* found = std::find(std::begin(kLossTypeNames), std::end(kLossTypeNames), a.loss_type);
  TORCH_CHECK(found != std::end(kLossTypeNames), op, ": loss_type must be 'ppo_clip', 'cispo', 'sapo', 'vespo', 'gpg', "
              "'dro', 'dppo_tv', 'dppo_kl', 'geo_mean', 'clip_cov' or 'kl_cov', got '", a.loss_type, "' (TRL's grpo, "
              "bnpo, dr_grpo, dapo and luspo are ppo_clip with an aggregation preset: "
              "rl_losses.aggregation.TRL_LOSS_TYPES)");
  o.loss_type = static_cast<int>(found - std::begin(kLossTypeNames));
  TORCH_CHECK(o.loss_type == kPpoClip || !has_delta, op, ": delta (the two-sided clip) applies to loss_type "
              "'ppo_clip' only, got loss_type '", a.loss_type, "' with delta = ", delta);
  TORCH_CHECK(o.loss_type != kCispo || !clip || clip->epsilon_high > 0, op, ": loss_type 'cispo' caps the ratio "
              "at epsilon_high, which must be > 0, got ", clip ? clip->epsilon_high : 0.0);
  for (const auto& [name, tau] : {std::pair<const char*, double>{"sapo_temperature_pos", a.sapo_temperature_pos},
                                  {"sapo_temperature_neg", a.sapo_temperature_neg}}) {
    TORCH_CHECK(std::isfinite(tau) && tau > 0, op, ": ", name, " must be a finite value > 0, got ", tau);
  }
  // verl's dro raises without a positive policy_loss.dro_beta; a dro_beta of another loss type would be unused.
  TORCH_CHECK(o.loss_type != kDro || a.dro_beta, op, ": loss_type 'dro' needs dro_beta (verl's "
              "policy_loss.dro_beta), got None");
  if (a.dro_beta) {
    TORCH_CHECK(o.loss_type == kDro, op, ": dro_beta applies to loss_type 'dro' only, got loss_type '", a.loss_type,
                "' with dro_beta = ", *a.dro_beta);
    TORCH_CHECK(std::isfinite(*a.dro_beta) && *a.dro_beta > 0, op, ": dro_beta must be a finite value > 0, got ",
                *a.dro_beta);
    o.dro_beta = *a.dro_beta;
  }
  TORCH_CHECK(std::isfinite(a.clip_ratio_c) && a.clip_ratio_c > 0, op, ": clip_ratio_c (dppo_tv's and dppo_kl's cap "
              "of the ratio) must be a finite value > 0, got ", a.clip_ratio_c);
  o.clip_ratio_c = a.clip_ratio_c;
  // clip_cov's and kl_cov's (verl asserts the ratios > 0; a kl_cov_ratio above 1 asks torch.topk for more tokens
  // than there are).
  TORCH_CHECK(std::isfinite(a.clip_cov_ratio) && a.clip_cov_ratio > 0, op, ": clip_cov_ratio (clip_cov's share of "
              "the tokens) must be a finite value > 0, got ", a.clip_cov_ratio);
  TORCH_CHECK(!std::isnan(a.clip_cov_lb) && !std::isnan(a.clip_cov_ub) && a.clip_cov_lb < a.clip_cov_ub, op,
              ": clip_cov_lb < clip_cov_ub must hold (clip_cov's band of the covariance), got ", a.clip_cov_lb, " and ",
              a.clip_cov_ub);
  TORCH_CHECK(a.kl_cov_ratio > 0 && a.kl_cov_ratio <= 1, op, ": kl_cov_ratio (kl_cov's share of the tokens) must "
              "be in (0, 1], got ", a.kl_cov_ratio);
  TORCH_CHECK(std::isfinite(a.ppo_kl_coef), op, ": ppo_kl_coef (kl_cov's penalty) must be finite, got ",
              a.ppo_kl_coef);
  o.ppo_kl_coef = a.ppo_kl_coef;
  o.sapo_tau_pos = a.sapo_temperature_pos;
  o.sapo_tau_neg = a.sapo_temperature_neg;
  if (fused) {
    for (const auto& [name, k] : {std::pair<const char*, double>{"vespo_k_pos", f.vespo_k_pos},
                                  {"vespo_k_neg", f.vespo_k_neg}}) {
      TORCH_CHECK(std::isfinite(k), op, ": ", name, " must be finite, got ", k);
    }
    for (const auto& [name, lambda] : {std::pair<const char*, double>{"vespo_lambda_pos", f.vespo_lambda_pos},
                                       {"vespo_lambda_neg", f.vespo_lambda_neg}}) {
      TORCH_CHECK(std::isfinite(lambda) && lambda >= 0, op, ": ", name, " must be a finite value >= 0 (TRL raises "
                  "it to 1e-4), got ", lambda);
    }
  }
  // TRL's get_gamma_weights: lambda.clamp(min=1e-4).
  o.vespo_k_pos = f.vespo_k_pos;
  o.vespo_lambda_pos = std::max(f.vespo_lambda_pos, 1e-4);
  o.vespo_k_neg = f.vespo_k_neg;
  o.vespo_lambda_neg = std::max(f.vespo_lambda_neg, 1e-4);

  o.beta = beta;
  if (a.kl_estimator == "k1") {
    o.kl_estimator = kKlK1;
  } else if (a.kl_estimator == "k2") {
    o.kl_estimator = kKlK2;
  } else if (a.kl_estimator == "k3") {
    o.kl_estimator = kKlK3;
  } else {
    TORCH_CHECK(false, op, ": kl_estimator must be 'k1', 'k2' or 'k3', got '", a.kl_estimator, "'");
  }
  o.kl_importance_weighted = a.kl_importance_weighted;

  o.rollout_mode = kRolloutNone;
  o.rollout_cap = a.rollout_cap;
  o.rollout_lo = 0;
  o.rollout_hi = std::numeric_limits<double>::infinity();
  // verl's bypass_mode: the rollout log-probs are the old side of the ratio, so a correction by old / rollout would
  // weigh 1 (verl's own weights of the current log-probs: loss_type 'cispo' is its reinforce with rollout_is="token").
  TORCH_CHECK(!f.bypass_mode || has_rollout, op, ": bypass_mode needs rollout_log_probs (the old side of the ratio "
              "and what rollout_rs judges the current log-probs against)");
  TORCH_CHECK(!f.bypass_mode || !a.rollout_correction, op, ": bypass_mode takes no rollout_correction (old is the "
              "rollout, so its weight would be 1; verl's reinforce with rollout_is='token' is loss_type 'cispo'), "
              "got '", a.rollout_correction.value_or(""), "'");
  if (a.rollout_correction) {
    const std::string& m = *a.rollout_correction;
    TORCH_CHECK(m == "token_truncate" || m == "token_mask" || m == "sequence_truncate" || m == "sequence_mask", op,
                ": rollout_correction must be None, 'token_truncate', 'token_mask', 'sequence_truncate' or "
                "'sequence_mask', got '", m, "'");
    TORCH_CHECK(has_rollout, op, ": rollout_correction = '", m, "' needs rollout_log_probs");
    const bool truncate = m.find("truncate") != std::string::npos;
    o.rollout_mode = truncate ? kRolloutTruncate : kRolloutMask;
    if (truncate) {
      TORCH_CHECK(std::isfinite(a.rollout_cap) && a.rollout_cap > 0, op, ": rollout_cap must be a finite value > 0, ",
                  "got ", a.rollout_cap);
      TORCH_CHECK(!a.rollout_mask_bounds, op, ": rollout_mask_bounds apply to the '*_mask' modes, got "
                  "rollout_correction = '", m, "'");
    } else if (a.rollout_mask_bounds) {
      const auto& b = *a.rollout_mask_bounds;
      TORCH_CHECK(b.size() == 2, op, ": rollout_mask_bounds must be (lo, hi), got ", b.size(), " values");
      TORCH_CHECK(!std::isnan(b[0]) && !std::isnan(b[1]) && b[0] < b[1], op,
                  ": rollout_mask_bounds must satisfy lo < hi, got (", b[0], ", ", b[1], ")");
      o.rollout_lo = b[0];
      o.rollout_hi = b[1];
    } else {
      // TRL's default: ratios above the cap are masked, none below.
      TORCH_CHECK(std::isfinite(a.rollout_cap) && a.rollout_cap > 0, op, ": rollout_cap must be a finite value > 0, ",
                  "got ", a.rollout_cap);
      o.rollout_hi = a.rollout_cap;
    }
  } else {
    // (rollout_rs and bypass_mode alone read them too: rollout_rejection_rules)
    TORCH_CHECK(!has_rollout || f.rollout_rs || f.bypass_mode, op, ": rollout_log_probs given without "
                "rollout_correction (one of 'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'), "
                "rollout_rs or bypass_mode");
    TORCH_CHECK(!a.rollout_mask_bounds, op, ": rollout_mask_bounds given without a '*_mask' rollout_correction");
  }
  TORCH_CHECK(std::isfinite(f.entropy_coefficient), op, ": entropy_coefficient must be finite, got ",
              f.entropy_coefficient);
  o.entropy_coefficient = f.entropy_coefficient;
  return o;
}

void check_sequence_ratio_loss_type(const char* op, const PolicyOptions<double>& o, const PolicyArgs& a) {
  TORCH_CHECK(!token_log_prob_loss_type(o.loss_type), op, ": loss_type '", a.loss_type, "' weighs each token's own "
              "log-prob ratio, not a sequence's: use grpo (or policy_token_loss); gspo takes 'ppo_clip', 'cispo', "
              "'sapo', 'vespo' or 'geo_mean'");
}

void check_token_ratio_loss_type(const char* op, const PolicyOptions<double>& o, const PolicyArgs& a) {
  TORCH_CHECK(o.loss_type != kGeoMean, op, ": loss_type '", a.loss_type, "' takes the geometric mean of a sequence's "
              "clipped ratios: use gspo");
}

at::Tensor broadcast_per_sequence(const at::Tensor& t, const at::Tensor& target) {
  if (t.dim() < target.dim() && t.dim() >= 1 && t.sizes() == target.sizes().slice(0, t.dim())) {
    at::Tensor v = t;
    while (v.dim() < target.dim()) v = v.unsqueeze(-1);
    return v.expand(target.sizes());
  }
  return t;  // check_per_token reports any other shape
}

SequenceIds sequence_ids(const char* op, const std::optional<at::Tensor>& document_index,
                         std::optional<int64_t> num_documents, const at::Tensor& target, const char* why) {
  SequenceIds s;
  if (document_index) {
    const at::Tensor& d = *document_index;
    TORCH_CHECK(at::isIntegralType(d.scalar_type(), false) && d.sizes() == target.sizes() &&
                    d.device() == target.device(),
                op, ": document_index must be an integer tensor shaped like target ", target.sizes(), " on ",
                target.device(), ", got ", d.scalar_type(), " ", d.sizes(), " on ", d.device());
    s.ids = flat_contiguous(d, at::kLong);
    s.count = document_count(op, s.ids, num_documents);  // CUDA: ids >= count assert in GrpoSequenceTerms
    return s;
  }
  TORCH_CHECK(target.dim() >= 2, op, ": ", why, " needs the sequences: pass document_index, or labels shaped ",
              "(B, T), got labels of shape ", target.sizes());
  s.row_length = target.size(-1);
  s.count = s.row_length > 0 ? target.numel() / s.row_length : 0;
  return s;
}

}  // namespace rl_losses
