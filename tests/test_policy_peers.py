"""The policy family against the peers' own formulas (docs/policy_losses.md), in fp32 on the same inputs.

* Liger-Kernel's ``LigerFusedLinearGRPOFunction.ppo_loss_fn`` (liger_kernel/chunked_loss/grpo_loss.py) takes the
  per-token log-probs directly, so it is called as is, for every TRL loss_type it accepts (vespo included; more
  vespo cases against TRL's own get_gamma_weights in test_policy_vespo.py), with its vLLM ratio
  (``vllm_is_ratio``), its KL and bias-corrected KL: loss, gradient w.r.t. the logits (through the log-probs) and
  its KL and clip metrics.
* TRL's ``GRPOTrainer._compute_loss`` needs a model, so its rollout-ratio modes and entropy bonus are written
  out below from trl/trainer/grpo_trainer.py (trl 1.16.0), each at the line it reproduces.
"""
import pytest
import torch

import rl_losses
from rl_losses.aggregation import TRL_LOSS_TYPES, aggregation_weights

from helpers import label_log_probs64, make_logits

liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")

# float64: the formulas must agree to rounding; float32: both sides round differently, and a loss summing terms of
# both signs (cispo's −w·A·lp) loses a few more digits to cancellation than 1e-6 of its value.
RTOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def make_batch(b=4, t=10, vocab=97, dtype=torch.float32):
    logits = make_logits((b, t), vocab, dtype, "cpu")
    lengths = torch.randint(2, t + 1, (b,))
    lengths[0] = t
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    target = torch.where(mask, torch.randint(0, vocab, (b, t)), -100)
    lp = label_log_probs64(logits, target)
    old = (lp + 0.3 * torch.randn(b, t, dtype=torch.float64)).to(dtype)
    ref = (lp + 0.2 * torch.randn(b, t, dtype=torch.float64)).to(dtype)
    rollout = (old.double() + 0.3 * torch.randn(b, t, dtype=torch.float64)).to(dtype)
    advantages = torch.randn(b, dtype=dtype)
    return logits, target, mask, advantages, old, ref, rollout


def per_token_logps(x, target):
    lp = torch.log_softmax(x, dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target >= 0, lp, 0.0)


def assert_rel_close(actual, expected, what, dtype=torch.float32):
    # Relative to the largest entry (a gradient's small entries are compared at the scale of its large ones).
    scale = expected.abs().max().clamp_min(1e-30)
    err = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert err <= RTOL[dtype], f"{what}: relative error {err:.2e}"


# Liger's luspo divides Σ ℓ_t·|o_i| by B·T at token level (liger 0.8.5, grpo_loss.py: "weighted.sum() /
# (full_attention_mask.shape[0] * weighted.shape[1])"), where TRL's is Σ_t m_t·ℓ_t summed per sequence and
# averaged over B; the preset follows TRL (test_policy.py::test_presets_match_trl_reductions checks it).
CASES = [(name, beta, bias, rollout) for name in TRL_LOSS_TYPES if name != "luspo" for beta, bias, rollout in
         [(0.0, False, False), (0.05, True, True)]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name,beta,bias_correction,with_rollout", CASES,
                         ids=[f"{c[0]}-beta{c[1]}-{'bias' if c[2] else 'plain'}-{'is' if c[3] else 'nois'}"
                              for c in CASES])
