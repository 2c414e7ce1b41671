"""Tests of topk_distillation's reverse KL and JSD (docs/distillation_dpo.md): loss, per-token results and the
student's gradient against the float64 reference (rl_losses.reference_topk) for every tail mode, logits dtype and
shape; K = V against the full-teacher op (distillation_loss), an independent implementation; JSD's β = 0 and 1;
gradcheck; the fused lm_head; torch.compile with JSD's statistics pass. TRL's sparse divergences:
tests/test_trl_distillation.py."""
import math

import pytest
import torch

import rl_losses
import test_topk_distillation as base
from rl_losses import reference_topk

from conftest import assert_close
from helpers import DTYPES, assert_compiled_matches_eager, gradcheck_fresh, param_id as _id

TAILS = base.TAILS
# (kind, beta): the reverse KL, and JSD at a β inside (0, 1) either side of 1/2.
KINDS = [("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.8)]
_KIND_IDS = [f"{k}-{b}" for k, b in KINDS]
_ops = torch.ops.rl_losses


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab,k", [(7, 1), (7, 3), (7, 6), (769, 1), (769, 20), (769, 768), (1000, 256)])
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=_KIND_IDS)
def test_matches_reference(kind, beta, tail, vocab, k, dtype, device):
    logits, target, ids, lp = base.make_inputs((5, 3), vocab, k, dtype, device)
    # The reverse KL at K = V - 1 with the tail: the one remaining token's mass 1 - Q = -expm1(G - lse) carries the
    # rounding of the fp32 lse and G relative to its own size, which log(1 - Q) hands to every id's gradient.
    scale = 4.0 if kind == "reverse_kl" and tail == "tail" and k == vocab - 1 else 1.0
    base.check(logits, target, ids, lp, -1.3, scale=scale, tail=tail, kind=kind, beta=beta, logits_scale_factor=0.8)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=_KIND_IDS)
def test_float64_is_exact(kind, beta, tail, device):
    logits, target, ids, lp = base.make_inputs((4, 5), 65, 9, torch.float64, device)
    base.check(logits, target, ids, lp.double(), 0.7, tail=tail, kind=kind, beta=beta, logits_scale_factor=1.5,
               divisor=3.0)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=_KIND_IDS)
