"""min_p's floor computed in the CUDA cluster kernel (common/cuda/cluster_sampler.cuh): a fused pass (gradient in
the forward) where min_p is the only filter (per row or one value), over rows that a thread-block cluster holds
(16-byte aligned rows), against the float64 reference, and against the split pass (the selection kernel's floor,
then one block per row: what the batch-invariant mode runs) for the exact kept sets; beside it, the same rows with
top_k / top_p as well (the selection kernel and the split pass). Row counts that leave a last, part-empty round
(the tail launch), labels below the floor and unlabelled rows."""
import pytest
import torch

import rl_losses
from rl_losses import reference
from rl_losses.reference_sampler import kept

from conftest import assert_close
from helpers import assert_grad_close, param_id, requires_cuda

pytestmark = requires_cuda
INF = float("inf")

# (rows, vocabulary): 1 CTA per bf16 row (2 per fp32 row) with a tail of ~60 rows after 2 rounds of an H100/H200's
# resident clusters; 4 CTAs per bf16 row (8 per fp32 row) with a tail past one round.
SHAPES = [(850, 32000), (150, 128256)]


def _options(n, kind, gen):
    k = torch.randint(1, 2000, (n,), generator=gen)
    p = torch.rand(n, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    m = torch.rand(n, generator=gen, dtype=torch.float64) * 0.2
    m[::7] = 0.0  # rows min_p leaves whole
    return {"min_p": dict(min_p=m), "min_p_k": dict(min_p=m, top_k=k), "min_p_p": dict(min_p=m, top_p=p),
            "k": dict(top_k=k), "p": dict(top_p=p), "all": dict(top_k=k, top_p=p, min_p=m)}[kind]


def _moved(o, f):
    out = dict(o)
    if "top_p" in o:
        out["top_p"] = (o["top_p"] * f).clamp(max=1.0)
    if "min_p" in o:
        out["min_p"] = o["min_p"] * f
    return out


def _inputs(dtype, n, vocab, kind, per_row, seed=0):
    """Logits (the float64 values of `dtype`), options and labels: rows whose kept sets do not move when top_p and
    min_p move by 0.01% (the GPU's exponential is not the reference's, and top_p's fixed-point masses lose up to 2^-24
    of the max's per token), their logits and options redrawn row by row until so; a row where one
    token holds the mass, labels drawn from the kept sets but a few below the floor, a few unlabelled. The logits and
    labels are on the GPU, where the reference runs too (float64)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype).double().cuda()
    x[0, 3] = 60.0
    o = _options(n, kind, gen)
    if not per_row:
        o = {name: value[1:2].clone() for name, value in o.items()}  # one value (row 1's: not a min_p of 0)
    unlabelled = torch.full((n,), -1, device="cuda")
    for _ in range(50):
        keep = kept(x, unlabelled, **o)
        edge = torch.zeros(n, dtype=torch.bool, device="cuda")
        for f in (1 - 1e-4, 1 + 1e-4):
            edge |= (kept(x, unlabelled, **_moved(o, f)) != keep).any(-1)
        if not edge.any():
            break
        rows = edge.nonzero().squeeze(1).cuda()
        x[rows] = (torch.randn(len(rows), vocab, generator=gen, dtype=torch.float64) * 2).to(dtype).double().cuda()
        if per_row:
            for name, value in _options(n, kind, gen).items():
                o[name][rows.cpu()] = value[rows.cpu()]
    else:
        raise AssertionError("no rows clear of the edges were drawn")
    if not per_row:
        o = {name: value.reshape(()) for name, value in o.items()}
    target = torch.multinomial(x.masked_fill(~keep, -INF).softmax(-1), 1).squeeze(1)
    for r in (2, 9, 40):  # outside the kept set where there is one: the floor is lowered to the label's logit
        target[r] = int(torch.where(keep[r], INF, x[r]).argmin())
    target[5] = target[77] = -100
    return x, target, o


def _cuda(options):
    return {name: value.cuda() for name, value in options.items()}


def _grpo_args(n):
    g = torch.Generator().manual_seed(n)
    adv = torch.randn(n, generator=g, dtype=torch.float64).cuda()
    old = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).cuda()
    return adv, old, dict(epsilon_low=0.2, epsilon_high=0.28, compute_entropy=True, beta=0.0)


def _run(op, x, target, o, dtype):
    logits = x.to(dtype).requires_grad_()
    if op == "grpo":
        adv, old, kw = _grpo_args(target.shape[0])
        out = rl_losses.grpo_loss(logits, target, adv, old, **kw, **_cuda(o))
        out.loss.backward()
        return (out.loss, out.log_probs, out.entropy), logits.grad
    lp, h = rl_losses.token_log_probs(logits, target, compute_entropy=True, **_cuda(o))
    up = torch.linspace(-1, 1, target.shape[0], device="cuda")
    ((lp * up).sum() + (h * up.flip(0)).sum()).backward()
    return (lp, h), logits.grad


def _reference(op, x, target, o):
    ref = x.clone().requires_grad_()
    if op == "grpo":
        adv, old, kw = _grpo_args(target.shape[0])
        out = reference.grpo_loss(ref, target, adv, old, **kw, **o)
        out.loss.backward()
        return (out.loss.detach(), out.log_probs.detach(), out.entropy.detach()), ref.grad
    lp, h = reference.token_log_probs(ref, target, compute_entropy=True, **o)
    up = torch.linspace(-1, 1, target.shape[0], dtype=torch.float64, device="cuda")
    ((lp * up).sum() + (h * up.flip(0)).sum()).backward()
    return (lp.detach(), h.detach()), ref.grad


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("op,kind", [("grpo", k) for k in ["min_p", "min_p_k", "min_p_p", "k", "p", "all"]] +
                         [("token_log_probs", "min_p"), ("token_log_probs", "all")])
def test_cluster_floors_against_the_reference(shape, dtype, kind, op):
    n, vocab = shape
    x, target, o = _inputs(dtype, n, vocab, kind, per_row=True)
    outs, grad = _run(op, x, target, o, dtype)
    ref_outs, ref_grad = _reference(op, x, target, o)
    scale = 10 if dtype == torch.bfloat16 else 1
    for out, ref in zip(outs, ref_outs):
        assert_close(out, ref, dtype, scale=scale)
    assert_grad_close(grad, ref_grad, dtype, scale=3)
    # The kept sets are the reference's (with the labels outside them): the gradient is nonzero exactly there in
    # the rows that keep more than one token and have a label.
    # the rows that keep more than one token, have a label and a gradient (GRPO's clipped rows have none); not row 0,
    # where one token holds the mass and the others' gradients are 0 up to rounding.
    keep = kept(x, target, **o)
    rows = (keep.sum(-1) > 1) & (target >= 0) & (ref_grad != 0).any(-1)
    rows[0] = False
    assert torch.equal((grad != 0)[rows], keep[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "scalar"])
def test_cluster_min_p_equals_the_split_pass(dtype, per_row):
    """The cluster kernel (min_p's floor computed in it) against the batch-invariant mode's split pass (the selection
    kernel's floor, then one block per row): the same tokens kept, the same values to fp32 rounding."""
    n, vocab = SHAPES[0]
    x, target, o = _inputs(dtype, n, vocab, "min_p", per_row=per_row, seed=1)
    outs, grad = _run("grpo", x, target, o, dtype)
    with rl_losses.batch_invariant():
        split_outs, split_grad = _run("grpo", x, target, o, dtype)
    assert torch.equal(grad != 0, split_grad != 0)
    for out, split in zip(outs, split_outs):
        assert_close(out, split, torch.float32)
    assert_grad_close(grad, split_grad.double().cpu(), dtype)


def test_min_p_floor_with_rows_of_nan_and_minus_inf():
    """Rows the floor kernel leaves unfiltered (a NaN in the row, a row of −inf but its label) give what the split
    pass gives: NaN outputs for the NaN row, the same finite outputs elsewhere."""
    n, vocab = SHAPES[0]
    x, target, o = _inputs(torch.bfloat16, n, vocab, "min_p", per_row=True, seed=2)
    x[3, 100] = float("nan")
    x[4] = -INF
    x[4, 0] = 0.0
    target[4] = 0
    outs, grad = _run("token_log_probs", x, target, o, torch.bfloat16)
    with rl_losses.batch_invariant():
        split_outs, split_grad = _run("token_log_probs", x, target, o, torch.bfloat16)
    for out, split in zip(outs, split_outs):
        assert torch.equal(out.isnan(), split.isnan())
        fine = ~out.isnan()
        assert_close(out[fine], split[fine], torch.float32)
    fine = ~grad.isnan().any(-1) & ~split_grad.isnan().any(-1)
    assert torch.equal(grad.isnan(), split_grad.isnan())
    assert torch.equal(grad[fine] != 0, split_grad[fine] != 0)
