"""Log-probs under the distribution an inference engine sampled from, given as the token ids it kept per position
(docs/consistency.md): where the engine returns its kept set (top-k / top-p / min-p applied to its own logits)
rather than the filter's parameters, the trainer renormalises over exactly those ids, so that a token near the
filter's edge is not kept or dropped by the trainer's slightly different logits.

The work is K-wide (K kept ids per position): the kept logits are gathered, their log-sum-exp taken in float32
(float64 for float64 logits), and the gradient is scattered back to those ids alone. Nothing V-wide is read or
computed besides the gradient's zeros, so this is a composition of ATen ops rather than a row pass: it is
differentiable with any upstream gradients, and composes with the per-token policy loss
(``rl_losses.policy_token_loss``) for the policy-gradient terms.

From hidden states (``linear_kept_token_log_probs``) only the logits of the ids some position keeps are computed:
the union U of the kept ids and the labels is gathered from the lm_head's weight once, and each chunk of rows
multiplies by those |U| rows, so the work and memory scale with |U| rather than the vocabulary.
"""
from __future__ import annotations

import torch

from rl_losses._inputs import _check_inputs_enabled

__all__ = ["kept_token_log_probs", "linear_kept_token_log_probs"]


def _check(name: str, source: str, x: torch.Tensor, vocab: int, labels: torch.Tensor, kept_ids: torch.Tensor,
           temperature: float, read_values: bool = False) -> None:
    """x: the logits (..., V) or the hidden states (..., H) whose leading shape labels and kept_ids follow;
    read_values: check the ids' values on a GPU too (where the caller synchronises anyway)."""
    last, whose = ("V", "logits'") if source == "logits" else ("H", "hidden states'")
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"{name}: {source} must be a floating-point (..., {last}) tensor, got {x.dtype} of shape "
                         f"{tuple(x.shape)}")
    if labels.dtype not in (torch.int32, torch.int64) or kept_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: labels and kept_ids must be int32 or int64, got {labels.dtype} and {kept_ids.dtype}")
    if labels.shape != x.shape[:-1] or kept_ids.shape[:-1] != x.shape[:-1] or kept_ids.dim() < 1:
        raise ValueError(f"{name}: labels must have the {whose} leading shape {tuple(x.shape[:-1])} and kept_ids "
                         f"that shape and one more dimension (..., K), got labels {tuple(labels.shape)} and kept_ids "
                         f"{tuple(kept_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    if x.is_cuda and not read_values and not _check_inputs_enabled():
        return  # the value checks below read the tensors on the host: opt-in on a GPU (RL_LOSSES_CHECK_INPUTS=1)
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
    _check("kept_token_log_probs", "logits", logits, logits.shape[-1], labels, kept_ids, temperature)
    return _kept_log_probs(logits, labels, kept_ids, temperature, compute_entropy)


def _kept_log_probs(logits: torch.Tensor, labels: torch.Tensor, kept_ids: torch.Tensor, temperature: float,
                    compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    labelled = labels >= 0
    label = labels.clamp_min(0).long().unsqueeze(-1)
    kept_ids = kept_ids.long()
    is_label = kept_ids == label
    listed = is_label.any(-1, keepdim=True)
    # The label joins the set where it is labelled and not already listed; padding takes a real id (0) whose
    # entries are then masked out.
    ids = torch.cat([kept_ids, label], -1)
    valid = torch.cat([kept_ids >= 0, labelled.unsqueeze(-1) & ~listed], -1)
    x = logits.gather(-1, ids.clamp_min(0)).to(acc) / temperature
    # The label's value is read from x, at its listed column where listed: its gradient then sums with the
    # log-sum-exp's in `acc` on one column, not rounded apart into two that cancel in the logits' dtype.
    picked = x.gather(-1, torch.where(listed, is_label.int().argmax(-1, keepdim=True), kept_ids.shape[-1])).squeeze(-1)
    x = x.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(x, -1)
    log_probs = torch.where(labelled, picked - lse, torch.zeros((), dtype=acc, device=logits.device))
    if not compute_entropy:
        return log_probs, None
    # Outside the set log p is taken as 0 before the product (p = 0 there): −inf · 0 would be NaN, and its gradient
    # would reach the set's log-sum-exp.
    log_p = torch.where(valid, x - lse.unsqueeze(-1), torch.zeros((), dtype=acc, device=logits.device))
    entropy = -(torch.where(valid, log_p.exp(), torch.zeros((), dtype=acc, device=logits.device)) * log_p).sum(-1)
    return log_probs, entropy


# Rows per chunk of linear_kept_token_log_probs: a chunk's logits over the union hold at most this many values.
_CHUNK_VALUES = 1 << 24


def linear_kept_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                kept_ids: torch.Tensor, *, bias: torch.Tensor | None = None, temperature: float = 1.0,
                                compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kept_token_log_probs`` of ``hidden @ weight.T (+ bias)``, computing only the logits of the ids kept somewhere
    in the batch (the union U of ``kept_ids`` and ``labels``): U's rows of ``weight`` are gathered once and each
    chunk of positions multiplies by them, so no (..., V) tensor is made, and the work is that of a (N, H) x (H, |U|)
    GEMM. The union is found on the host (``torch.unique``: one synchronisation, so not for CUDA-graph capture).

    Args:
        hidden: (..., H) float32/bfloat16/float16/float64; weight: (V, H) the lm_head's, same dtype; bias: (V,) or None.
        labels, kept_ids, temperature, compute_entropy: as ``kept_token_log_probs``, ids in [0, V).
    Returns: (log_probs, entropy or None), each shaped like ``labels``; differentiable w.r.t. hidden, weight, bias.
    """
    name = "linear_kept_token_log_probs"
    # The ids are read on the host in any case (the union), so they are checked there on a GPU too: an id out of
    # range would otherwise reach index_select.
    _check(name, "hidden", hidden, weight.shape[0] if weight.dim() else 0, labels, kept_ids, temperature,
           read_values=True)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(f"{name}: weight must be (V, {hidden.shape[-1]}) in the hidden states' dtype {hidden.dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != hidden.dtype):
        raise ValueError(f"{name}: bias must be ({weight.shape[0]},) in {hidden.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    ids = torch.cat([kept_ids.reshape(-1), labels.reshape(-1)]).long()
    union = torch.unique(ids[ids >= 0])  # sorted
    if not union.numel():  # nothing kept, nothing labelled: padding still gathers a column (masked out)
        union = ids.new_zeros(1)
    # Each id's place in the union; -1 padding and negative labels keep their sign (padding, "no label").
    kept_u = torch.where(kept_ids >= 0, torch.searchsorted(union, kept_ids.long().clamp_min(0)), -1)
    labels_u = torch.where(labels >= 0, torch.searchsorted(union, labels.long().clamp_min(0)), labels.long())
    w_u = weight.index_select(0, union)
    b_u = None if bias is None else bias.index_select(0, union)
    rows = hidden.reshape(-1, hidden.shape[-1])
    chunk = max(1, _CHUNK_VALUES // max(1, union.numel()))
    log_probs, entropies = [], []
    for h, lab, kept in zip(rows.split(chunk), labels_u.reshape(-1).split(chunk),
                            kept_u.reshape(-1, kept_u.shape[-1]).split(chunk)):
        logits = h @ w_u.t() if b_u is None else torch.addmm(b_u, h, w_u.t())
        lp, entropy = _kept_log_probs(logits, lab, kept, temperature, compute_entropy)
        log_probs.append(lp)
        entropies.append(entropy)
    log_probs = torch.cat(log_probs).reshape(labels.shape)
    return log_probs, torch.cat(entropies).reshape(labels.shape) if compute_entropy else None
