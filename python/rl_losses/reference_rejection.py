"""The reference's verl rollout rejection over any sequences (docs/policy_losses.md, "verl's rollout rejection"):
the labels with every rejected token set to −100, written again from verl's compute_rollout_rejection_mask (its
(B, T) form, with the metrics, is reference_verl.rejection_mask), and GRPO's aggregation presets over the kept
labels."""
from __future__ import annotations

import math

import torch


def _rules(rollout_rs: str, rollout_rs_threshold: str):
    modes = list(dict.fromkeys(m.strip() for m in rollout_rs.split(",") if m.strip()))
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    for mode, spec in zip(modes, specs * len(modes) if len(specs) == 1 else specs):
        level, estimator = mode.rsplit("_", 1)
        if estimator == "k1":
            lower, _, upper = spec.partition("_") if "_" in spec else (None, None, spec)
            upper = float(upper)
            lower = 1 / upper if lower is None else float(lower)
            yield level, estimator, math.log(lower), math.log(upper)
        else:
            yield level, estimator, -math.inf, float(spec)


def bypass_inputs(bypass_mode, old_log_probs, rollout_log_probs, log_probs):
    """(old, judged): verl's bypass_mode takes the rollout's log-probs as the old ones (where none are given) and
    judges the current ``log_probs`` (detached) with rollout_rs; otherwise the rules judge old_log_probs."""
    if not bypass_mode:
        return old_log_probs, old_log_probs
    return rollout_log_probs if old_log_probs is None else old_log_probs, log_probs.detach()


def rejected_labels(target, old, rollout, sequence, rollout_rs, rollout_rs_threshold):
    """``target`` with −100 where verl's rules reject the token: δ = clamp(old − rollout, ±20), k1 = −δ, k2 = δ²/2,
    k3 = e^δ − 1 − δ, judged per token or by the Σ / mean / max over the labelled tokens of its ``sequence`` (ids,
    negative = none: such a token is judged by the token rules only)."""
    if rollout_rs is None:
        return target
    lam = (old - rollout).clamp(-20.0, 20.0)
    per_token = {"k1": -lam, "k2": 0.5 * lam**2, "k3": torch.exp(lam) - 1 - lam}
    on = target >= 0
    keep = torch.ones_like(on)
    for level, estimator, lo, hi in _rules(rollout_rs, rollout_rs_threshold):
        k = per_token[estimator]
        if level != "token":
            seq = sequence.reshape(-1).long()
            member = on.reshape(-1) & (seq >= 0)
            ids = torch.where(seq >= 0, seq, 0)
            s = int(ids.max()) + 1 if ids.numel() else 0
            flat = k.reshape(-1)
            if level == "seq_max":
                best = torch.full((s,), -math.inf, dtype=k.dtype, device=k.device).scatter_reduce(
                    0, ids, torch.where(member, flat, -math.inf), "amax")
                stat = torch.where(best == -math.inf, 0.0, best)
            else:
                stat = torch.zeros(s, dtype=k.dtype, device=k.device).index_add(0, ids, torch.where(member, flat, 0.0))
                if level == "seq_mean":
                    stat = stat / (torch.zeros(s, dtype=k.dtype, device=k.device).index_add(0, ids, member.to(k.dtype)) + 1e-8)
            k = torch.where(seq >= 0, stat[ids], hi).reshape(target.shape)
        keep &= (k >= lo) & (k <= hi)
    return torch.where(keep, target, -100)


def recounted(label_counts, target, kept_target, sequence):
    """label_counts less each sequence's rejected tokens."""
    seq = sequence.reshape(-1).long()
    ids = torch.where(seq >= 0, seq, 0)
    rejected = ((target >= 0) & (kept_target < 0)).reshape(-1) & (seq >= 0)
    per_seq = torch.zeros(int(ids.max()) + 1, dtype=label_counts.dtype, device=ids.device).index_add(0, ids,
                                                                                  rejected.to(label_counts.dtype))
    return label_counts - per_seq[ids].reshape(label_counts.shape)


def aggregation_weights(preset, mask, sequence, loss_weights, divisor):
    """(weights, divisor) of grpo's ``aggregation`` over the kept mask: w = u·m (/ the sequence's kept count for
    sequence_mean_token_mean); D given, or Σm (token_mean), or the sequences with a kept token (times T,
    sequence_sum_constant)."""
    dt = mask.dtype
    w = mask if loss_weights is None else loss_weights.to(dt) * mask
    if preset == "token_mean":
        return w, mask.sum().clamp_min(1) if divisor is None else divisor
    seq = sequence.reshape(-1).long()
    ids = torch.where(seq >= 0, seq, 0)
    member = mask.reshape(-1) * (seq >= 0).to(dt)
    counts = torch.zeros(int(ids.max()) + 1, dtype=dt, device=ids.device).index_add(0, ids, member)
    w = w * (seq >= 0).to(dt).reshape(w.shape)
    if preset == "sequence_mean_token_mean":
        w = w / counts.clamp_min(1)[ids].reshape(w.shape)
    if divisor is not None:
        return w, divisor
    constant = mask.shape[-1] if preset == "sequence_sum_constant" else 1
    return w, (counts > 0).sum().clamp_min(1) * constant
