"""Pure-PyTorch references of the policy losses of verl's registry (verl 0.9.1, POLICY_LOSS_REGISTRY in
verl/trainer/ppo/core_algos.py) that the fused ops do not have yet, in verl's padded layout: log-probs ℓ, old
log-probs ℓ_old, advantages A and the response mask m, all (B, T).

Each loss returns its per-token loss matrix L (B, T) (geo_mean: its per-sequence losses (B,)) and verl's metrics
under verl's names; ``aggregate`` is verl's agg_loss over L, after the rollout importance weights w multiply L.
Written again from verl's formulas (docs/verl_menu.md), sharing no code with verl or with the
ops; the tests call them on float64 inputs against verl's own functions.

Notation: δ = ℓ − ℓ_old, r = exp(δ), ε_l / ε_h the clip ratios, mean_m(x) = Σ m·x / Σ m over the batch.
"""
from __future__ import annotations

import math

import torch

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")

# verl's safety clamp of the log-ratio before exp (vanilla, dppo_*, rollout rejection).
_SAFETY_BOUND = 20.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    on = mask > 0
    return torch.where(on, x, 0.0).sum() / on.sum().clamp_min(1)


def aggregate(loss_mat, mask, loss_agg_mode, *, dp_size=1, batch_num_tokens=None, global_batch_size=None,
              loss_scale_factor=None):
    """verl's agg_loss (core_algos.py), S_i = Σ_t m·L of sequence i, n_i its tokens, S = #{i: n_i > 0}:
    token-mean Σ_i S_i / N·dp (N = batch_num_tokens, default Σ m); token-sum Σ_i S_i·dp;
    seq-mean-token-sum Σ_i S_i / G·dp (G = global_batch_size, default S); -norm: that / loss_scale_factor
    (default T); seq-mean-token-mean Σ_i (S_i / n_i) / G·dp over the sequences with n_i > 0."""
    on = mask > 0
    per_seq = torch.where(on, loss_mat, 0.0).sum(-1)
    counts = on.sum(-1)
    has = counts > 0
    if loss_agg_mode == "token-mean":
        n = on.sum() if batch_num_tokens is None else batch_num_tokens
        return per_seq.sum() / n * dp_size
    if loss_agg_mode == "token-sum":
        return per_seq.sum() * dp_size
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"aggregate: loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    g = has.sum() if global_batch_size is None else global_batch_size
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = torch.where(has, per_seq / counts.clamp_min(1), 0.0)
    loss = per_seq.sum() / g * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def gpg(old_log_prob, log_prob, advantages, mask):
    """GPG (verl ``gpg``, compute_policy_loss_gpg): L = −A·ℓ; no metrics."""
    return -advantages * log_prob, {}


def dro(old_log_prob, log_prob, advantages, mask, *, beta):
    """DRO (verl ``dro``, compute_policy_loss_dro; ``policy_loss.dro_beta`` = β > 0): L = −(A·ℓ − β/2·δ²);
    actor/ppo_kl = mean_m(−δ)."""
    if not beta > 0:
        raise ValueError(f"dro: beta (verl's policy_loss.dro_beta) must be > 0, got beta={beta}")
    delta = log_prob - old_log_prob
    return -(advantages * log_prob - 0.5 * beta * delta**2), {"actor/ppo_kl": _masked_mean(-delta.detach(), mask)}


def geo_mean_log_ratio(delta, advantages, clip_low, clip_high):
    """GMPO's clip of each δ = ℓ − ℓ_old: δ̃ = sgn(A)·min(sgn(A)·δ, sgn(A)·clamp(δ, −ε_l, ε_h)), and verl's clipped
    flag [δ ≠ clamp(δ)] (either side, whatever A)."""
    clamped = delta.clamp(-clip_low, clip_high)
    sign = advantages.sign()
    return sign * torch.minimum(sign * delta, sign * clamped), delta != clamped