def test_matches_liger_ppo_loss_fn(name, beta, bias_correction, with_rollout, dtype):
    logits, target, mask, advantages, old, ref, rollout = make_batch(dtype=dtype)
    loss_type, preset = TRL_LOSS_TYPES[name]
    eps_high = 1.15 if loss_type == "cispo" else 0.28
    max_len = target.shape[1] + 3
    # TRL's token_truncate ratio (grpo_trainer.py, _generate_and_score_completions): exp((old − sampling)·mask)
    # clamped at vllm_importance_sampling_clip_max.
    is_ratio = torch.exp((old - rollout) * mask).clamp(max=1.3) if with_rollout else None

    x = logits.clone().requires_grad_()
    expected, metrics = liger_grpo.LigerFusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps(x, target), mask.to(dtype), advantages, mask.to(dtype),
        ref_per_token_logps=ref if beta else None,
        old_per_token_logps=old, epsilon_low=0.2, epsilon_high=eps_high, beta=beta, loss_type=name,
        max_completion_length=max_len, vllm_is_ratio=is_ratio, use_bias_correction_kl=bias_correction,
        sapo_temperature_pos=1.2, sapo_temperature_neg=0.9)
    expected.backward()

    weights, divisor = aggregation_weights(preset, completion_mask=mask, max_completion_length=max_len,
                                           dtype=dtype)
    y = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(
        y, target, advantages, old, loss_type=loss_type, epsilon_high=eps_high, loss_weights=weights,
        divisor=divisor, ref_log_probs=ref if beta else None, beta=beta, kl_importance_weighted=bias_correction,
        sapo_temperature_pos=1.2, sapo_temperature_neg=0.9,
        rollout_log_probs=rollout if with_rollout else None,
        rollout_correction="token_truncate" if with_rollout else None, rollout_cap=1.3)
    out.loss.backward()
    assert_rel_close(out.loss.detach(), expected.detach(), "loss", dtype)
    assert_rel_close(y.grad, x.grad, "gradient", dtype)
    if beta:
        assert_rel_close(out.kl, metrics[0], "kl", dtype)
    clipped = out.clipped_fraction_low + out.clipped_fraction_high
    assert_rel_close(clipped, metrics[-1], "clip fraction", dtype)


def test_token_mask_matches_trl():
    # grpo_trainer.py (trl 1.16.0), token_mask: ratio = exp((old − sampling)·mask), then
    # masked_fill((ratio < clip_min) | (ratio > clip_max), 0); the policy term × ratio, KL added after.
    logits, target, mask, advantages, old, ref, rollout = make_batch()
    lo, hi = 0.7, 1.3
    ratio = torch.exp((old - rollout) * mask)
    ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    x = logits.clone().requires_grad_()
    lp = per_token_logps(x, target)
    coef_1 = torch.exp(lp - old)
    coef_2 = coef_1.clamp(0.8, 1.2)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a) * ratio
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    per_token = per_token + 0.04 * kl
    expected = (per_token * mask).sum() / mask.sum()  # bnpo
    expected.backward()
    y = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(y, target, advantages, old, rollout_log_probs=rollout, rollout_correction="token_mask",
                              rollout_mask_bounds=(lo, hi), ref_log_probs=ref, beta=0.04)
    out.loss.backward()
    assert_rel_close(out.loss.detach(), expected.detach(), "loss")
    assert_rel_close(y.grad, x.grad, "gradient")
    # TRL logs the mean of the masked ratio over completion tokens as sampling/importance_sampling_ratio/mean.
    assert_rel_close(out.trl_metrics()["sampling/importance_sampling_ratio/mean"], ratio[mask].mean(), "IS mean")


def test_entropy_bonus_matches_trl():
    # grpo_trainer.py (trl 1.16.0): loss = loss − entropy_coef·(entropies·mask).sum()/mask.sum() after the dapo /
    # bnpo token mean; with the token_mean preset ours is the same objective.
    logits, target, mask, advantages, old, _, _ = make_batch()
    coef = 0.05
    x = logits.clone().requires_grad_()
    logp = torch.log_softmax(x, dim=-1)
    entropies = -(logp.exp() * logp).sum(-1)
    lp = per_token_logps(x, target)
    coef_1 = torch.exp(lp - old)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_1.clamp(0.8, 1.2) * a)
    expected = (per_token * mask).sum() / mask.sum() - coef * (entropies * mask).sum() / mask.sum()
    expected.backward()
    y = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(y, target, advantages, old, entropy_coefficient=coef)
    out.loss.backward()
    assert_rel_close(out.loss.detach(), expected.detach(), "loss")
    assert_rel_close(y.grad, x.grad, "gradient")
    assert_rel_close(out.trl_metrics()["entropy"], (entropies * mask).sum() / mask.sum(), "entropy")
