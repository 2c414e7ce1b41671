"""Log-probs under the distribution an inference engine sampled from, given as the token ids it kept per position
(docs/consistency.md): where the engine returns its kept set (top-k / top-p / min-p applied to its own logits)
rather than the filter's parameters, the trainer renormalises over exactly those ids, so that a token near the
filter's edge is not kept or dropped by the trainer's slightly different logits.

The work is K-wide (K kept ids per position): the kept logits are gathered, their log-sum-exp taken in float32
(float64 for float64 logits), and the gradient is scattered back to those ids alone. Nothing V-wide is read or
computed besides the gradient's zeros, so this is a composition of ATen ops rather than a row pass: it is
differentiable with any upstream gradients, and composes with the per-token policy loss
(``rl_losses.policy_token_loss``) for the policy-gradient terms.
"""
from __future__ import annotations

import torch

from rl_losses._inputs import _check_inputs_enabled

__all__ = ["kept_token_log_probs"]


def _check(name: str, logits: torch.Tensor, labels: torch.Tensor, kept_ids: torch.Tensor, temperature: float) -> None:
    if not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(f"{name}: logits must be a floating-point (..., V) tensor, got {logits.dtype} of shape "
                         f"{tuple(logits.shape)}")
    if labels.dtype not in (torch.int32, torch.int64) or kept_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: labels and kept_ids must be int32 or int64, got {labels.dtype} and {kept_ids.dtype}")
    if labels.shape != logits.shape[:-1] or kept_ids.shape[:-1] != logits.shape[:-1] or kept_ids.dim() < 1:
        raise ValueError(f"{name}: labels must have the logits' leading shape {tuple(logits.shape[:-1])} and kept_ids "
                         f"that shape and one more dimension (..., K), got labels {tuple(labels.shape)} and kept_ids "
                         f"{tuple(kept_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    if logits.is_cuda and not _check_inputs_enabled():
        return  # the value checks below read the tensors on the host: opt-in on a GPU (RL_LOSSES_CHECK_INPUTS=1)
    vocab = logits.shape[-1]
    if kept_ids.numel() and (int(kept_ids.min()) < -1 or int(kept_ids.max()) >= vocab):
        raise ValueError(f"{name}: kept_ids must lie in [0, {vocab}) or be -1 (padding), got values in "
                         f"[{int(kept_ids.min())}, {int(kept_ids.max())}]")
    if labels.numel() and int(labels.max()) >= vocab:
        raise ValueError(f"{name}: labels must be < the vocabulary size {vocab}, got {int(labels.max())}")
    ordered = kept_ids.sort(-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if repeated.any():
        position = tuple(int(i) for i in repeated.any(-1).nonzero()[0])
        raise ValueError(f"{name}: kept_ids lists a token more than once at position {position}")


def kept_token_log_probs(logits: torch.Tensor, labels: torch.Tensor, kept_ids: torch.Tensor, *,
                         temperature: float = 1.0,
                         compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_probs[t] = x_t[label] − log Σ_{j ∈ S_t} exp(x_t[j])`` with x = logits / T and S_t the ids kept at
    position t (``kept_ids[t]``, −1 entries being padding) together with the label itself (as the ops' ``top_k`` /
    ``top_p`` keep the label's token); ``entropy[t]`` the entropy of that renormalised distribution. The gradient
    flows to the kept ids only.

    Args:
        logits: (..., V) float32/bfloat16/float16/float64.
        labels: (...) int64/int32 label ids; a negative id means "no label": its log-prob is 0 (no gradient), its
            entropy is still that of S_t.
        kept_ids: (..., K) int64/int32, the engine's kept token ids per position in any order, −1 = padding; each
            id at most once per position (checked on the CPU, and on a GPU with RL_LOSSES_CHECK_INPUTS=1).
        temperature: T > 0 (the engine's).
        compute_entropy: also return the entropy per position.
    Returns: (log_probs, entropy or None), each shaped like ``labels``, float32 (float64 for float64 logits).
    """
    _check("kept_token_log_probs", logits, labels, kept_ids, temperature)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    labelled = labels >= 0
    label = labels.clamp_min(0).long().unsqueeze(-1)
    kept_ids = kept_ids.long()
    listed = (kept_ids == label).any(-1, keepdim=True)
    # The label joins the set where it is labelled and not already listed; padding takes a real id (0) whose
    # entries are then masked out.
    ids = torch.cat([kept_ids, label], -1)
    valid = torch.cat([kept_ids >= 0, labelled.unsqueeze(-1) & ~listed], -1)
    x = logits.gather(-1, ids.clamp_min(0)).to(acc) / temperature
    x = x.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(x, -1)
    picked = logits.gather(-1, label).squeeze(-1).to(acc) / temperature
    log_probs = torch.where(labelled, picked - lse, torch.zeros((), dtype=acc, device=logits.device))
    if not compute_entropy:
        return log_probs, None
    # Outside the set log p is taken as 0 before the product (p = 0 there): −inf · 0 would be NaN, and its gradient
    # would reach the set's log-sum-exp.
    log_p = torch.where(valid, x - lse.unsqueeze(-1), torch.zeros((), dtype=acc, device=logits.device))
    entropy = -(torch.where(valid, log_p.exp(), torch.zeros((), dtype=acc, device=logits.device)) * log_p).sum(-1)
    return log_probs, entropy
