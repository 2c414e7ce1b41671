"""Gradient precision at large scaled logits x = s·z: a large common offset with O(1) differences, or a large
logits_scale_factor. The probabilities depend only on x − max, so an fp32 implementation can be as accurate
there as anywhere; one that takes exp(s·z − lse) after lse (of the logits' magnitude) was rounded loses
|x|·2^-24 in every exponent: a relative gradient error of ~5e-4 at x near 1e4.

Each case compares the max elementwise relative error of the gradient, against the float64 reference, with
that of eager fp32 PyTorch (the reference functions run in fp32 under autograd) on the same inputs.
"""
import pytest
import torch

from rl_losses import reference

from helpers import label_log_probs64, make_target, op_loss

ROWS, VOCAB = 64, 500
# (offset, logits_scale_factor, spread of z): x = s·(offset + spread·randn). The last has |x| ~ 1e6 with gaps
# of ~1e5 between a row's logits: p is nearly one-hot, and a rounded lse is off by up to 2^-3 in the exponent.
CASES = [(1e4, 1.0, 1.0), (1e5, 1.0, 1.0), (0.0, 1e6, 1.0)]


def _inputs(op, offset, scale, spread, device):
    z = (offset + spread * torch.randn(ROWS, VOCAB, device=device)).float()
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


@pytest.mark.parametrize("offset,scale,spread", CASES, ids=["offset1e4", "offset1e5", "scale1e6"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
def test_gradient_precision_at_large_logits(op, offset, scale, spread, device):
    z, target, adv, old, doc = _inputs(op, offset, scale, spread, device)
    expected = _reference_grad(op, z.double(), target, adv, old, doc, scale)
    eager = _max_relative_error(_reference_grad(op, z, target, adv, old, doc, scale), expected)

    x = z.detach().clone().requires_grad_()
    op_loss(op, x, target, adv, old, doc, 8, logits_scale_factor=scale).backward()
    ours = _max_relative_error(x.grad, expected)
    assert ours <= 4 * eager + 1e-6, f"max relative gradient error {ours:.3g}, eager fp32 PyTorch's {eager:.3g}"
