"""Inputs, runs and comparisons shared by the GRPO tests (test_grpo*.py).

The op is compared with rl_losses.reference.grpo_loss in float64, on logits rounded to the test dtype first.
"""
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_grad_close, label_log_probs64, make_logits, make_target, to64

METRICS = ("new_logprobs", "clipped_fraction_low", "clipped_fraction_high", "kl_old", "log_probs", "ratio_mean")


def make_inputs(shape, vocab, dtype, device, *, masked=0.5, logits_scale_factor=1.0, spread=0.3):
    """Logits, labels, per-token advantages, and old / reference log-probs near the current ones.

    old = lp + N(0, spread²) puts the ratios on both sides of the default clip range [0.8, 1.2].
    """
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=masked)
    lp = label_log_probs64(logits, target, logits_scale_factor)
    advantages = torch.randn(shape, device=device)
    old_log_probs = (lp + spread * torch.randn(shape, device=device, dtype=torch.float64)).float()
    ref_log_probs = (lp + 0.2 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    return logits, target, advantages, old_log_probs, ref_log_probs


def designed_ratio_inputs(designed, n, vocab, dtype, device):
    """Logits, labels, advantages of both signs (|A| in [0.5, 1.5)) and old log-probs whose ratios are the
    `designed` values, repeated and shuffled over n tokens (from the op's own log-probs: old = lp − log r).
    Returns them and the ratios (float64)."""
    logits = make_logits((n,), vocab, dtype, device)
    target = torch.randint(0, vocab, (n,), device=device)
    ratio = torch.tensor(designed, dtype=torch.float64, device=device).repeat(n // len(designed) + 1)[:n]
    ratio = ratio[torch.randperm(n, device=device)]
    sign = torch.where(torch.arange(n, device=device) % 2 == 0, 1.0, -1.0)[torch.randperm(n, device=device)]
    advantages = (sign * (0.5 + torch.rand(n, device=device))).float()
    with torch.no_grad():
        lp = rl_losses.grpo_loss(logits, target, advantages, torch.zeros_like(advantages)).log_probs
    return logits, target, advantages, (lp.double() - ratio.log()).float(), ratio


def run_op(logits, target, advantages, old_log_probs, upstream=1.0, **kwargs):
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.grpo_loss(x, target, advantages, old_log_probs, **kwargs)
    (out.loss * upstream).backward()
    return out, x.grad


def run_reference(logits, target, advantages, old_log_probs, upstream=1.0, **kwargs):
    x = logits.detach().double().requires_grad_()
    out = reference.grpo_loss(x, target.long(), advantages.double(), old_log_probs.double(),
                              **{k: to64(v) for k, v in kwargs.items()})
    (out.loss * upstream).backward()
    return out, x.grad


def natural_scale(target, advantages, upstream, *, logits_scale_factor=1.0, divisor=None, loss_weights=None,
                  **_):
    """s·|g|·max|w·A|/D: the size of the largest gradient row coefficient (before the ratio)."""
    mask = target >= 0
    weights = mask.double() if loss_weights is None else torch.where(mask, loss_weights.double(), 0.0)
    if divisor is None:
        divisor = max(int(mask.sum()), 1)
    size = (weights * advantages.double()).abs().max().item() if weights.numel() else 0.0
    return logits_scale_factor * abs(upstream) * size / divisor


def assert_outputs_close(out, ref, dtype, *, compute_entropy=False):
    """Loss and every metric (docs/math.md) against the reference."""
    assert out.loss.dim() == 0
    assert_close(out.loss.detach(), ref.loss.detach(), dtype, msg="loss")
    for name in METRICS:
        actual, expected = getattr(out, name), getattr(ref, name)
        assert not actual.requires_grad, f"{name} must be detached"
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        assert_close(actual, expected, dtype, msg=f"metric {name}")
    if compute_entropy:
        assert_close(out.entropy, ref.entropy, dtype, msg="metric entropy")
    else:
        assert out.entropy is None


def check_against_reference(logits, target, advantages, old_log_probs, upstream=1.0, **kwargs):
    dtype = logits.dtype
    out, grad = run_op(logits, target, advantages, old_log_probs, upstream, **kwargs)
    ref, ref_grad = run_reference(logits, target, advantages, old_log_probs, upstream, **kwargs)
    assert_outputs_close(out, ref, dtype, compute_entropy=kwargs.get("compute_entropy", False))
    assert_grad_close(grad, ref_grad, dtype,
                      natural_scale=natural_scale(target, advantages, upstream, **kwargs))
    assert torch.count_nonzero(grad[target < 0]) == 0, "unlabelled tokens must get a zero gradient"
    return out, grad
