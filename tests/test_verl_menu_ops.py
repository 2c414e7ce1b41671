"""verl's per-token policy losses (gpg, dro, dppo_tv, dppo_kl) as loss types of the fused grpo op and of
policy_token_loss (through rl_losses.integrations.verl), against verl's own registered functions (verl 0.9.1,
verl/trainer/ppo/core_algos.py) on fresh random ragged (B, T) batches: the loss, its gradient w.r.t. the logits
through the op, and verl's metrics, for every loss_agg_mode (the aggregation presets of
aggregation.VERL_LOSS_AGG_MODES, and token-sum), with and without verl's rollout importance weights; the
comparisons as helpers (tests/test_policy_cov.py takes them for clip_cov and kl_cov); verl's bypass_mode."""
import math

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

import rl_losses  # noqa: E402
from rl_losses import aggregation, config, reference_verl  # noqa: E402
from rl_losses.integrations import verl as rl_verl  # noqa: E402

from helpers_verl import make_config  # noqa: E402

MODES = [*aggregation.VERL_LOSS_AGG_MODES, "token-sum"]
# verl's loss_mode -> (the op's options, verl's ActorConfig overrides, verl's PolicyLossConfig overrides)
CASES = {
    "gpg": ({}, {}, {}),
    "dro": (dict(dro_beta=0.7), {}, dict(dro_beta=0.7)),
    "dppo_tv": (dict(epsilon_low=0.03, epsilon_high=0.025, clip_ratio_c=1.5),
                dict(clip_ratio_low=0.03, clip_ratio_high=0.025, clip_ratio_c=1.5), {}),
    "dppo_kl": (dict(epsilon_low=0.004, epsilon_high=0.003, clip_ratio_c=1.5),
                dict(clip_ratio_low=0.004, clip_ratio_high=0.003, clip_ratio_c=1.5), {}),
}


def config_of(name, global_batch_info=None):
    _, overrides, policy = CASES[name]
    return make_config(global_batch_info, policy_loss=verl_config.PolicyLossConfig(loss_mode=name, **policy),
                       **overrides)