def geo_mean(old_log_prob, log_prob, advantages, mask, *, clip_low=0.2, clip_high=0.2, rollout_is_weights=None):
    """GMPO (verl ``geo_mean``, compute_policy_loss_geo_mean; arXiv 2507.20673), per sequence i:
    δ̃_t = sgn(A_t)·min(sgn(A_t)·δ_t, sgn(A_t)·clamp(δ_t, −ε_l, ε_h)) (the clip on the side that A favours; δ
    not clamped to ±20), R_i = exp(Σ_t m·δ̃_t / n_i), Ā_i = Σ_t m·A_t / n_i, L_i = −Ā_i·R_i (0 where n_i = 0);
    with weights w, L_i ·= exp(Σ_t m·log(w_t + 1e-10) / n_i). The loss is the plain mean of L_i over all B rows
    (verl ignores loss_agg_mode and global_batch_info here, and counts empty rows). Metrics: actor/pg_clipfrac
    = mean_m([δ clamped]·[A > 0]), actor/pg_clipfrac_lower the same with A < 0, actor/ppo_kl = mean_m(−δ)."""
    delta = log_prob - old_log_prob
    delta_clipped, was_clipped = geo_mean_log_ratio(delta, advantages, clip_low, clip_high)
    on = mask > 0
    n = on.sum(-1).clamp_min(1)
    ratio = torch.exp(torch.where(on, delta_clipped, 0.0).sum(-1) / n)
    per_seq = -(torch.where(on, advantages, 0.0).sum(-1) / n) * ratio
    if rollout_is_weights is not None:
        per_seq = per_seq * torch.exp(torch.where(on, torch.log(rollout_is_weights + 1e-10), 0.0).sum(-1) / n)
    with torch.no_grad():
        was_clipped = was_clipped.to(delta.dtype)
        metrics = {"actor/pg_clipfrac": _masked_mean(was_clipped * (advantages > 0), mask),
                   "actor/ppo_kl": _masked_mean(-delta, mask),
                   "actor/pg_clipfrac_lower": _masked_mean(was_clipped * (advantages < 0), mask)}
    return per_seq, metrics


def _covariance(advantages, log_prob, mask):
    # Each token's (A − mean_m A)·(ℓ − mean_m ℓ): the batch statistic clip_cov and kl_cov select tokens by.
    return (advantages - _masked_mean(advantages, mask)) * (log_prob - _masked_mean(log_prob, mask))


def clip_cov_candidates(old_log_prob, log_prob, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_cov_lb=1.0,
                        clip_cov_ub=5.0):
    """Clip-Cov's candidates (bool, detached): the masked-in tokens that the PPO clip left alone (−A·clamp(r, 1 − ε_l,
    1 + ε_h) <= −A·r) with lb < cov_t < ub, cov_t = (A_t − mean_m A)·(ℓ_t − mean_m ℓ) over the whole batch."""
    with torch.no_grad():
        ratio = torch.exp(log_prob - old_log_prob)
        clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high) > -advantages * ratio
        cov = _covariance(advantages, log_prob, mask)
        return (mask > 0) & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)


