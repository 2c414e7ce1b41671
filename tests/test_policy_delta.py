"""TRL's two-sided clip δ (``delta``) in every regime it is well defined: above 1 + ε_h (it caps the ratio where
A < 0), on it, between 1 − ε_l and 1 + ε_h (it caps the ratio where A > 0 instead), below 1 − ε_l. Each op that
takes it (grpo, gspo, their linear forms, the fused head's GRPO term; policy_token_loss in test_policy_token.py)
against the float64 reference, which is autograd through TRL's own formula −min(min(r, δ)·A, clip(r)·A), and the
tokens left a gradient against the closed form of docs/math.md."""
import pytest
import torch

import rl_losses
from rl_losses import reference

import helpers_gspo
from conftest import assert_close
from helpers import assert_grad_close
from helpers_grpo import check_against_reference, designed_ratio_inputs

EPS_LOW, EPS_HIGH = 0.2, 0.2
DELTAS = {"above": 1.5, "on": 1.2, "inside": 1.1, "below-low": 0.7}


def has_gradient(ratio, adv, delta):
    """Where −min(min(r, δ)·A, clip(r)·A) still depends on r: A > 0 and r ≤ min(1+ε_h, δ); A < 0 and
    1−ε_l ≤ r ≤ max(1+ε_h, δ)."""
    hi = 1 + EPS_HIGH
    return ((adv > 0) & (ratio <= min(hi, delta))) | ((adv < 0) & (ratio >= 1 - EPS_LOW) & (ratio <= max(hi, delta)))


def designed_inputs(delta, n, vocab, dtype, device, margin=1e-3):
    """Ratios `margin` inside and outside each bound (1 − ε_l, 1 + ε_h, δ), and a few farther away."""
    bounds = [1 - EPS_LOW, 1 + EPS_HIGH, delta]
    designed = [b + s * margin for b in bounds for s in (-1, 1)] + [0.5, 1.0, 2.0]
    return designed_ratio_inputs(designed, n, vocab, dtype, device)


@pytest.mark.parametrize("regime", list(DELTAS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grpo(regime, dtype, device):
    """Loss, gradient and metrics against the reference; the tokens with a gradient and TRL's clip flags (on
    min(r, δ)) follow from the design."""
    delta = DELTAS[regime]
    logits, target, adv, old, ratio = designed_inputs(delta, 120, 200, dtype, device)
    out, grad = check_against_reference(logits, target, adv, old, 1.0, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                         delta=delta)
    assert torch.equal(grad.double().abs().sum(-1) > 0, has_gradient(ratio, adv, delta))
    capped = ratio.clamp(max=delta)
    n = len(ratio)
    assert out.clipped_fraction_low.item() == pytest.approx((((capped < 1 - EPS_LOW) & (adv < 0)).sum() / n).item())
    assert out.clipped_fraction_high.item() == pytest.approx((((capped > 1 + EPS_HIGH) & (adv > 0)).sum() / n).item())


@pytest.mark.parametrize("regime", list(DELTAS))
def test_gspo(regime, device):
    """Per-document ratios spread wide (R_s from about 0.4 to 2.5) against both GSPO references."""
    doc = helpers_gspo.packed(device)
    logits, target, adv, old = helpers_gspo.make_inputs((8, 16), 97, torch.float32, device, doc, doc_spread=0.5)
    out, _ = helpers_gspo.check(logits, target, adv, old, doc, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                delta=DELTAS[regime], compute_entropy=True)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("regime", ["inside", "below-low"])
def test_linear_ops(regime):
    """linear_grpo_loss and linear_gspo_loss (chunked) against the reference on hidden @ weight.T."""
    delta = DELTAS[regime]
    hidden = torch.randn(40, 16, dtype=torch.float64)
    weight = torch.randn(61, 16, dtype=torch.float64) * 0.5
    target = torch.randint(0, 61, (40,))
    target[::7] = -100
    adv = torch.randn(40, dtype=torch.float64)
    with torch.no_grad():
        lp = reference.token_log_probs(hidden @ weight.t(), target)[0]
    old = lp + 0.4 * torch.randn(40, dtype=torch.float64)
    doc = torch.arange(40) // 5
    options = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, delta=delta)
    for name in ("grpo", "gspo"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if name == "grpo":
            out = rl_losses.linear_grpo_loss(h, w, target, adv, old, chunk_size=16, **options)
            ref = reference.grpo_loss(h64 @ w64.t(), target, adv, old, **options)
        else:
            out = rl_losses.linear_gspo_loss(h, w, target, adv, old, doc, chunk_size=16, **options)
            ref = reference.gspo_loss(h64 @ w64.t(), target, adv, old, doc, **options)
        out.loss.backward()
        ref.loss.backward()
        assert_close(out.loss.detach(), ref.loss.detach(), torch.float64, msg=f"{name} loss")
        for metric in ("clipped_fraction_low", "clipped_fraction_high"):
            assert_close(getattr(out, metric), getattr(ref, metric), torch.float64, msg=f"{name} {metric}")
        assert_grad_close(h.grad, h64.grad, torch.float64)
        assert_grad_close(w.grad, w64.grad, torch.float64)


@pytest.mark.parametrize("regime", ["inside", "below-low"])
def test_fused_head_grpo_term(regime, device):
    """The fused head's GRPO term takes the same δ (with a label term beside it)."""
    delta = DELTAS[regime]
    logits, target, adv, old, _ = designed_inputs(delta, 60, 50, torch.float32, device)
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.fused_head_loss(x, target, label_weight=0.5, grpo_weight=2.0, advantages=adv, old_log_probs=old,
                                    epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, delta=delta)
    out.loss.backward()
    x64 = logits.detach().double().requires_grad_()
    ref = reference.fused_head_loss(x64, target, label_weight=0.5, grpo_weight=2.0, advantages=adv.double(),
                                    old_log_probs=old.double(), epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                    delta=delta)
    ref.loss.backward()
    assert_close(out.loss.detach(), ref.loss.detach(), torch.float32, msg="loss")
    assert_grad_close(x.grad, x64.grad, torch.float32)