def batch(batch_size=8, length=64, vocab=9):
    """Logits (B, T, V) with labels, verl's response mask (ragged, one empty row), old log-probs near the new
    ones, advantages per token, rollout weights: float64, on a fresh seed."""
    logits = 2 * torch.randn(batch_size, length, vocab, dtype=torch.float64)
    target = torch.randint(0, vocab, (batch_size, length))
    lengths = torch.randint(length // 2, length + 1, (batch_size,))
    lengths[1] = 0
    mask = (torch.arange(length) < lengths.unsqueeze(1)).to(torch.float64)
    lp = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    old = lp + 0.3 * torch.randn_like(lp)
    adv = torch.randn(batch_size, 1, dtype=torch.float64) + torch.randn_like(lp)
    weights = 2 * torch.rand_like(lp)
    return logits, target.masked_fill(mask == 0, -100), mask, old, adv, weights


def verl_loss(name, mode, logits, target, mask, old, adv, weights, config_of=config_of):
    """verl's (loss, gradient w.r.t. the logits, metrics), its log-probs from the logits by autograd."""
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    loss, metrics = core_algos.get_policy_loss_fn(name)(old, lp, adv, mask, mode, config_of(name), weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def aggregation_of(mode, mask):
    """verl's agg_loss as the op's (loss_weights, divisor): the mode's preset weights; verl counts only the rows
    with a response token (and divides seq-mean-token-sum-norm by T)."""
    if mode == "token-sum":
        return mask, 1.0
    weights, divisor = aggregation.aggregation_weights(aggregation.VERL_LOSS_AGG_MODES[mode], completion_mask=mask,
                                                       max_completion_length=mask.shape[-1], dtype=torch.float64)
    if divisor is None:
        return weights, None
    rows = float((mask.sum(-1) > 0).sum())
    return weights, rows * mask.shape[-1] if mode == "seq-mean-token-sum-norm" else rows


def fused_matches_verl(name, mode, options, config_of, device="cpu"):
    """grpo (loss_type ``name``, ``options``) on ``device`` against verl's <name> on the CPU from the same state of
    the default generator, without and with verl's rollout weights: the loss and its gradient w.r.t. the logits
    equal. Returns the op's output, verl's metrics and the mask of each."""
    logits, target, mask, old, adv, weights = batch()
    results = []
    for rollout_is_weights in (None, weights):
        seed = int(torch.randint(0, 2**31 - 1, ()))
        torch.manual_seed(seed)
        theirs = verl_loss(name, mode, logits, target, mask, old, adv, rollout_is_weights, config_of)
        loss_weights, divisor = aggregation_of(mode, mask)
        if rollout_is_weights is not None:  # verl's weights multiply the token loss: the op's token weights
            loss_weights = loss_weights * rollout_is_weights
        x = logits.to(device).requires_grad_(True)
        torch.manual_seed(seed)
        out = rl_losses.grpo_loss(x, target.to(device), adv.to(device), old.to(device), loss_type=name,
                                  loss_weights=loss_weights.to(device), divisor=divisor, **options)
        (grad,) = torch.autograd.grad(out.loss, x)
        # verl's seq-mean-token-mean divides by (length + 1e-8): ~3e-10 relative of each row's term.
        torch.testing.assert_close(out.loss.cpu(), theirs[0], rtol=1e-9, atol=1e-10)
        scale = theirs[1].abs().max()
        torch.testing.assert_close(grad.cpu() / scale, theirs[1] / scale, rtol=1e-9, atol=1e-10)
        results.append((out, theirs[2], mask))
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_grpo_matches_verl(name, mode, device):
    for out, metrics, _ in fused_matches_verl(name, mode, CASES[name][0], config_of, device):
        if name.startswith("dppo"):  # pg_clipfrac: the tokens outside the trust region (verl: Σ m + 1e-8)
            clipped = float(out.clipped_fraction_low + out.clipped_fraction_high)
            assert clipped == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-9, abs=1e-12)
            assert 0 < clipped < 1 and float(out.clipped_fraction_low) > 0 and float(out.clipped_fraction_high) > 0
            assert metrics["actor/pg_clipfrac_lower"] > 0  # the inputs reach the truncation cap


def assert_registered_matches_verl(name, mode, dtype, config_of, device="cpu"):
    """rl_losses_<name> as verl's registry returns it (policy_token_loss on ``device``) against verl's <name> (on the
    CPU), both from the same state of the default generator: loss, gradient w.r.t. the log-probs and the same
    metrics, also with verl's global batch sizes; NaN padding not read."""
    logits, target, mask, old, adv, weights = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    lp, old, adv, weights, mask = (t.to(dtype) for t in (lp, old, adv, weights, mask))
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for info in (None, dict(dp_size=4, batch_num_tokens=517, global_batch_size=23, loss_scale_factor=64)):
        cfg, seed, results = config_of(name, info), int(torch.randint(0, 2**31 - 1, ())), []
        for fn, poison, where in ((core_algos.get_policy_loss_fn(name), 0.0, "cpu"),
                                  (core_algos.get_policy_loss_fn(f"rl_losses_{name}"), math.nan, device)):
            x = lp.masked_fill(mask == 0, poison).to(where).requires_grad_(True)
            torch.manual_seed(seed)
            loss, metrics = fn(old.to(where), x, adv.to(where), mask.to(where), mode, cfg, weights.to(where))
            results.append((loss.detach().cpu(), torch.autograd.grad(loss, x)[0].cpu(), metrics))
        theirs, ours = results
        torch.testing.assert_close(ours[0].to(dtype), theirs[0], **tol)
        scale = theirs[1].abs().max()
        torch.testing.assert_close(ours[1] / scale, theirs[1] / scale, **tol)
        assert set(ours[2]) == set(theirs[2])
        for key, value in theirs[2].items():
            assert ours[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_registered_loss_matches_verl(name, mode, dtype, device):
    assert_registered_matches_verl(name, mode, dtype, config_of, device)


def test_registered():
    assert rl_verl.register_verl_policy_losses()
    for name in (*CASES, "clip_cov", "kl_cov", "bypass_mode"):
        assert core_algos.get_policy_loss_fn(f"rl_losses_{name}") is rl_verl.POLICY_LOSSES[f"rl_losses_{name}"]


def test_bad_options():
    logits, target, mask, old, adv, weights = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    with pytest.raises(ValueError, match=r"rl_losses_dro: policy_loss.dro_beta must be a finite value > 0 .* got "
                                         r"dro_beta=None"):
        rl_verl.dro_policy_loss(old, lp, adv, mask, "token-mean", make_config())
    with pytest.raises(RuntimeError, match="gspo: loss_type 'dro' weighs each token's own log-prob ratio"):
        rl_losses.gspo_loss(logits, target, adv, old, torch.zeros_like(target), loss_type="dro", dro_beta=0.5)
    with pytest.raises(RuntimeError, match=r"grpo: loss_type 'dro' needs dro_beta \(verl's policy_loss.dro_beta\)"):
        rl_losses.grpo_loss(logits, target, adv, old, loss_type="dro")
    with pytest.raises(ValueError, match="dro_beta must be a value > 0 with loss_type='dro'"):
        config.LanguageModelGRPOLossConfig(loss_type="dro")
    with pytest.raises(ValueError, match="LanguageModelGSPOLossConfig.loss_type must be one of 'ppo_clip'"):
        config.LanguageModelGSPOLossConfig(loss_type="gpg")


def linear_matches_grpo(name, options, device="cpu"):
    """The fused lm_head form takes the same loss types (the options lists are shared): loss, metrics and the
    gradients w.r.t. the hidden states and the weight equal those through grpo on hidden @ weight.T, both from the
    same state of the default generator."""
    logits, target, mask, old, adv, weights = batch()
    hidden = torch.randn(*target.shape, 16, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(logits.shape[-1], 16, dtype=torch.float64, device=device, requires_grad=True)
    target, adv, old, seed = target.to(device), adv.to(device), old.to(device), int(torch.randint(0, 2**31 - 1, ()))
    torch.manual_seed(seed)
    ours = rl_losses.linear_grpo_loss(hidden, weight, target, adv, old, loss_type=name, **options)
    grads = torch.autograd.grad(ours.loss, (hidden, weight))
    torch.manual_seed(seed)
    theirs = rl_losses.grpo_loss(hidden @ weight.T, target, adv, old, loss_type=name, **options)
    expected = torch.autograd.grad(theirs.loss, (hidden, weight))
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-14)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for field in ("clipped_fraction_low", "clipped_fraction_high", "ratio_mean"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(CASES))
def test_linear_grpo_matches_grpo(name, device):
    linear_matches_grpo(name, CASES[name][0], device)


@pytest.mark.parametrize("cap", [None, 1.2])
def test_decoupled_ppo(cap):
    """Decoupled (three-policy) PPO is grpo with old_log_probs = π_proximal (the clip's anchor) and the rollout
    correction from π_behaviour: token_mask with bounds (0, cap), no upper bound without a cap. Loss, gradient
    w.r.t. the logits and metrics against reference_verl.decoupled_ppo (AReaL's formula)."""
    logits, target, mask, proximal, adv, _ = batch()
    behaviour = proximal + 0.2 * torch.randn_like(proximal)
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    options = dict(clip_low=0.15, clip_high=0.25, behaviour_weight_cap=cap)
    loss, metrics = reference_verl.decoupled_ppo(proximal, behaviour, lp, adv, mask, **options)
    (expected,) = torch.autograd.grad(loss, x)
    y = logits.clone().requires_grad_(True)
    out = rl_losses.grpo_loss(y, target, adv, proximal, epsilon_low=0.15, epsilon_high=0.25,
                              rollout_log_probs=behaviour, rollout_correction="token_mask",
                              rollout_mask_bounds=(0.0, math.inf if cap is None else cap))
    (grad,) = torch.autograd.grad(out.loss, y)
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-13)
    assert float(out.clipped_fraction_low + out.clipped_fraction_high) == pytest.approx(float(metrics["pg_clipfrac"]))
    assert float(out.rollout_weight_mean) == pytest.approx(float(metrics["behav_imp_weight"]))
    assert 0 < float(metrics["pg_clipfrac"]) < 1
    if cap is not None:  # the cap rejects some tokens
        assert 0 < float(out.rollout_corrected_fraction) < 1


@pytest.mark.parametrize("rules,thresholds", [("token_k1", "0.8_1.25"), ("token_k3,seq_mean_k2", "0.02,0.03")])
@pytest.mark.parametrize("mode", list(aggregation.VERL_LOSS_AGG_MODES))
def test_rollout_rejection_with_importance_weights(rules, thresholds, mode):
    """verl's rollout rejection (rollout_rs) changes the response mask before the loss, and its token-level
    importance weights (rollout_is="token", truncated) multiply the loss: the op takes the rejected tokens as
    unlabelled (target −100) and the weights as its token_truncate correction from the same rollout log-probs;
    the presets' weights and divisors then come from the mask after rejection. Loss and gradient w.r.t. the
    logits against verl's pipeline (compute_rollout_correction_and_rejection_mask, then vanilla)."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    logits, target, mask, old, adv, _ = batch()
    rollout = old + 0.15 * torch.randn_like(old)
    weights, kept, _ = helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=1.5, rollout_rs=rules,
        rollout_rs_threshold=thresholds)
    assert 0 < kept.sum() < mask.sum()  # some tokens rejected
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    cfg = make_config(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(old, lp, adv, kept, mode, cfg,
                                                        weights.batch["rollout_is_weights"])
    (expected,) = torch.autograd.grad(loss, x)
    loss_weights, divisor = aggregation_of(mode, kept)
    y = logits.clone().requires_grad_(True)
    out = rl_losses.grpo_loss(y, target.masked_fill(kept == 0, -100), adv, old, delta=3.0,
                              rollout_log_probs=rollout, rollout_correction="token_truncate", rollout_cap=1.5,
                              loss_weights=loss_weights, divisor=divisor)
    (grad,) = torch.autograd.grad(out.loss, y)
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-9, atol=1e-10)
    scale = expected.abs().max()
    torch.testing.assert_close(grad / scale, expected / scale, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_matches_verl(loss_type, mode, device):
    """rl_losses_bypass_mode against verl's bypass_mode (old_log_prob = the rollout's): token-level weights
    truncated at 1.5 and token_k1 rejection of the current log-probs against the rollout's, then ppo_clip on the
    kept tokens, or −A·lp times the weights; loss, gradient w.r.t. the log-probs and verl's metrics."""
    algorithm = pytest.importorskip("verl.trainer.config.algorithm")
    rc = algorithm.RolloutCorrectionConfig(bypass_mode=True, loss_type=loss_type, rollout_is="token",
                                           rollout_is_threshold=1.5, rollout_rs="token_k1",
                                           rollout_rs_threshold="0.75_1.3")
    cfg = make_config(policy_loss=verl_config.PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc))
    logits, target, mask, rollout, adv, _ = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    results = []
    for fn, where in ((core_algos.get_policy_loss_fn("bypass_mode"), "cpu"),
                      (core_algos.get_policy_loss_fn("rl_losses_bypass_mode"), device)):
        x = lp.to(where).requires_grad_(True)
        loss, metrics = fn(rollout.to(where), x, adv.to(where), mask.to(where), mode, cfg, None)
        results.append((loss.detach().cpu(), torch.autograd.grad(loss, x)[0].cpu(), metrics))
    (loss, grad, metrics), (ours, our_grad, our_metrics) = results
    # (verl's seq-mean-token-mean divides by length + 1e-8: ~3e-10 relative)
    torch.testing.assert_close(ours, loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(our_grad, grad, rtol=1e-9, atol=1e-10)
    assert set(our_metrics) == set(metrics)
    for key, value in metrics.items():
        assert our_metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-10), key
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
