"""Gradient precision at large scaled logits x = s·z: a large common offset with O(1) differences, or a large
logits_scale_factor. The probabilities depend only on x − max, so an fp32 implementation can be as accurate
there as anywhere; one that takes exp(s·z − lse) after lse (of the logits' magnitude) was rounded loses
|x|·2^-24 in every exponent: a relative gradient error of ~5e-4 at x near 1e4.

Each case compares the max elementwise relative error of the gradient, against the float64 reference, with
that of eager fp32 PyTorch (the losses through log_softmax, in fp32 under autograd) on the same inputs.

fp16 logits under a loss scale (GradScaler's 2^16): the gradient is computed in the forward for an upstream
gradient of 1, where most of its values are far below fp16's smallest normal; it must keep every value eager
PyTorch keeps (the loss of the fp16 logits computed in fp32, as under autocast: g·gradient rounded to fp16 once)
and stay within 2x eager's median relative error.
"""
import pytest
import torch

from rl_losses import reference

from helpers import label_log_probs64, make_logits, make_target, op_loss, op_reference, policy_inputs

ROWS, VOCAB = 64, 500
# (offset, logits_scale_factor): x = s·z. With s = 1, z = offset + randn. With s = 1e6, z is drawn from a grid
# of 10-bit values k·2^-20 (k in [896, 1024)), whose products with 1e6 fp32 represents exactly: x in
# [854, 977) with gaps of 0.95, so eager fp32 code (x = z·s rounded, then log_softmax) is as accurate as at
# s = 1, while an exponent s·z − lse folded into one affine map still loses |x|·2^-24.
CASES = [(1e4, 1.0), (1e5, 1.0), (0.0, 1e6)]


def _inputs(offset, scale, device):
    if scale == 1.0:
        z = (offset + torch.randn(ROWS, VOCAB, device=device)).float()
    else:
        z = torch.randint(896, 1024, (ROWS, VOCAB), device=device).float() * 2.0**-20
    target = make_target((ROWS,), VOCAB, device, masked=0.2)
    adv = torch.randn(ROWS, device=device)
    # Old log-probs within ±0.1 of the current ones: every ratio stays far inside the clip range (0.8, 1.2), so
    # a rounding error cannot move a token across a clip boundary, where the gradient jumps.
    lp = label_log_probs64(z, target, scale)
    old = (lp + 0.1 * (2 * torch.rand(ROWS, device=device, dtype=torch.float64) - 1)).float()
    doc = torch.arange(ROWS, device=device) * 8 // ROWS
    return z, target, adv, old, doc


def _reference_grad(op, z, target, adv, old, doc, scale):
    """The gradient of the loss at z's dtype: the float64 reference for fp64, eager PyTorch for fp32 (the
    reference's own policy losses, which take log_softmax as eager code does, and cross-entropy through
    log_softmax: the reference's logsumexp form is exact in fp64 but not how eager fp32 code computes it)."""
    x = z.detach().clone().requires_grad_()
    dt = x.dtype
    if op == "cross_entropy" and dt == torch.float64:
        loss = reference.cross_entropy(x, target, logits_scale_factor=scale)
    elif op == "cross_entropy":
        mask = target >= 0
        lp = torch.log_softmax(x * scale, dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        loss = -torch.where(mask, lp, 0.0).sum() / mask.sum().clamp_min(1)
    elif op == "grpo":
        loss = reference.grpo_loss(x, target, adv.to(dt), old.to(dt), logits_scale_factor=scale).loss
    else:
        loss = reference.gspo_loss(x, target, adv.to(dt), old.to(dt), doc, num_documents=8,
                                   logits_scale_factor=scale).loss
    loss.backward()
    return x.grad


def _max_relative_error(grad, expected):
    # The atol (1e-9 of the largest entry) keeps entries that underflow in fp32 (p below e^-87) from counting.
    atol = 1e-9 * expected.abs().max().item()
    return ((grad.double() - expected).abs() / (expected.abs() + atol)).max().item()


@pytest.mark.parametrize("offset,scale", CASES, ids=["offset1e4", "offset1e5", "scale1e6"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
def test_gradient_precision_at_large_logits(op, offset, scale, device):
    z, target, adv, old, doc = _inputs(offset, scale, device)
    expected = _reference_grad(op, z.double(), target, adv, old, doc, scale)
    eager = _max_relative_error(_reference_grad(op, z, target, adv, old, doc, scale), expected)

    x = z.detach().clone().requires_grad_()
    op_loss(op, x, target, adv, old, doc, 8, logits_scale_factor=scale).backward()
    ours = _max_relative_error(x.grad, expected)
    assert ours <= 4 * eager + 1e-6, f"max relative gradient error {ours:.3g}, eager fp32 PyTorch's {eager:.3g}"


def _eager_fp16_loss(op, x, target, adv, old, doc, num_documents):
    """The loss in eager PyTorch of fp16 logits as mixed precision computes it (autocast runs these losses in
    fp32): on x.float(), so that the gradient is computed in fp32 and rounded to fp16 once, by the cast's
    backward."""
    x = x.float()
    if op == "cross_entropy":
        return torch.nn.functional.cross_entropy(x, target, ignore_index=-100)
    if op == "grpo":
        return reference.grpo_loss(x, target, adv, old).loss
    return reference.gspo_loss(x, target, adv, old, doc, num_documents=num_documents).loss


def _median_relative_error(grad, expected, where):
    return ((grad.double() - expected).abs() / expected.abs())[where].median().item()


@pytest.mark.parametrize("inplace", [False, True], ids=["grad_buffer", "inplace"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
def test_fp16_gradient_under_a_loss_scale(op, inplace, device):
    loss_scale, n_docs = 2.0**16, 16
    # std 4: the probabilities span ~e^-30..1, so that g·gradient covers fp16's whole range down to subnormals.
    z = make_logits((384,), 2048, torch.float16, device, std=4.0)
    target, adv, old, doc = policy_inputs(z.float(), n_docs)
    target = torch.where(target >= 0, target, -100)
    expected = op_reference(op, z, target, adv, old, doc, n_docs)[1] * loss_scale

    x = z.clone().requires_grad_()
    (_eager_fp16_loss(op, x, target, adv, old, doc, n_docs) * loss_scale).backward()
    eager = x.grad

    y = z.clone().requires_grad_()
    logits = y * 1 if inplace else y  # inplace_backward needs logits that are not a leaf
    (op_loss(op, logits, target, adv, old, doc, n_docs, inplace_backward=inplace) * loss_scale).backward()
    ours = y.grad

    kept = (eager != 0) & (expected != 0)
    assert eager.isfinite().all() and kept.float().mean() > 0.5
    lost = (kept & (ours == 0)).sum().item()
    assert lost == 0, f"{lost} of {kept.sum().item()} gradient values that eager PyTorch keeps are zero"
    err, err_eager = _median_relative_error(ours, expected, kept), _median_relative_error(eager, expected, kept)
    assert err <= 2 * err_eager, f"median relative error {err:.3g}, eager PyTorch's {err_eager:.3g}"
