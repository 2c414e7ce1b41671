"""Log-probs under the distribution an inference engine sampled from, given as the token ids it kept per position
(docs/consistency.md): where the engine returns its kept set (top-k / top-p / min-p applied to its own logits)
rather than the filter's parameters, the trainer renormalises over exactly those ids, so that a token near the
filter's edge is not kept or dropped by the trainer's slightly different logits.

The work is K-wide (K kept ids per position): the kept logits are gathered, their log_softmax taken in float32
(float64 for float64 logits), and the gradient is scattered back to those ids alone. Nothing V-wide is read or
computed besides the gradient, so this is a composition of ATen ops rather than a row pass, each a pass over N x K
values (a kernel on a GPU): the forward makes the fewest of them, and an autograd.Function's backward computes the
K-wide gradient from the saved probabilities in one or two passes and writes the dense one in one pass over its
rows (the library's ``_scatter_rows``: zeros and the K + 1 values at their ids). It is differentiable with any
upstream gradients, and composes with the per-token policy loss (``rl_losses.policy_token_loss``) for the
policy-gradient terms.

From hidden states (``linear_kept_token_log_probs``) only the logits of the ids some position keeps are computed:
the union U of the kept ids and the labels is gathered from the lm_head's weight once, and each chunk of rows
multiplies by those |U| rows, so the work and memory scale with |U| rather than the vocabulary.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rl_losses._inputs import _check_inputs_enabled, _direct

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
    if torch.compiler.is_compiling():
        return  # nor inside a compiled graph, as the ops' label checks (a host read would end the graph)
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
    if torch.is_grad_enabled() and logits.requires_grad:
        return _KeptLogProbs.apply(logits, labels, kept_ids, temperature, compute_entropy)
    log_probs, entropy, _ = _kept_forward(logits, labels, kept_ids, temperature, compute_entropy, False)
    return log_probs, entropy


def _kept_forward(logits: torch.Tensor, labels: torch.Tensor, kept_ids: torch.Tensor, temperature: float,
                  compute_entropy: bool, for_backward: bool):
    """The K-wide passes: one clamp of the ids, two comparisons and their or, one `all` (positions with nothing in
    their set), one gather, its masking, one conversion with the temperature, one log_softmax; exp for the backward,
    entr and a sum for the entropy. Returns (log_probs, entropy or None, what the backward needs or None)."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    k = kept_ids.shape[-1]
    unlabelled = labels < 0
    # Columns 0..K-1 are the listed ids, column K the label: a listed label is masked at its own column, so that it
    # counts once, its log-prob is column K's at every position, and its gradient is formed in `acc` on one column
    # (two columns scattered onto one id would each be rounded to the logits' dtype first). Padding (-1) gathers
    # id 0 and is masked.
    # (.long(): clamp does not convert into its output.)
    ids = _with_column(lambda out: torch.clamp(kept_ids.long(), min=0, out=out), kept_ids, torch.int64)
    ids[..., k] = labels.clamp_min(0)
    masked = _with_column(lambda out: torch.logical_or(kept_ids < 0, kept_ids == labels.unsqueeze(-1), out=out),
                          kept_ids, torch.bool)
    # A position with no listed id and no label keeps column K, set to 0: a set of one token (log-prob and entropy 0,
    # no gradient) rather than an empty set, whose log_softmax would be NaN.
    empty = masked[..., :k].all(-1).logical_and_(unlabelled)
    masked[..., k] = unlabelled ^ empty
    # Masked in the logits' dtype (-inf is exact in each), then converted and divided by T in one op: a GPU kernel
    # reads the one dtype and writes the other (`where` into `acc` would convert first, a pass of its own).
    x = logits.gather(-1, ids).masked_fill_(masked, float("-inf"))
    x[..., k].masked_fill_(empty, 0.0)
    x = x.to(acc) if temperature == 1.0 else torch.div(x, torch.full((1,), temperature, dtype=acc, device=x.device))
    log_p = torch.log_softmax(x, -1)
    log_probs = torch.where(unlabelled, 0.0, log_p[..., k])
    if not (compute_entropy or for_backward):
        return log_probs, None, None
    p = log_p.exp()
    # entr(p) = -p log p, 0 where p = 0 (masked columns, whose log p is -inf).
    neg_plogp = torch.special.entr(p) if compute_entropy else None
    entropy = neg_plogp.sum(-1) if compute_entropy else None
    return log_probs, entropy, (ids, unlabelled, p, neg_plogp, entropy) if for_backward else None