def clip_cov_selection(old_log_prob, log_prob, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_cov_ratio=2e-4,
                       clip_cov_lb=1.0, clip_cov_ub=5.0, generator=None):
    """Clip-Cov's subset (bool, detached), verl's draw: the first k = max(⌊ρ·Σ m⌋, 1) of torch.randperm(#candidates,
    generator=generator) over the candidates (clip_cov_candidates) in row-major order (all of them if fewer; drawn
    whenever there is a candidate, as verl's, from the global generator when ``generator`` is None)."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov: clip_cov_ratio must be > 0, got clip_cov_ratio={clip_cov_ratio}")
    candidate = clip_cov_candidates(old_log_prob, log_prob, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                    clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub)
    with torch.no_grad():
        flat = torch.nonzero(candidate.reshape(-1)).squeeze(-1)
        k = max(int(clip_cov_ratio * int((mask > 0).sum())), 1)
        if flat.numel() > 0:
            flat = flat[torch.randperm(flat.numel(), generator=generator)[:k]]
        selected = torch.zeros(candidate.numel(), dtype=torch.bool, device=candidate.device)
        selected[flat] = True
    return selected.reshape(candidate.shape)


def clip_cov(old_log_prob, log_prob, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_cov_ratio=2e-4,
             clip_cov_lb=1.0, clip_cov_ub=5.0, generator=None):
    """Clip-Cov (verl ``clip_cov``, compute_policy_loss_clip_cov; PRIME-RL's Entropy-Mechanism-of-RL):
    L = max(−A·r, −A·clamp(r, 1 − ε_l, 1 + ε_h))·c (δ not clamped; no dual clip), where c = 0 on the tokens of
    clip_cov_selection and 1 elsewhere. Metrics: actor/pg_clipfrac = mean_m([c = 0]), actor/ppo_kl = mean_m(−δ)."""
    selected = clip_cov_selection(old_log_prob, log_prob, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                  clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub,
                                  generator=generator)
    delta = log_prob - old_log_prob
    ratio = torch.exp(delta)
    keep = (~selected).to(delta.dtype)
    with torch.no_grad():
        metrics = {"actor/pg_clipfrac": _masked_mean(selected.to(delta.dtype), mask),
                   "actor/ppo_kl": _masked_mean(-delta, mask)}
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)) * keep, metrics


def kl_cov_selection(log_prob, advantages, mask, *, kl_cov_ratio=2e-4):
    """KL-Cov's subset (bool, detached): the k = max(⌊ρ·Σ m⌋, 1) masked-in tokens of largest cov_t (as in
    clip_cov_selection; none when no token is masked in)."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov: kl_cov_ratio must be > 0, got kl_cov_ratio={kl_cov_ratio}")
    with torch.no_grad():
        on = mask > 0
        cov = torch.where(on, _covariance(advantages, log_prob, mask), -torch.inf).reshape(-1)
        n = int(on.sum())
        chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
        if n:
            chosen[torch.topk(cov, max(1, int(n * kl_cov_ratio))).indices] = True
    return chosen.reshape(on.shape)


def kl_cov(old_log_prob, log_prob, advantages, mask, *, kl_cov_ratio=2e-4, ppo_kl_coef=0.1):
    """KL-Cov (verl ``kl_cov``, compute_policy_loss_kl_cov; PRIME-RL's Entropy-Mechanism-of-RL):
    L = −A·r + [t ∈ K]·κ·|δ|, K the tokens of kl_cov_selection, κ = ``ppo_kl_coef`` (δ not clamped).
    Metric: actor/ppo_kl = mean_m(|δ|)."""
    chosen = kl_cov_selection(log_prob, advantages, mask, kl_cov_ratio=kl_cov_ratio)
    delta = log_prob - old_log_prob
    with torch.no_grad():
        metrics = {"actor/ppo_kl": _masked_mean(delta.abs(), mask)}
    return -advantages * torch.exp(delta) + torch.where(chosen, ppo_kl_coef * delta.abs(), 0.0), metrics


def _dppo(divergence_ok, old_log_prob, log_prob, advantages, mask, clip_ratio_c):
    # DPPO's shared tail: L = −A·sg(min(r, c))·ℓ·v with v = [the divergence bound holds] (detached), r from δ
    # clamped to ±20; actor/pg_clipfrac = mean_m(1 − v), actor/pg_clipfrac_lower = mean_m([r > c]·v).
    delta = (log_prob - old_log_prob).clamp(-_SAFETY_BOUND, _SAFETY_BOUND)
    ratio = torch.exp(delta)
    valid = divergence_ok.detach().to(log_prob.dtype)
    with torch.no_grad():
        metrics = {"actor/pg_clipfrac": _masked_mean(1 - valid, mask),
                   "actor/ppo_kl": _masked_mean(-delta, mask),
                   "actor/pg_clipfrac_lower": _masked_mean((ratio > clip_ratio_c).to(valid.dtype) * valid, mask)}
    return -advantages * ratio.clamp(max=clip_ratio_c).detach() * log_prob * valid, metrics


def dppo_trust_region(name, old_log_prob, log_prob, advantages, *, clip_low=0.2, clip_high=0.2):
    """DPPO's v per token (``name`` "dppo_tv" or "dppo_kl"), p = e^ℓ, p_old = e^ℓ_old. dppo_tv: v = [p − p_old <=
    ε_h] where A > 0, [p − p_old >= −ε_l] elsewhere. dppo_kl: the binary KL D = p_old·(ℓ_old − ℓ) + (1 − p_old)·
    log((1 − p_old + 1e-8) / (1 − p + 1e-8)); v = [D <= ε_h or p <= p_old] where A > 0, [D <= ε_l or p >= p_old]
    elsewhere."""
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    if name == "dppo_tv":
        return torch.where(advantages > 0, p - p_old <= clip_high, p - p_old >= -clip_low)
    kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return torch.where(advantages > 0, (kl <= clip_high) | (p <= p_old), (kl <= clip_low) | (p >= p_old))


