"""Hostile inputs: no silent NaN, no silent corruption.

One test per defect class: overflowed ratios on clipped tokens, the upstream gradient's precision, in-place
gradients over overlapping rows, leaves or bad labels, the fake kernels' checks, double backward and the
option checks. Every value is compared with the float64 reference (rl_losses.reference).
"""
import math

import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import (assert_fake_rejects_like_real, assert_grad_close, label_log_probs64, make_logits, make_target,
                     requires_cuda)

ops = torch.ops.rl_losses


def _grpo_ref(x, target, adv, old, **options):
    x64 = x.detach().double().requires_grad_()
    out = reference.grpo_loss(x64, target, adv.double(), old.double(), **options)
    out.loss.backward()
    return out.loss.detach(), x64.grad


# ---- overflowed ratios on clipped or masked tokens: exact zeros, never 0·inf ------------------------------------
@pytest.mark.parametrize("case", ["clip_high", "delta_cap", "zero_advantage", "zero_weight"])
def test_grpo_overflowed_ratio_gives_finite_gradient(case, device):
    n, v = 6, 11
    x = make_logits((n,), v, torch.float32, device)
    target = make_target((n,), v, device, masked=0.0)
    lp = label_log_probs64(x, target).float()
    adv = torch.randn(n, device=device).abs() + 0.5
    shift = torch.zeros(n, device=device)
    shift[0] = 100.0  # r_0 = e^100: beyond fp32 (e^88.7), fine in float64
    options, weights = {}, None
    if case == "delta_cap":
        adv[0] = -1.0  # r > δ: the capped branch, whose gradient is zero
        options = dict(delta=3.0)
    elif case == "zero_advantage":
        adv[0] = 0.0
    elif case == "zero_weight":
        adv[0] = -1.0  # unclipped, but masked by its zero weight
        weights = torch.ones(n, device=device)
        weights[0] = 0.0
        options = dict(loss_weights=weights)
    old = lp - shift
    xg = x.clone().requires_grad_()
    loss = rl_losses.grpo_loss(xg, target, adv, old, **options).loss
    loss.backward()
    ref_loss, ref_grad = _grpo_ref(x, target, adv, old, **options)
    assert torch.isfinite(loss) and torch.isfinite(xg.grad).all()
    assert_close(loss, ref_loss, torch.float32)
    assert_grad_close(xg.grad, ref_grad, torch.float32)
    assert (xg.grad[0] == 0).all()


def test_gspo_overflowed_document_ratio_gives_finite_gradient(device):
    n, v = 8, 9
    x = make_logits((n,), v, torch.float32, device)
    target = make_target((n,), v, device, masked=0.0)
    lp = label_log_probs64(x, target).float()
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2], device=device)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 0.0], device=device)
    old = lp - torch.tensor([100.0, 100.0, 100.0, 0.1, 0.0, 0.0, 100.0, 100.0], device=device)
    xg = x.clone().requires_grad_()
    loss = rl_losses.gspo_loss(xg, target, adv, old, doc, num_documents=3).loss
    loss.backward()
    x64 = x.double().requires_grad_()
    ref = reference.gspo_loss(x64, target, adv.double(), old.double(), doc, num_documents=3).loss
    ref.backward()
    assert torch.isfinite(loss) and torch.isfinite(xg.grad).all()
    assert_close(loss, ref.detach(), torch.float32)
    assert_grad_close(xg.grad, x64.grad, torch.float32)
    assert (xg.grad[:3] == 0).all() and (xg.grad[6:] == 0).all()