def _kept_backward(ids: torch.Tensor, unlabelled: torch.Tensor, p: torch.Tensor, neg_plogp: torch.Tensor | None,
                   entropy: torch.Tensor | None, g_lp: torch.Tensor | None, g_h: torch.Tensor | None,
                   temperature: float, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """d/dx_j of g_lp·log p_K + g_h·H over the columns (x = logits / T, column K the label):
    g_lp·([j = K] − p_j) + g_h·(e_j − p_j·H) with e_j = −p_j log p_j; divided by T, rounded once to the logits'
    dtype and scattered to the ids. Masked columns have p_j = e_j = 0, hence a zero that the scatter adds exactly:
    padding and a masked listed label never change a real id's gradient."""
    k = ids.shape[-1] - 1
    a = torch.zeros_like(p[..., k]) if g_lp is None else torch.where(unlabelled, 0.0, g_lp)
    if temperature != 1.0:
        a = a / temperature
    g = torch.empty(ids.shape, dtype=dtype, device=ids.device)
    if g_h is None:
        c = -a
        torch.mul(p, c.unsqueeze(-1), out=g)  # computed in `acc`, rounded once to the logits' dtype
        g[..., k] = torch.addcmul(a, p[..., k], c)
    else:
        b = g_h / temperature if temperature != 1.0 else g_h
        c = torch.addcmul(a, b, entropy).neg_()
        base = neg_plogp * b.unsqueeze(-1)
        base[..., k] += a
        torch.addcmul(base, p, c.unsqueeze(-1), out=g)
    # One pass over the dense rows (csrc/kept_set/): zeros and the columns' values at their ids. An id repeats within
    # a row only where all but one copy is masked (padding's 0, a listed label), and the op leaves zeros out, so the
    # masked copies' exact zeros never race the real entry's value (the order of duplicate stores is unspecified on
    # a GPU): the result of zeros.scatter_add_(-1, ids, g), without a separate fill and atomic adds.
    return _direct(torch.ops.rl_losses._scatter_rows)(ids, g, shape[-1])


def _with_column(kept_part, kept_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (..., K + 1) tensor whose first K columns are kept_part(out), column K left for the caller. Eager, kept_part
    writes into the first columns of one buffer (`out=`), sparing the pass over the K columns that a cat makes;
    torch.compile refuses a non-contiguous `out=` and fuses a cat, so it gets the cat."""
    if torch.compiler.is_compiling():
        part = kept_part(None)
        return torch.cat([part, part.new_empty((*part.shape[:-1], 1))], -1)
    out = torch.empty((*kept_ids.shape[:-1], kept_ids.shape[-1] + 1), dtype=dtype, device=kept_ids.device)
    kept_part(out[..., :-1])
    return out


class _KeptLogProbs(torch.autograd.Function):
    """The kept-set log-probs (and entropies) with a backward that writes the dense gradient once (_scatter_rows: the
    K + 1 columns' gradient at their ids, zeros elsewhere), computed from the saved probabilities in one K-wide pass
    (two with the entropy's gradient). The grads of unused outputs stay None, so a backward through the log-probs alone
    skips the entropy's terms."""

    @staticmethod
    def forward(ctx, logits, labels, kept_ids, temperature, compute_entropy):
        log_probs, entropy, saved = _kept_forward(logits, labels, kept_ids, temperature, compute_entropy, True)
        ctx.save_for_backward(*saved)
        ctx.temperature, ctx.dtype, ctx.shape = temperature, logits.dtype, logits.shape
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    @once_differentiable  # the gradient is formed from saved, detached probabilities: no second derivative
    def backward(ctx, g_lp, g_h):
        if g_lp is None and g_h is None:
            return None, None, None, None, None
        grad = _kept_backward(*ctx.saved_tensors, g_lp, g_h, ctx.temperature, ctx.dtype, ctx.shape)
        return grad, None, None, None, None


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