def dppo_tv(old_log_prob, log_prob, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0):
    """DPPO-Binary-TV (verl ``dppo_tv``, compute_policy_loss_dppo_tv; arXiv 2602.04879): v of
    dppo_trust_region; L as _dppo's (verl's ``clip_ratio_c`` is the truncation cap c)."""
    ok = dppo_trust_region("dppo_tv", old_log_prob, log_prob, advantages, clip_low=clip_low, clip_high=clip_high)
    return _dppo(ok, old_log_prob, log_prob, advantages, mask, clip_ratio_c)


def dppo_kl(old_log_prob, log_prob, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0):
    """DPPO-Binary-KL (verl ``dppo_kl``, compute_policy_loss_dppo_kl; arXiv 2602.04879): v of dppo_trust_region;
    L as _dppo's."""
    ok = dppo_trust_region("dppo_kl", old_log_prob, log_prob, advantages, clip_low=clip_low, clip_high=clip_high)
    return _dppo(ok, old_log_prob, log_prob, advantages, mask, clip_ratio_c)


def decoupled_ppo(proximal_log_prob, behaviour_log_prob, log_prob, advantages, mask, *, clip_low=0.2,
                  clip_high=0.2, behaviour_weight_cap=None):
    """Decoupled PPO of asynchronous trainers (three policies: π_behaviour sampled the tokens, π_proximal is the
    clip's anchor, π_θ is trained; AReaL's ppo_actor_loss_fn with ``behav_imp_weight_cap``, verl's decoupled
    rollout correction with old_log_prob = π_proximal): L = −sg(w)·min(r·A, clip(r, 1 − ε_l, 1 + ε_h)·A),
    r = exp(ℓ − ℓ_proximal), w = exp(ℓ_proximal − ℓ_behaviour), w = 0 where w > cap (no cap: None); the token
    mean over the response mask (the rejected tokens still count). Metrics: pg_clipfrac = mean_m([the clip binds]),
    behav_imp_weight = mean_m(w)."""
    ratio = torch.exp(log_prob - proximal_log_prob)
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    with torch.no_grad():
        weight = torch.exp(proximal_log_prob - behaviour_log_prob)
        if behaviour_weight_cap is not None:
            weight = torch.where(weight <= behaviour_weight_cap, weight, 0.0)
        metrics = {"pg_clipfrac": _masked_mean((clipped > unclipped).to(ratio.dtype), mask),
                   "behav_imp_weight": _masked_mean(weight, mask)}
    return aggregate(torch.maximum(unclipped, clipped) * weight, mask, "token-mean"), metrics


PER_TOKEN = {"gpg": gpg, "dro": dro, "clip_cov": clip_cov, "kl_cov": kl_cov, "dppo_tv": dppo_tv,
             "dppo_kl": dppo_kl}


def policy_loss(name, old_log_prob, log_prob, advantages, mask, loss_agg_mode="token-mean", *,
                rollout_is_weights=None, global_batch_info=None, **options):
    """verl's registered loss ``name`` end to end: (loss, metrics) as verl's policy-loss function returns them
    (metrics as 0-dim tensors). ``global_batch_info``: verl's dp_size / batch_num_tokens / global_batch_size /
    loss_scale_factor (geo_mean ignores it and loss_agg_mode, as verl does)."""
    if name == "geo_mean":
        per_seq, metrics = geo_mean(old_log_prob, log_prob, advantages, mask, rollout_is_weights=rollout_is_weights,
                                    **options)
        return per_seq.mean(), metrics
    loss_mat, metrics = PER_TOKEN[name](old_log_prob, log_prob, advantages, mask, **options)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    return aggregate(loss_mat, mask, loss_agg_mode, **(global_batch_info or {})), metrics


