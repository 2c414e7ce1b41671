"""The float64 reference's per-sequence steps (part of ``reference.py``, which imports them): the rollout-engine
correction weight, the sums over a sequence's labelled tokens that the sequence-level modes take, and VESPO's
weight φ (TRL's GRPOTrainer.get_gamma_weights). Written from docs/policy_losses.md; ``p`` is reference.Policy.
"""
from __future__ import annotations

import math

import torch


def _rollout_weight(p, log_rho):
    rho = log_rho.exp()
    if p.rollout_correction.endswith("truncate"):
        return rho, rho.clamp(max=p.rollout_cap)
    lo, hi = p.rollout_mask_bounds if p.rollout_mask_bounds is not None else (0.0, p.rollout_cap)
    return rho, torch.where((rho >= lo) & (rho <= hi), rho, 0.0)


def _sequence_sum(values, mask, sequence):
    # Each token gets the sum of `values` over its sequence's labelled tokens (0 where padding or unlabelled: a
    # sequence-level ratio is the product of its token ratios, TRL's and verl's definition).
    seq = torch.where(sequence >= 0, sequence, 0).reshape(-1)
    n = int(seq.max()) + 1 if seq.numel() else 1
    on = (mask & (sequence >= 0)).reshape(-1)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(
        0, seq, torch.where(on, values.reshape(-1), 0.0))
    return torch.where(on, sums[seq], 0.0).reshape(values.shape)




# VESPO (TRL's GRPOTrainer.get_gamma_weights): the clamps of its log-ratios.
_LOG_1E8 = math.log(1e-8)


def _vespo_rollout_term(p, log_rho):
    # clamp(log ω, log 1e-8, 20) of a correction weight ω (TRL: torch.log(importance_sampling_ratio), clamped).
    _, weight = _rollout_weight(p, log_rho)
    return torch.log(weight).clamp(_LOG_1E8, 20.0)


def _vespo_phi(p, log_w_sum, adv):
    # φ = exp(λ + k·log w − λ·w) with log w clamped to [log 1e-8, 20]; (k, λ) by the sign of A; λ >= 1e-4; a
    # non-finite φ is 0.
    log_w = log_w_sum.clamp(_LOG_1E8, 20.0)
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(log_w, p.vespo_k_pos), torch.full_like(log_w, p.vespo_k_neg))
    lam = torch.where(pos, torch.full_like(log_w, p.vespo_lambda_pos),
                      torch.full_like(log_w, p.vespo_lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo_weights(p, lp, old, adv, mask, sequence, log_rho, on_policy):
    """φ per token (detached) and each labelled token's share 1/n_s of its sequence (for the φ metric)."""
    mode = p.rollout_correction
    with torch.no_grad():
        term = torch.zeros_like(lp) if on_policy else (lp - old).clamp(-20.0, 20.0)
        sequence_mode = mode is not None and mode.startswith("sequence")
        if mode is not None and not sequence_mode:
            term = term + _vespo_rollout_term(p, log_rho)
        log_w = _sequence_sum(term, mask, sequence)
        if sequence_mode:  # the sequence's weight ω_s, once (Liger's (B, 1) vllm_is_ratio)
            log_w = log_w + _vespo_rollout_term(p, _sequence_sum(log_rho, mask, sequence))
        phi = _vespo_phi(p, log_w, adv)
        counts = _sequence_sum(torch.ones_like(lp), mask, sequence)
        share = torch.where(counts > 0, 1 / counts.clamp_min(1), 0.0)
    return phi, share
