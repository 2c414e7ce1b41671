"""Runs and comparisons shared by the cross-entropy tests (test_cross_entropy*.py).

Every result is compared with the pure-PyTorch reference (rl_losses.reference) run in float64 on the same
logits, upcast only after they were rounded to the test dtype, so that what is left is the op's own error.
Gradients are compared relative to their largest entry (they scale with s·g/D), so that one tolerance per
dtype means the same thing at every vocabulary size, divisor and upstream gradient.
"""
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_grad_close


def _backward(loss, upstream):
    if loss.dim() == 0:
        (loss * upstream).backward()  # a scalar upstream gradient g != 1 reaches the op as grad_output
    else:
        loss.backward(upstream)


def run_op(fn, logits, target, upstream=1.0, **kwargs):
    """The op's loss and gradient on a fresh leaf copy of `logits` with the same strides."""
    x = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device)
    x = x.copy_(logits.detach()).requires_grad_()
    assert x.stride() == logits.stride()
    loss = fn(x, target, **kwargs)
    _backward(loss, upstream)
    return loss.detach(), x.grad


def run_reference(fn, logits, target, upstream=1.0, **kwargs):
    """The float64 reference's loss and gradient (cast back to nothing: compared in float64)."""
    x = logits.detach().double().requires_grad_()
    if isinstance(upstream, torch.Tensor):
        upstream = upstream.double()
    loss = fn(x, target.long(), **kwargs)
    _backward(loss, upstream)
    return loss.detach(), x.grad


def natural_grad_scale(target, upstream, *, logits_scale_factor=1.0, reduction="mean", divisor=None, **_):
    """s·max|g|/D: the size of the largest (p - onehot) term of the gradient."""
    g = upstream.abs().max().item() if isinstance(upstream, torch.Tensor) else abs(upstream)
    if divisor is None:
        divisor = max(int((target >= 0).sum()), 1) if reduction == "mean" else 1.0
    return logits_scale_factor * g / divisor


def check_against_reference(logits, target, upstream=1.0, **kwargs):
    dtype = logits.dtype
    loss, grad = run_op(rl_losses.cross_entropy, logits, target, upstream, **kwargs)
    ref_loss, ref_grad = run_reference(reference.cross_entropy, logits, target, upstream, **kwargs)
    expected_loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == expected_loss_dtype
    assert loss.shape == ref_loss.shape
    assert_close(loss, ref_loss, dtype)
    assert_grad_close(grad, ref_grad, dtype, natural_scale=natural_grad_scale(target, upstream, **kwargs))


def rows_for(shape, vocab):
    """Few rows for the large vocabularies, so that the grid stays cheap on a 2-core CPU."""
    if vocab < 32000:
        return shape
    return {(64,): (6,), (16, 8): (2, 3)}[shape]