def test_large_vocab(kind, beta, tail, device):
    logits, target, ids, lp = base.make_inputs((3,), 50257, 64, torch.bfloat16, device)
    base.check(logits, target, ids, lp, tail=tail, kind=kind, beta=beta, scale=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize("tail", ["none", "renormalize"])
@pytest.mark.parametrize("kind,beta", KINDS + [("jsd", 0.0), ("jsd", 1.0), ("forward_kl", 0.5)],
                         ids=_KIND_IDS + ["jsd-0", "jsd-1", "forward_kl"])
def test_whole_vocabulary_is_the_full_teacher_op(kind, beta, tail, dtype, device):
    """K = V: "none" and "renormalize" are the divergence between the whole distributions, which distillation_loss
    computes from the teacher's logits by its own passes (the tail's 1 − Q is 0 there: not a case)."""
    vocab = 41
    logits, target, ids, lp = base.make_inputs((3, 4), vocab, vocab, dtype, device)
    lp = torch.log_softmax(lp.double(), -1)  # P = 1 to float64's precision, as the full op's softmax makes it
    teacher = torch.full(logits.shape, float("nan"), dtype=torch.float64, device=device)
    teacher.scatter_(-1, ids, lp.double())  # the teacher's log-probs, in vocabulary order
    out, grad = base.run_op(logits, target, ids, lp, 0.9, tail=tail, kind=kind, beta=beta, logits_scale_factor=1.1)
    x = logits.detach().clone().requires_grad_()
    full = rl_losses.distillation_loss(x, teacher.to(dtype), kind=kind, beta=beta, logits_scale_factor=1.1,
                                       loss_mask=target >= 0)
    (full.loss * 0.9).backward()
    keep = target >= 0
    assert_close(out.divergence, torch.where(keep, full.divergence, 0), dtype, scale=4.0, msg="divergence")
    assert_close(out.loss, full.loss, dtype, scale=4.0, msg="loss")
    assert_close(grad, x.grad, dtype, scale=4.0, msg="grad")


@pytest.mark.parametrize("tail", TAILS)
def test_jsd_at_beta_0_and_1_is_the_kl(tail, device):
    """distillation's convention: JSD at β = 0 is the forward KL, at β = 1 the reverse KL (same values)."""
    logits, target, ids, lp = base.make_inputs((6,), 50, 7, torch.float32, device)
    for beta, kl in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        out, grad = base.run_op(logits, target, ids, lp, tail=tail, kind="jsd", beta=beta)
        ref, ref_grad = base.run_op(logits, target, ids, lp, tail=tail, kind=kl)
        torch.testing.assert_close(out.divergence, ref.divergence, rtol=0, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=_KIND_IDS)
def test_gradcheck(kind, beta, tail, device):
    logits, target, ids, lp = base.make_inputs((3,), 6, 3, torch.float64, device, unlabelled=0.0)
    gradcheck_fresh(lambda x: rl_losses.topk_distillation_loss(x, target, ids, lp, tail=tail, kind=kind, beta=beta,
                                                               logits_scale_factor=1.2).loss,
                    logits.clone().requires_grad_())


@pytest.mark.parametrize("kind,beta", KINDS, ids=_KIND_IDS)
def test_ragged_inplace_and_float16(kind, beta, device):
    """Unlabelled rows (their teacher entries not read), inplace_backward, and fp16's pre-scaled gradient rows (a
    large divisor, then a loss scale's upstream gradient)."""
    logits, target, ids, lp = base.make_inputs((6, 4), 129, 8, torch.float32, device, unlabelled=0.7)
    ids[target < 0] = -5
    lp[target < 0] = float("nan")
    for tail in TAILS:
        base.check(logits, target, ids, lp, tail=tail, kind=kind, beta=beta)
    logits, target, ids, lp = base.make_inputs((4, 6), 129, 16, torch.float16, device)
    for tail in TAILS:
        out, grad = base.run_op(logits, target, ids, lp, tail=tail, kind=kind, beta=beta)
        x = logits.clone().requires_grad_()
        y = x * 1.0  # a non-leaf whose storage may be overwritten
        inplace = rl_losses.topk_distillation_loss(y, target, ids, lp, tail=tail, kind=kind, beta=beta,
                                                   inplace_backward=True)
        (inplace.loss * 1.0).backward()
        torch.testing.assert_close(inplace.loss, out.loss)
        torch.testing.assert_close(x.grad, grad)
        base.check(logits, target, ids, lp, 1e4, tail=tail, kind=kind, beta=beta, divisor=1e6)


# ---- the fused lm_head ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy,chunk_size", [("fast", None), ("fast", 4), ("lean", 4)])
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind,beta", KINDS, ids=_KIND_IDS)
def test_linear_matches_reference(kind, beta, tail, strategy, chunk_size, device):
    hidden = torch.randn(3, 5, 16, device=device, dtype=torch.float64)
    weight = torch.randn(97, 16, device=device, dtype=torch.float64) * 0.5
    _, target, ids, lp = base.make_inputs((3, 5), 97, 11, torch.float64, device)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    options = dict(tail=tail, kind=kind, beta=beta, logits_scale_factor=0.9)
    out = rl_losses.linear_topk_distillation_loss(h, w, target, ids, lp, strategy=strategy, chunk_size=chunk_size,
                                                  skip_unlabelled=chunk_size is not None, **options)
    (out.loss * 1.4).backward()
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference_topk.topk_distillation_loss(hr @ wr.t(), target, ids, lp.double(), **options)
    (ref.loss * 1.4).backward()
    for name in ("loss", "divergence", "student_mass", "teacher_mass"):
        assert_close(getattr(out, name).detach(), getattr(ref, name).detach(), torch.float64, msg=name)
    assert_close(h.grad, hr.grad, torch.float64, msg="grad_hidden")
    assert_close(w.grad, wr.grad, torch.float64, msg="grad_weight")


# ---- the op's registration (opcheck of every kind: test_topk_distillation.py) --------------------------------------
def test_compile_fullgraph(device):
    logits, target, ids, lp = base.make_inputs((4, 3), 70, 7, torch.float32, device)

    def fn(x, t, i, p):
        out = rl_losses.topk_distillation_loss(x, t, i, p, tail="tail", kind="jsd", beta=0.25)
        return out.loss, out.divergence, out.student_mass

    assert_compiled_matches_eager(fn, logits, target, ids, lp, backend="aot_eager")


def test_reverse_kl_is_infinite_where_the_teacher_gives_an_id_no_mass(device):
    """Σ q log(q/p) with p_i = 0 at an id the student gives mass: +inf, as the reference (and the full op)."""
    logits, target, ids, lp = base.make_inputs((3,), 20, 4, torch.float64, device, unlabelled=0.0)
    lp[1, 2] = -math.inf
    out = rl_losses.topk_distillation_loss(logits, target, ids, lp, kind="reverse_kl")
    ref = reference_topk.topk_distillation_loss(logits, target, ids, lp, kind="reverse_kl")
    assert out.divergence[1] == math.inf == ref.divergence[1]
    torch.testing.assert_close(out.divergence[[0, 2]], ref.divergence[[0, 2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5)] + KINDS, ids=["forward_kl"] + _KIND_IDS)
def test_tail_floored_as_trl(kind, beta, dtype, device):
    """tail="tail" where the teacher's log-probs round to P >= 1 (a confident token's log-prob 0.0) and the
    student's ids hold all but < 1e-7 of its mass: each side's remaining mass is floored at 1 - e^{-1e-7}, as TRL's
    add_tail_bucket clamps it; finite, and equal to the reference (whose clamp stops the student's gradient there).
    Rows 0-3 floored on both sides, rows 4-7 on the teacher's only, the others on neither."""
    n, vocab, k = 12, 50, 4
    logits, target, ids, lp = base.make_inputs((n,), vocab, k, dtype, device, unlabelled=0.0)
    ids = torch.stack([torch.randperm(vocab, device=device)[:k] for _ in range(n)])
    logits = logits.double()
    logits[:4].scatter_add_(-1, ids[:4], torch.full((4, k), 40.0, dtype=torch.float64, device=device))
    confident = torch.full((8, k), -40.0, dtype=torch.float64, device=device)
    confident[:, 0] = 0.0  # P = 1 + 3 e^{-40} >= 1
    lp = torch.cat([confident, torch.log_softmax(torch.randn(n - 8, k, device=device, dtype=torch.float64), -1) - 1.0])
    logits, lp = logits.to(dtype), lp.float()
    out, grad = base.run_op(logits, target, ids, lp, tail="tail", kind=kind, beta=beta)
    assert torch.isfinite(out.divergence).all() and torch.isfinite(grad).all()
    base.check(logits, target, ids, lp, tail="tail", kind=kind, beta=beta)