# ---- the upstream gradient is applied in fp32, before the one rounding to the logits dtype ----------------------
def test_fp16_gradient_with_loss_scale_stays_finite(device):
    x = make_logits((64,), 16, torch.float16, device, std=1.0).requires_grad_()
    target = make_target((64,), 16, device, masked=0.2)
    (rl_losses.cross_entropy(x, target) * 65536.0).backward()
    x64 = x.detach().double().requires_grad_()
    (reference.cross_entropy(x64, target) * 65536.0).backward()
    assert torch.isfinite(x.grad).all()
    assert_grad_close(x.grad, x64.grad, torch.float16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_gradient_scaled_without_bias(device, reduction):
    # g = 1/3 rounded to bf16 first would bias every entry by +0.19%; rounded once, the mean error is ~0.
    x = make_logits((256,), 64, torch.bfloat16, device).requires_grad_()
    target = make_target((256,), 64, device, masked=0.0)
    upstream = 1.0 / 3.0
    loss = rl_losses.cross_entropy(x, target, reduction=reduction)
    (loss.sum() * upstream).backward()
    x64 = x.detach().double().requires_grad_()
    (reference.cross_entropy(x64, target, reduction=reduction).sum() * upstream).backward()
    big = x64.grad.abs() > 1e-3 * x64.grad.abs().max()
    bias = (x.grad.double()[big] / x64.grad[big] - 1).mean().item()
    assert abs(bias) < 4e-4, f"mean relative error {bias:.2e}"
    assert_grad_close(x.grad, x64.grad, torch.bfloat16)


# ---- inplace_backward ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["expand", "as_strided"])
def test_inplace_refuses_overlapping_rows(layout, device):
    leaf = torch.randn(17, device=device, requires_grad=True)
    base = leaf * 1.0
    logits = base.expand(12, 17) if layout == "expand" else base.as_strided((4, 9), (2, 1))
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
    with pytest.raises(RuntimeError, match="inplace_backward needs logits whose rows do not overlap in memory"):
        rl_losses.cross_entropy(logits, target, inplace_backward=True)


def _policy_call(op, logits, target, **options):
    n = target.shape[0]
    adv, old = torch.randn(n), torch.full((n,), -2.0)
    if op == "cross_entropy":
        return rl_losses.cross_entropy(logits, target, **options)
    if op == "grpo":
        return rl_losses.grpo_loss(logits, target, adv, old, **options).loss
    return rl_losses.gspo_loss(logits, target, adv, old, torch.arange(n) // 2, **options).loss


@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
def test_inplace_checks_labels_before_writing(op):
    leaf = torch.randn(6, 7, requires_grad=True)
    logits = leaf * 1.0
    before = logits.detach().clone()
    target = torch.tensor([1, 2, 3, 4, 5, 7])  # the last row's label is out of range
    with pytest.raises(RuntimeError, match="label 7 at row 5 is out of range for vocab_size 7"):
        _policy_call(op, logits, target, inplace_backward=True)
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)


def test_inplace_checks_document_ids_before_writing():
    logits = torch.randn(6, 7, requires_grad=True) * 1.0
    before = logits.detach().clone()
    target = torch.tensor([1, 2, 3, 4, 5, 6])
    with pytest.raises(RuntimeError, match="document_index holds 3 but num_documents is 3"):
        rl_losses.gspo_loss(logits, target, torch.randn(6), torch.full((6,), -2.0), torch.tensor([0, 0, 1, 1, 2, 3]),
                            num_documents=3, inplace_backward=True)
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("view", [False, True])
def test_inplace_refuses_leaf_that_requires_grad(view, device):
    leaf = torch.randn(4, 9, device=device, requires_grad=True)
    before = leaf.detach().clone()
    logits = leaf.view(2, 2, 9) if view else leaf
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=device)
    with pytest.raises(RuntimeError, match=f"cross_entropy: inplace_backward=True overwrites the logits .* "
                                           f"{'a view of a leaf' if view else 'a leaf'} tensor that requires grad"):
        rl_losses.cross_entropy(logits, target, inplace_backward=True)
    torch.testing.assert_close(leaf.detach(), before, rtol=0, atol=0)


