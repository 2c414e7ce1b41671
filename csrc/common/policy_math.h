// The per-token math of the policy-loss family (docs/policy_losses.md): the objective of each loss type, the
// rollout-engine correction weight, the KL estimators and VESPO's sequence weight. Like
// math.h (which includes it), one copy called by the CPU loops and the CUDA kernels alike; fp32 (fp64 for fp64
// inputs on the CPU).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <limits>

#include "common/math.h"

namespace rl_losses {

// The per-token objectives of the policy losses (docs/policy_losses.md), as functions of the ratio r, the
// advantage A and the log-prob lp of the label. `coef` is −∂ℓ/∂lp, so the gradient w.r.t. x is coef·(p − onehot).
// Every coefficient that a clip, cap or mask switches off is an exact 0, never 0·inf: the ratio of a token far
// off-policy may overflow to inf, and its gradient must still be finite.
enum PolicyLossType : int { kPpoClip = 0, kCispo = 1, kSapo = 2, kVespo = 3, kGpg = 4, kDro = 5, kDppoTv = 6,
                             kDppoKl = 7, kGeoMean = 8, kClipCov = 9, kKlCov = 10 };
// The loss types whose token loss reads the rest of its sequence (VESPO's weight, GMPO's mean): the fused ops' alone.
C10_HOST_DEVICE inline bool sequence_loss_type(int loss_type) { return loss_type == kVespo || loss_type == kGeoMean; }
enum KlEstimator : int { kKlK1 = 1, kKlK2 = 2, kKlK3 = 3 };
enum RolloutMode : int { kRolloutNone = 0, kRolloutTruncate = 1, kRolloutMask = 2 };

template <typename T>
struct PolicyOptions {
  ClipOptions<T> clip;
  int loss_type;          // PolicyLossType
  T sapo_tau_pos;         // SAPO temperature where A > 0
  T sapo_tau_neg;         // SAPO temperature where A <= 0
  T dro_beta;             // dro: the penalty β/2·(lp − old)²
  T clip_ratio_c;         // dppo_*: the ratio's truncation cap
  T ppo_kl_coef;          // kl_cov: κ of the selected tokens' penalty κ·|lp − old|
  T beta;                 // KL penalty towards ref_log_probs; 0 disables it
  int kl_estimator;       // KlEstimator
  bool kl_importance_weighted;  // sg(r)·KL
  int rollout_mode;       // RolloutMode
  T rollout_cap;          // truncate: min(ρ, C)
  T rollout_lo, rollout_hi;  // mask: ρ kept in [lo, hi], weight 0 outside
  T entropy_coefficient;  // adds −c·H_t per token (before the token weight)
  // VESPO's gamma weight φ(w) = exp(λ + k·log w − λ·w), (k, λ) = (k_pos, λ_pos) where A >= 0, else the _neg
  // pair; λ is at least 1e-4 (TRL's clamp, applied on the host).
  T vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg;
};

template <typename T>
struct PolicyToken {
  T loss;   // ℓ_t
  T coef;   // ∂ℓ_t/∂lp_t · (−1): the gradient w.r.t. x is coef·(p − onehot)
  T ratio;  // r_t
};

// σ(u)·(1 − σ(u)) = e/(1 + e)² with e = exp(−|u|): no overflow, and exactly 0 for |u| = inf.
template <typename T>
C10_HOST_DEVICE inline T sigmoid_slope(T u) {
  const T e = ::exp(-::fabs(u));
  return e / ((T(1) + e) * (T(1) + e));
}

// The surrogate of one loss type (its clip/cap/gate), without the rollout weight and the KL:
//   ppo_clip: ℓ = −min(min(r, δ)·A, clip(r, 1−ε_l, 1+ε_h)·A)             coef = c(r, A)·r
//   cispo:    ℓ = −sg(min(r, ε_h))·A·lp   (the cap is ε_h itself, as TRL's and Liger's)   coef = min(r, ε_h)·A
//   sapo:     ℓ = −(4/τ)·σ(τ(r − 1))·A,  τ = τ_pos if A > 0 else τ_neg     coef = 4σ(1−σ)·r·A
template <typename T>
C10_HOST_DEVICE inline PolicyToken<T> policy_surrogate(const PolicyOptions<T>& o, T ratio, T advantage, T log_prob) {
  if (o.loss_type == kCispo) {
    const T w = ratio < o.clip.epsilon_high ? ratio : o.clip.epsilon_high;
    return {-zero_or_product(w * advantage, log_prob), w * advantage, ratio};
  }
  if (o.loss_type == kSapo) {
    const T tau = advantage > T(0) ? o.sapo_tau_pos : o.sapo_tau_neg;
    const T u = tau * (ratio - T(1));
    const T sig = T(1) / (T(1) + ::exp(-u));
    return {-(T(4) / tau) * sig * advantage, zero_or_product(T(4) * sigmoid_slope(u) * advantage, ratio), ratio};
  }
  return {clipped_surrogate_loss(o.clip, ratio, advantage), clip_gradient_factor(o.clip, ratio, advantage),
          ratio};
}

// VESPO (TRL's GRPOTrainer.get_gamma_weights, Liger's get_gamma_weights): a detached sequence-level weight
//   ℓ_t = −sg(φ_t)·A_t·lp_t,   φ_t = exp(λ + k·log w − λ·w),   (k, λ) by the sign of A_t (A >= 0: the _pos pair)
// with log w = clamp(Σ_s clamp(lp − old, ±20) [+ Σ_s clamp(log ω_t, log 1e-8, 20)], log 1e-8, 20) over the
// token's sequence (the rollout term: token-level correction weights ω_t, or once the sequence's ω_s). φ(1) = 1;
// a non-finite φ is 0 (TRL's nan_to_num).
constexpr double kVespoLogRatioBound = 20.0;               // each token's clamp(lp − old, −20, 20)
constexpr double kVespoLogWeightFloor = -18.420680743952367;  // log(1e-8): the floor of log ω and of log w

// clamp(x, lo, hi) that keeps a NaN (as torch.clamp).
template <typename T>
C10_HOST_DEVICE inline T clamp_keep_nan(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// One token's term of VESPO's log w from its log-ratio lp − old.
template <typename T>
C10_HOST_DEVICE inline T vespo_log_ratio_term(T log_ratio) {
  return clamp_keep_nan(log_ratio, T(-kVespoLogRatioBound), T(kVespoLogRatioBound));
}

template <typename T>
C10_HOST_DEVICE inline T vespo_phi(const PolicyOptions<T>& o, T log_w_sum, T advantage) {
  const T log_w = clamp_keep_nan(log_w_sum, T(kVespoLogWeightFloor), T(kVespoLogRatioBound));
  const bool pos = advantage >= T(0);
  const T k = pos ? o.vespo_k_pos : o.vespo_k_neg;
  const T lambda = pos ? o.vespo_lambda_pos : o.vespo_lambda_neg;
  const T phi = ::exp(lambda + k * log_w - lambda * ::exp(log_w));
  return phi <= std::numeric_limits<T>::max() ? phi : T(0);  // NaN and inf: 0
}

// −sg(φ)·A·lp; its coefficient φ·A (as cispo's, with φ for the capped ratio).
template <typename T>
C10_HOST_DEVICE inline PolicyToken<T> vespo_surrogate(T phi, T ratio, T advantage, T log_prob) {
  return {-zero_or_product(phi * advantage, log_prob), phi * advantage, ratio};
}

// The loss types of verl's menu that read the token's own log-probs, δ = lp − old (not only r): per token (clip_cov
// and kl_cov with a subset chosen beforehand), so GRPO and policy_token_loss have them; GSPO, whose ratio is the
// sequence's, does not.
//   gpg:  ℓ = −A·lp                       coef = A
//   dro:  ℓ = −(A·lp − β/2·δ²)            coef = A − β·δ          (β: dro_beta)
C10_HOST_DEVICE inline bool token_log_prob_loss_type(int loss_type) {
  return (loss_type >= kGpg && loss_type <= kDppoKl) || loss_type == kClipCov || loss_type == kKlCov;
}
template <typename T>
C10_HOST_DEVICE inline PolicyToken<T> gpg_dro_surrogate(const PolicyOptions<T>& o, T ratio, T advantage, T log_prob,
                                                        T old_log_prob) {
  const T loss = -zero_or_product(advantage, log_prob);
  if (o.loss_type == kGpg) return {loss, advantage, ratio};
  const T delta = log_prob - old_log_prob;
  return {loss + T(0.5) * o.dro_beta * delta * delta, advantage - o.dro_beta * delta, ratio};
}

// DPPO-Binary-TV / -KL (verl's compute_policy_loss_dppo_tv/_kl, arXiv 2602.04879): a trust region on the
// probabilities p = e^lp, p_old = e^old, judged on the side the advantage pushes; v = 1 inside it, 0 outside:
//   dppo_tv: A > 0: p − p_old <= ε_h;   else p − p_old >= −ε_l
//   dppo_kl: D = p_old·(old − lp) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8));
//            A > 0: D <= ε_h or p <= p_old;   else D <= ε_l or p >= p_old
// and ℓ = −A·sg(min(r̃, c))·lp·v, r̃ = exp(clamp(δ, ±20)) (verl's clamp), c = clip_ratio_c; coef = A·min(r̃, c)·v.
constexpr double kDppoLogRatioBound = 20.0;
template <typename T>
C10_HOST_DEVICE inline bool dppo_inside(const PolicyOptions<T>& o, T log_prob, T old_log_prob, T advantage) {
  const T p = ::exp(log_prob);
  const T p_old = ::exp(old_log_prob);
  const bool pos = advantage > T(0);
  if (o.loss_type == kDppoTv) return pos ? p - p_old <= o.clip.epsilon_high : p - p_old >= -o.clip.epsilon_low;
  const T d = p_old * (old_log_prob - log_prob) +
              (T(1) - p_old) * ::log((T(1) - p_old + T(1e-8)) / (T(1) - p + T(1e-8)));
  return pos ? (d <= o.clip.epsilon_high || p <= p_old) : (d <= o.clip.epsilon_low || p >= p_old);
}
template <typename T>
C10_HOST_DEVICE inline PolicyToken<T> dppo_surrogate(const PolicyOptions<T>& o, bool inside, T ratio, T advantage,
                                                     T log_prob, T old_log_prob) {
  const T r = ::exp(clamp_keep_nan(log_prob - old_log_prob, T(-kDppoLogRatioBound), T(kDppoLogRatioBound)));
  const T w = !inside ? T(0) : r > o.clip_ratio_c ? o.clip_ratio_c : r;
  return {-zero_or_product(w * advantage, log_prob), w * advantage, ratio};
}

// GMPO (verl's geo_mean, compute_policy_loss_geo_mean; arXiv 2507.20673), GSPO's sequence ratio with the clip
// inside its geometric mean: each token's δ = lp − old is clipped in log space to [−ε_l, ε_h] (verl's clip_ratio_low
// and _high themselves, not log(1 ∓ ε)) on the side its advantage favours, δ̃ = sgn(A)·min(sgn(A)·δ, sgn(A)·clamp(δ)):
//   A > 0: min(δ, ε_h);   A < 0: max(δ, −ε_l);   A = 0: 0
// R_s = exp(mean δ̃) and f = −A·R_s; ∂δ̃/∂δ is 1 where δ̃ = δ (inside), else 0.
template <typename T>
C10_HOST_DEVICE inline T geo_mean_log_ratio(const PolicyOptions<T>& o, T delta, T advantage) {
  if (advantage > T(0)) return delta < o.clip.epsilon_high ? delta : o.clip.epsilon_high;
  if (advantage < T(0)) return delta > -o.clip.epsilon_low ? delta : -o.clip.epsilon_low;
  return T(0);
}
template <typename T>
C10_HOST_DEVICE inline bool geo_mean_inside(const PolicyOptions<T>& o, T delta, T advantage) {
  return advantage > T(0) ? delta <= o.clip.epsilon_high : advantage < T(0) && delta >= -o.clip.epsilon_low;
}
// verl's clipped flag (its pg_clipfrac where A > 0, pg_clipfrac_lower where A < 0): δ outside [−ε_l, ε_h] on
// either side, whichever side the advantage clips.
template <typename T>
C10_HOST_DEVICE inline bool geo_mean_outside(const PolicyOptions<T>& o, T delta) {
  return delta < -o.clip.epsilon_low || delta > o.clip.epsilon_high;
}
// −A·R at the document's ratio; coef (−∂f/∂log R, times the token's ∂δ̃/∂δ) A·R where inside, else 0.
template <typename T>
C10_HOST_DEVICE inline PolicyToken<T> geo_mean_surrogate(T ratio, T advantage, bool inside) {
  return {-zero_or_product(advantage, ratio), inside ? zero_or_product(advantage, ratio) : T(0), ratio};
}

// Clip-Cov and KL-Cov (verl's clip_cov / kl_cov, compute_policy_loss_clip_cov / _kl_cov; arXiv 2505.22617): the
// batch's covariance statistic picks a subset of tokens (cov_selection, common/policy_cov.cpp; grpo: after a loss
// pass with none selected, whose selected rows it then runs again, grpo/grpo_cov.cpp), and `selected` says whether
// this token is in it:
//   clip_cov: ℓ = ppo_clip's surrogate (no δ), 0 where selected          coef = ppo_clip's, 0 where selected
//   kl_cov:   ℓ = −A·r + [selected]·κ·|δ|,  δ = lp − old                 coef = A·r − [selected]·κ·sgn(δ)
// (sgn(0) = 0: autograd's derivative of |δ| at 0, the on-policy case.)
C10_HOST_DEVICE inline bool cov_loss_type(int loss_type) { return loss_type == kClipCov || loss_type == kKlCov; }
template <typename T>
C10_HOST_DEVICE inline PolicyToken<T> cov_surrogate(const PolicyOptions<T>& o, bool selected, T ratio, T advantage,
                                                    T log_prob, T old_log_prob) {
  if (o.loss_type == kClipCov) {
    if (selected) return {T(0), T(0), ratio};
    return {clipped_surrogate_loss(o.clip, ratio, advantage), clip_gradient_factor(o.clip, ratio, advantage), ratio};
  }
  const T loss = -zero_or_product(advantage, ratio);
  if (!selected) return {loss, -loss, ratio};
  const T delta = log_prob - old_log_prob;
  const T sign = delta > T(0) ? T(1) : (delta < T(0) ? T(-1) : T(0));
  return {loss + o.ppo_kl_coef * (delta < T(0) ? -delta : delta), -loss - o.ppo_kl_coef * sign, ratio};  // |δ| in T
}

// Clipped-fraction flags per loss type: ppo_clip's low/high bounds; cispo's cap (r > ε_h and A > 0, counted as
// "high", as TRL's cispo_clip_ratio); none for sapo's soft gate, gpg, dro (dppo's: policy_token).
template <typename T>
C10_HOST_DEVICE inline bool policy_clipped_low(const PolicyOptions<T>& o, T ratio, T advantage) {
  return o.loss_type == kPpoClip && clipped_low(o.clip, ratio, advantage);
}
template <typename T>
C10_HOST_DEVICE inline bool policy_clipped_high(const PolicyOptions<T>& o, T ratio, T advantage) {
  if (o.loss_type == kCispo) return ratio > o.clip.epsilon_high && advantage > T(0);
  return o.loss_type == kPpoClip && clipped_high(o.clip, ratio, advantage);
}

// KL(π || ref) estimate of one token and its derivative w.r.t. lp, from lp and the reference log-prob q:
//   k1 = lp − q (d/dlp = 1),  k2 = ½(lp − q)² (d/dlp = lp − q),
//   k3 = exp(q − lp) − (q − lp) − 1 (d/dlp = 1 − exp(q − lp))
template <typename T>
struct KlTerm {
  T value;
  T slope;
};
template <typename T>
C10_HOST_DEVICE inline KlTerm<T> kl_estimate(int estimator, T log_prob, T ref_log_prob) {
  const T d = ref_log_prob - log_prob;
  if (estimator == kKlK1) return {-d, T(1)};
  if (estimator == kKlK2) return {T(0.5) * d * d, -d};
  return {k3(d), -T(::expm1(d))};  // (the host's ::expm1 of a float is the double one)
}

// The rollout-engine correction weight sg(w) from log ρ (ρ = π_old / π_rollout, per token or the geometric
// mean over its sequence): truncate min(ρ, C); mask ρ inside [lo, hi], 0 outside; 1 without correction.
template <typename T>
C10_HOST_DEVICE inline T rollout_weight(const PolicyOptions<T>& o, T log_rho) {
  if (o.rollout_mode == kRolloutNone) return T(1);
  const T rho = ::exp(log_rho);
  if (o.rollout_mode == kRolloutTruncate) return rho < o.rollout_cap ? rho : o.rollout_cap;
  return rho >= o.rollout_lo && rho <= o.rollout_hi ? rho : T(0);
}

// VESPO's rollout term of log w: clamp(log ω, log 1e-8, 20) with ω = rollout_weight(log ρ) (0 without a
// correction: ω = 1). Taken in the log domain: log min(ρ, C) = min(log ρ, log C); a masked ρ (ω = 0) gives
// the floor, as TRL's clamp(log 0).
template <typename T>
C10_HOST_DEVICE inline T vespo_rollout_term(const PolicyOptions<T>& o, T log_rho) {
  if (o.rollout_mode == kRolloutNone) return T(0);
  T log_w;
  if (o.rollout_mode == kRolloutTruncate) {
    const T log_cap = ::log(o.rollout_cap);
    log_w = log_rho < log_cap ? log_rho : log_cap;
  } else {
    const T rho = ::exp(log_rho);
    log_w = rho >= o.rollout_lo && rho <= o.rollout_hi ? log_rho : T(kVespoLogWeightFloor);
  }
  return clamp_keep_nan(log_w, T(kVespoLogWeightFloor), T(kVespoLogRatioBound));
}

// verl's rollout rejection statistic (rollout_rs *_k1 / *_k2 / *_k3) of one token: estimator e's k of
// δ = clamp(lp − rollout, ±20) (verl's SAFETY_BOUND): k1 = −δ, k2 = δ²/2, k3 = e^δ − 1 − δ (verl's forms; a NaN
// stays NaN and fails every test). One formula for the row pass's token rules (token_kept) and the pre-pass's tokens
// (policy_rejection.cpp through RolloutStatistic, common/rollout_statistic.h).
template <typename T>
C10_HOST_DEVICE inline T rollout_rs_statistic(int estimator, T log_prob, T rollout_log_prob) {
  const T d = clamp_keep_nan(log_prob - rollout_log_prob, T(-20), T(20));
  if (estimator == 1) return -d;
  if (estimator == 2) return T(0.5) * d * d;
  const T exp_d = ::exp(d);  // rounded to T first, as verl's torch.exp (whose CPU float exp may differ by an ulp)
  return exp_d - T(1) - d;
}

// The token rules, taken inside the row pass where bypass_mode's rules judge the current log-prob (grpo.cpp):
// estimator e's statistic must lie in [lo, hi] where `on`.
template <typename T>
struct TokenRejection {
  bool on[3];
  T lo[3], hi[3];
};
template <typename T>
C10_HOST_DEVICE inline bool token_kept(const TokenRejection<T>& r, T log_prob, T rollout_log_prob) {
  bool keep = true;
  for (int e = 0; e < 3; ++e) {
    if (r.on[e]) {
      const T k = rollout_rs_statistic(e + 1, log_prob, rollout_log_prob);
      keep = keep && k >= r.lo[e] && k <= r.hi[e];
    }
  }
  return keep;
}

// One token of the policy loss, before its weight w_t/D: the surrogate times the rollout weight, plus β·KL
// (optionally r·KL). The entropy bonus is the epilogue's (it needs the row's entropy). TRL's and
// Liger's order: the rollout weight multiplies the surrogate only, not the KL.
template <typename T>
struct PolicyTokenTerms {
  PolicyToken<T> t;
  T kl;  // the KL estimate (importance weighted when asked), 0 without a reference
  // The clipped-fraction flags: policy_clipped_low/high, or dppo's tokens outside its trust region ("high" where
  // A > 0, "low" elsewhere), or clip_cov's subset ("high").
  bool clipped_low, clipped_high;
};
// `vespo_phi`: the token's φ (loss type vespo only, computed from its sequence's sums beforehand);
// `cov_selected`: the token is in clip_cov's / kl_cov's subset (cov_selection).
template <typename T>
C10_HOST_DEVICE inline PolicyTokenTerms<T> policy_token(const PolicyOptions<T>& o, T log_prob, T old_log_prob,
                                                        T advantage, bool has_ref, T ref_log_prob, T rollout_w,
                                                        T vespo_phi = T(1), bool cov_selected = false) {
  const T ratio = ::exp(log_prob - old_log_prob);
  PolicyToken<T> t;
  bool low, high;
  if (o.loss_type == kDppoTv || o.loss_type == kDppoKl) {
    const bool inside = dppo_inside(o, log_prob, old_log_prob, advantage);
    t = dppo_surrogate(o, inside, ratio, advantage, log_prob, old_log_prob);
    high = !inside && advantage > T(0);
    low = !inside && !(advantage > T(0));
  } else if (cov_loss_type(o.loss_type)) {
    t = cov_surrogate(o, cov_selected, ratio, advantage, log_prob, old_log_prob);
    high = o.loss_type == kClipCov && cov_selected;  // verl's pg_clipfrac: the tokens clip_cov switches off
    low = false;
  } else {
    t = o.loss_type == kVespo                     ? vespo_surrogate(vespo_phi, ratio, advantage, log_prob)
        : token_log_prob_loss_type(o.loss_type) ? gpg_dro_surrogate(o, ratio, advantage, log_prob, old_log_prob)
                                                  : policy_surrogate(o, ratio, advantage, log_prob);
    low = policy_clipped_low(o, ratio, advantage);
    high = policy_clipped_high(o, ratio, advantage);
  }
  t.loss = zero_or_product(rollout_w, t.loss);
  t.coef = zero_or_product(rollout_w, t.coef);
  T kl = T(0);
  if (has_ref) {
    KlTerm<T> k = kl_estimate(o.kl_estimator, log_prob, ref_log_prob);
    if (o.kl_importance_weighted) {
      // r·KL, differentiated through r as well (∂r/∂lp = r), as TRL and Liger do: the gradient of the
      // estimate then is the unbiased one.
      k.slope = zero_or_product(ratio, k.slope + k.value);
      k.value = zero_or_product(ratio, k.value);
    }
    kl = k.value;
    if (o.beta != T(0)) {
      t.loss += o.beta * k.value;
      t.coef -= o.beta * k.slope;
    }
  }
  return {t, kl, low, high};
}

}  // namespace rl_losses