def rejection_mask(log_ratio, mask, rules):
    """verl's rollout rejection (rollout_corr_helper.compute_rollout_rejection_mask; ``rollout_rs`` and
    ``rollout_rs_threshold``): the response mask with the rejected tokens set to 0, and the masked fractions.
    ``log_ratio`` λ = ℓ_train − ℓ_rollout, clamped to ±20; per token k1 = −λ, k2 = λ²/2, k3 = e^λ − 1 − λ.
    ``rules``: (option, upper, lower) triples, all of which must pass: ``token_kX`` judges each token by its kX,
    ``seq_sum_kX`` / ``seq_mean_kX`` / ``seq_max_kX`` every token of a sequence by Σ_m / mean_m / max_m of kX over
    it (max 0 on an empty row). k2 and k3 pass at <= upper; k1 at log(lower) <= k1 <= log(upper), lower default
    1/upper. Metrics: rollout_rs_<option>_masked_fraction = mean_m(rejected by the option),
    rollout_rs_<option>_seq_masked_fraction = the share of non-empty rows with a token it rejects,
    rollout_rs_masked_fraction = mean_m(rejected), rollout_rs_seq_masked_fraction = the share of all B rows with a
    rejected token."""
    lam = log_ratio.clamp(-_SAFETY_BOUND, _SAFETY_BOUND)
    per_token = {"k1": -lam, "k2": 0.5 * lam**2, "k3": torch.exp(lam) - 1 - lam}
    on = mask > 0
    n = on.sum(-1)
    has = n > 0
    keep = torch.ones_like(on)
    metrics = {}
    for option, upper, lower in rules:
        level, estimator = option.rsplit("_", 1)
        k = per_token[estimator]
        if level == "seq_sum":
            k = torch.where(on, k, 0.0).sum(-1, keepdim=True)
        elif level == "seq_mean":
            k = torch.where(on, k, 0.0).sum(-1, keepdim=True) / n.clamp_min(1).unsqueeze(-1)
        elif level == "seq_max":
            k = torch.where(has, torch.where(on, k, -torch.inf).amax(-1), 0.0).unsqueeze(-1)
        elif level != "token":
            raise ValueError(f"rejection_mask: unknown rule {option!r}")
        if estimator == "k1":
            lower = 1 / upper if lower is None else lower
            passes = (k >= math.log(lower)) & (k <= math.log(upper))
        else:
            passes = k <= upper
        rejected = on & ~passes.expand_as(on)
        keep &= ~rejected
        metrics[f"rollout_rs_{option}_masked_fraction"] = _masked_mean(rejected.to(lam.dtype), mask)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            rejected.any(-1).to(lam.dtype).sum() / has.sum().clamp_min(1))
    rejected = on & ~keep
    metrics["rollout_rs_masked_fraction"] = _masked_mean(rejected.to(lam.dtype), mask)
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(-1).to(lam.dtype).mean()
    return mask * keep.to(mask.dtype), metrics


def cov_selection(p, old, lp, adv, mask, epsilon_low, epsilon_high):
    # The ops' clip_cov / kl_cov subset of the labelled tokens for the options p (reference.Policy), else None.
    # kl_cov's is kl_cov_selection; clip_cov's draw is the op's (docs/policy_losses.md): of clip_cov_candidates,
    # the k = max(⌊ρ·Σm⌋, 1) of smallest key, the keys torch.rand over every token in float64 on the tensors'
    # device (ties: index order).
    if p.loss_type == "kl_cov":
        return kl_cov_selection(lp, adv, mask, kl_cov_ratio=p.kl_cov_ratio)
    if p.loss_type == "clip_cov":
        candidate = clip_cov_candidates(old, lp, adv, mask, clip_low=epsilon_low, clip_high=epsilon_high,
                                        clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub)
        keys = torch.rand(mask.numel(), dtype=torch.float64, device=mask.device)
        k = max(int(p.clip_cov_ratio * int(mask.sum())), 1)
        first = torch.argsort(torch.where(candidate.reshape(-1), keys, 2.0), stable=True)[:k]
        selected = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        selected[first] = True
        return selected.reshape(mask.shape) & candidate
    return None