# ---- fake (meta) kernels check what the real kernels check --------------------------------------------------------
def _bad_inputs():
    """(name, call(device), expected message fragment): bad inputs the real kernels reject without their data."""
    def ce(d, logits=None, target=None, **kw):
        logits = torch.randn(4, 7, device=d) if logits is None else logits
        target = torch.zeros(4, dtype=torch.long, device=d) if target is None else target
        return ops.cross_entropy(logits, target, **kw)

    def grpo(d, **kw):
        t = torch.zeros(4, dtype=torch.long, device=d)
        adv = kw.pop("adv", torch.zeros(4, device=d))
        return ops.grpo(torch.randn(4, 7, device=d), t, adv, torch.zeros(4, device=d), **kw)

    def gspo(d, **kw):
        t = torch.zeros(4, dtype=torch.long, device=d)
        doc = kw.pop("doc", torch.zeros(4, dtype=torch.long, device=d))
        return ops.gspo(torch.randn(4, 7, device=d), t, torch.zeros(4, device=d), torch.zeros(4, device=d), doc,
                        **kw)

    def lin(d, weight=None, **kw):
        w = torch.randn(7, 5, device=d) if weight is None else weight
        return ops.linear_cross_entropy(torch.randn(4, 5, device=d), w, torch.zeros(4, dtype=torch.long, device=d),
                                        **kw)

    return [
        ("int_logits", lambda d: ce(d, logits=torch.zeros(4, 7, dtype=torch.long, device=d)),
         "logits must be a floating-point tensor"),
        ("float_target", lambda d: ce(d, target=torch.zeros(4, device=d)), "target must be an integer tensor"),
        ("target_shape", lambda d: ce(d, target=torch.zeros(3, dtype=torch.long, device=d)), "target has shape"),
        ("vocab_stride", lambda d: ce(d, logits=torch.randn(7, 4, device=d).t()), "unit stride"),
        ("reduction", lambda d: ce(d, reduction="avg"), "reduction must be"),
        ("label_weight", lambda d: ce(d, label_weight=-1.0), "label_weight must be finite"),
        ("divisor_none", lambda d: ce(d, reduction="none", divisor=2.0), "divisor has no meaning"),
        ("row_stats", lambda d: ce(d, row_stats=torch.zeros(4, 4, device=d)), "row_stats must have shape"),
        ("epsilon_high", lambda d: grpo(d, epsilon_high=math.inf), "epsilon_high must be finite"),
        ("delta", lambda d: grpo(d, delta=0.0), "delta must be > 0"),
        ("beta", lambda d: grpo(d, beta=0.1), "needs ref_log_probs"),
        ("advantages_shape", lambda d: grpo(d, adv=torch.zeros(5, device=d)), "advantages has shape"),
        ("weighting", lambda d: gspo(d, weighting="sequence", num_documents=1), "weighting must be"),
        ("float_doc", lambda d: gspo(d, doc=torch.zeros(4, device=d), num_documents=1), "document_index must be"),
        ("num_documents", lambda d: gspo(d, num_documents=2**40), "num_documents must be in"),
        ("gspo_delta", lambda d: gspo(d, delta=-0.5, num_documents=1), "delta must be > 0"),
        ("gspo_delta_sapo", lambda d: gspo(d, delta=2.0, loss_type="sapo", num_documents=1), "applies to loss_type"),
        ("weight_dim", lambda d: lin(d, weight=torch.randn(7, device=d)), "weight must be a 2-D"),
        ("chunk_size", lambda d: lin(d, chunk_size=0), "chunk_size must be >= 1"),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_fake_and_real_reject_alike(name, call, message):
    assert_fake_rejects_like_real(call, message)


def test_meta_checks_devices_and_dtypes():
    logits = torch.randn(4, 7)
    with pytest.raises(RuntimeError, match="cross_entropy: target is on meta but logits is on cpu"):
        ops.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device="meta"))
    with pytest.raises(RuntimeError, match="cross_entropy: target is on meta but logits is on cpu"):
        ops._cross_entropy_forward(logits, torch.zeros(4, dtype=torch.long, device="meta"), 1.0, 0.0, 0.0, 1.0,
                                   "mean", None, None, 0, -1, True)
    meta = torch.randn(4, 7, device="meta", requires_grad=True) * 1.0
    with pytest.raises(RuntimeError, match="rows do not overlap"):
        ops.cross_entropy(meta[:1].expand(4, 7), torch.zeros(4, dtype=torch.long, device="meta"),
                          inplace_backward=True)


