"""The sampler's kept set in plain PyTorch (docs/consistency.md): the float64 ground truth of the ops' ``top_k``,
``top_p`` and ``min_p``, written again from the definition (sorts and cumulative sums), sharing nothing with the
C++ selection."""
from __future__ import annotations

import torch


def _per_row(value, n: int, dtype) -> torch.Tensor | None:
    if value is None:
        return None
    t = torch.as_tensor(value).to(dtype).reshape(-1).cpu()
    return t.expand(n) if t.numel() == 1 else t


def kept(x: torch.Tensor, target: torch.Tensor, *, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """(..., V) bool: the tokens a sampler keeps from the (scaled) logits x, in vLLM's order: min_p (p_j >= min_p ·
    p_max), top_k (the k largest; a tie with the k-th kept), then top_p over the tokens left (sorted ascending, those
    whose cumulative probability is <= 1 − top_p removed, the most probable always kept; a tie at the edge kept
    whole). Every token at least as probable as the label is kept too (the label's own token included)."""
    shape = x.shape
    x = x.detach().reshape(-1, shape[-1]).double()
    labels = target.reshape(-1)
    n, v = x.shape
    ks, ps, mps = _per_row(top_k, n, torch.int64), _per_row(top_p, n, torch.float64), _per_row(min_p, n, torch.float64)
    keep = torch.ones_like(x, dtype=torch.bool)
    for r in range(n):
        row = x[r]
        if torch.isnan(row).any():
            continue
        k_row = keep[r]
        if mps is not None and mps[r] > 0:
            prob = torch.softmax(row, -1)
            k_row &= prob >= mps[r] * prob.max()
        if ks is not None and 0 < ks[r] < v and int(k_row.sum()) > ks[r]:
            kth = torch.sort(row[k_row], descending=True).values[int(ks[r]) - 1]
            k_row &= row >= kth
        if ps is not None and ps[r] < 1:
            prob = torch.softmax(row.masked_fill(~k_row, float("-inf")), -1)
            # The probability strictly above each token's value: a tie group shares its first member's.
            values, order = torch.sort(row, descending=True)
            before = torch.cumsum(prob[order], 0) - prob[order]
            group = torch.unique_consecutive(values, return_inverse=True)[1]
            first = torch.full((int(group.max()) + 1,), float("inf"), dtype=torch.float64, device=row.device)
            first = first.scatter_reduce(0, group, before, "amin")
            above = torch.empty_like(row)
            above[order] = first[group]
            k_row &= above < ps[r]
        if labels[r] >= 0:
            k_row |= row >= row[labels[r]]
    return keep.reshape(shape)


def filtered(x: torch.Tensor, target: torch.Tensor, **sampler) -> torch.Tensor:
    """x with −inf outside the kept set (differentiable: the gradient flows through the kept tokens only)."""
    if all(value is None for value in sampler.values()):
        return x
    return x.masked_fill(~kept(x, target, **sampler), float("-inf"))