# ---- double backward ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo", "linear_cross_entropy"])
def test_double_backward_raises(op):
    x = torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([0, 1, 2, 3, 4, -100])
    if op == "linear_cross_entropy":
        loss = rl_losses.linear_cross_entropy(x, torch.randn(9, 5), target)
    else:
        loss = _policy_call(op, x * 1.0, target)
    with pytest.raises(RuntimeError, match=f"{op}: double backward \\(create_graph=True\\) is not supported"):
        torch.autograd.grad(loss, x, create_graph=True)


# ---- option checks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf])
def test_label_weight_checked(value):
    with pytest.raises(RuntimeError, match=f"cross_entropy: label_weight must be finite and >= 0, got {value:g}"):
        ops.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), label_weight=value)


def test_policy_option_messages():
    x, t, z = torch.randn(3, 4), torch.zeros(3, dtype=torch.long), torch.zeros(3)
    with pytest.raises(RuntimeError, match="grpo: epsilon_high must be finite and >= 0, got inf"):
        rl_losses.grpo_loss(x, t, z, z, epsilon_high=math.inf)
    with pytest.raises(RuntimeError, match=r"grpo: delta must be finite \(leave it unset for no cap\), got inf"):
        rl_losses.grpo_loss(x, t, z, z, delta=math.inf)
    with pytest.raises(RuntimeError, match=r"gspo: num_documents must be in \[0, 2147483648\], got 1099511627776"):
        rl_losses.gspo_loss(x, t, z, z, torch.zeros(3, dtype=torch.long), num_documents=2**40)


def test_gspo_nan_label_counts_propagate():
    n, v = 6, 5
    x = torch.randn(n, v)
    t = make_target((n,), v, "cpu", masked=0.0)
    adv, old, doc = torch.randn(n), label_log_probs64(x, t).float(), torch.tensor([0, 0, 0, 1, 1, 1])
    counts = torch.full((n,), 3.0)
    counts[1] = math.nan
    out = rl_losses.gspo_loss(x, t, adv, old, doc, num_documents=2, label_counts=counts)
    ref = reference.gspo_loss(x.double(), t, adv.double(), old.double(), doc, num_documents=2,
                              label_counts=counts.double())
    assert math.isnan(ref.loss.item()) and math.isnan(out.loss.item())


def test_single_column_logits_with_any_last_stride(device):
    x = torch.randn(1, 9, device=device).t()  # (9, 1) with strides (1, 9): contiguous, last stride 9
    assert x.is_contiguous() and x.stride(-1) != 1
    target = torch.zeros(9, dtype=torch.long, device=device)
    xg = x.clone().t().contiguous().t().requires_grad_()  # same layout, a leaf
    loss = rl_losses.cross_entropy(xg, target, z_loss_factor=0.1)
    loss.backward()
    x64 = x.detach().double().requires_grad_()
    ref = reference.cross_entropy(x64, target, z_loss_factor=0.1)
    ref.backward()
    assert_close(loss, ref.detach(), torch.float32)
    assert_grad_close(xg.grad, x64.grad, torch.float32, natural_scale=1 / 9)


@requires_cuda
def test_fp16_loss_scale_cuda_per_row():
    x = make_logits((32,), 16, torch.float16, "cuda").requires_grad_()
    target = make_target((32,), 16, "cuda", masked=0.2)
    rl_losses.cross_entropy(x, target, reduction="none").backward(torch.full((32,), 65536.0, device="cuda"))
    x64 = x.detach().double().requires_grad_()
    reference.cross_entropy(x64, target, reduction="none").backward(torch.full((32,), 65536.0, device="cuda",
                                                                                dtype=torch.float64))
    # Finite wherever eager fp16 PyTorch is (a gradient of 65536·(p − 1) may round past the fp16 range in both).
    xe = x.detach().clone().requires_grad_()
    # (eager's fp16 path: fp32 math, the fp32 upstream gradient, one rounding to fp16 at the leaf)
    torch.nn.functional.cross_entropy(xe.float(), torch.where(target < 0, -100, target), reduction="none").backward(
        torch.full((32,), 65536.0, device="cuda"))
    eager_finite = torch.isfinite(xe.grad)
    assert torch.isfinite(x.grad)[eager_finite].all()
    assert_grad_close(torch.where(eager_finite, x.grad, 0), torch.where(eager_finite, x64.grad, 0), torch.float16)
