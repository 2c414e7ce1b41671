"""rl_losses' policy losses in verl's policy-loss registry (rl_losses.integrations.verl) against verl's own
registered losses (verl 0.9.1, verl/trainer/ppo/core_algos.py) on the same per-token inputs: the loss, its
gradient w.r.t. the log-probs and verl's metrics, for each loss_agg_mode, verl's global batch sizes and its
rollout importance-sampling weights (float64 to 1e-9, float32 to 1e-6)."""
import math

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from rl_losses.integrations import verl as rl_verl  # noqa: E402

from helpers_verl import make_config, make_inputs, run  # noqa: E402

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
PAIRS = {  # ours -> (verl's, config overrides)
    "rl_losses_ppo_clip": ("vanilla", dict(clip_ratio_low=0.15, clip_ratio_high=0.25, clip_ratio_c=1.6)),
    "rl_losses_gspo": ("gspo", dict(clip_ratio_low=0.05, clip_ratio_high=0.08)),
    "rl_losses_sapo": ("sapo", dict(tau_pos=0.8, tau_neg=1.3)),
    "rl_losses_cispo": ("cispo", dict(clip_ratio_low=1.0, clip_ratio_high=0.2)),
    "rl_losses_geo_mean": ("geo_mean", dict(clip_ratio_low=0.15, clip_ratio_high=0.25)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PAIRS))
def test_matches_verl(name, mode, dtype):
    verl_name, overrides = PAIRS[name]
    config = make_config(**overrides)
    lp, old, adv, weights, mask = make_inputs(dtype, seed=len(name) + len(mode))
    for rollout_is_weights in (None, weights):
        theirs = run(core_algos.get_policy_loss_fn(verl_name), lp, old, adv, mask, mode, config, rollout_is_weights)
        ours = run(getattr(rl_verl, rl_verl.POLICY_LOSSES[name].__name__), lp, old, adv, mask, mode, config,
                   rollout_is_weights)
        # verl's seq-mean-token-mean divides by (length + 1e-8): ~3e-10 of each sequence's term here, which the
        # cancelling sum over sequences can leave as 1e-8 of the total: an absolute bound there.
        per_sequence = mode == "seq-mean-token-mean" or name in ("rl_losses_sapo", "rl_losses_geo_mean")
        tol = (dict(rtol=1e-9, atol=1e-10 if per_sequence else 1e-12) if dtype == torch.float64
               else dict(rtol=1e-6, atol=1e-7))
        torch.testing.assert_close(ours[0].to(dtype), theirs[0], **tol)
        scale = theirs[1].abs().max()
        torch.testing.assert_close(ours[1] / scale, theirs[1] / scale, **tol)
        for key, value in theirs[2].items():
            assert ours[2][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    if name == "rl_losses_ppo_clip":
        assert theirs[2]["actor/pg_clipfrac"] > 0 and theirs[2]["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_global_batch_info(mode):
    """verl's data-parallel normalisation (dp_size, the global token and sequence counts, the norm constant)."""
    info = dict(dp_size=4, batch_num_tokens=517, global_batch_size=23, loss_scale_factor=64)
    config = make_config(info, clip_ratio_low=0.15)
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=7)
    theirs = run(core_algos.get_policy_loss_fn("vanilla"), lp, old, adv, mask, mode, config, weights)
    ours = run(rl_verl.ppo_clip_policy_loss, lp, old, adv, mask, mode, config, weights)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-9, atol=1e-12)


def test_registered():
    assert rl_verl.register_verl_policy_losses()
    for name, fn in rl_verl.POLICY_LOSSES.items():
        assert core_algos.get_policy_loss_fn(name) is fn


def test_bad_options():
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=1)
    with pytest.raises(ValueError, match="set clip_ratio_low >= 1 .* got clip_ratio_low=0.2"):
        rl_verl.cispo_policy_loss(old, lp, adv, mask, "token-mean", make_config(clip_ratio_low=0.2))
    with pytest.raises(ValueError, match="loss_agg_mode must be one of .* got 'seq-sum'"):
        rl_verl.ppo_clip_policy_loss(old, lp, adv, mask, "seq-sum", make_config())
    with pytest.raises(ValueError, match=r"clip_ratio_c \(dual-clip PPO's cap .* must be > 1, as verl's vanilla "
                                         r"asserts, got clip_ratio_c=1.0"):
        rl_verl.ppo_clip_policy_loss(old, lp, adv, mask, "token-mean", make_config(clip_ratio_c=1.0))
    # the op's own checks, under verl's names
    with pytest.raises(ValueError, match=r"clip_ratio_low must be in \[0, 1\) .* got clip_ratio_low=1.0"):
        rl_verl.gspo_policy_loss(old, lp, adv, mask, "token-mean", make_config(clip_ratio_low=1.0))
    with pytest.raises(ValueError, match="clip_ratio_high must be finite and >= 0, got clip_ratio_high=-0.1"):
        rl_verl.ppo_clip_policy_loss(old, lp, adv, mask, "token-mean", make_config(clip_ratio_high=-0.1))
    with pytest.raises(ValueError, match="rl_losses_sapo: tau_neg must be finite and > 0, got tau_neg=0.0"):
        rl_verl.sapo_policy_loss(old, lp, adv, mask, "token-mean", make_config(tau_neg=0.0))


@pytest.mark.parametrize("clip_ratio_c", [1.05, 1.2, 1.25, 2.0])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_dual_clip_below_clip_high(clip_ratio_c, mode):
    """verl's dual clip caps the ratio where A < 0 only, at any clip_ratio_c > 1, also at or below 1 + ε_h
    (where the op's δ would cap A > 0 too): loss, gradient and metrics as verl's."""
    config = make_config(clip_ratio_low=0.2, clip_ratio_high=0.25, clip_ratio_c=clip_ratio_c)
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=int(clip_ratio_c * 100))
    old = lp + 1.2 * (old - lp).sign() * (old - lp).abs().sqrt()  # ratios from about 0.3 to 3
    theirs = run(core_algos.get_policy_loss_fn("vanilla"), lp, old, adv, mask, mode, config, weights)
    ours = run(rl_verl.ppo_clip_policy_loss, lp, old, adv, mask, mode, config, weights)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-9, atol=1e-12)
    for key, value in theirs[2].items():
        assert ours[2][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert theirs[2]["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("name", list(PAIRS))
def test_padding_is_not_read(name, poison):
    """NaN or inf in the padded entries of log_prob, old_log_prob, advantages and the rollout weights: loss,
    gradient and metrics as verl's on the cleaned inputs, every loss_agg_mode; the padding's gradient 0."""
    verl_name, overrides = PAIRS[name]
    config = make_config(**overrides)
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=len(name))
    padded = mask == 0
    clean = [t.masked_fill(padded, 0.0) for t in (lp, old, adv, weights)]
    dirty = [t.masked_fill(padded, poison) for t in clean]
    for mode in MODES:
        theirs = run(core_algos.get_policy_loss_fn(verl_name), *clean[:3], mask, mode, config, clean[3])
        ours = run(rl_verl.POLICY_LOSSES[name], *dirty[:3], mask.bool(), mode, config, dirty[3])
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-9, atol=1e-10)
        assert torch.count_nonzero(ours[1][padded]) == 0
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-9, atol=1e-10)
        for key, value in theirs[2].items():
            assert ours[2][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_needs_global_counts(mode):
    """dp_size > 1 without the global count the mode divides by: refused, as verl's agg_loss refuses it."""
    config = make_config(dict(dp_size=2), clip_ratio_low=0.15)
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=5)
    if mode == "token-sum":  # no count needed: each rank's sum times dp_size
        theirs = run(core_algos.get_policy_loss_fn("vanilla"), lp, old, adv, mask, mode, config, weights)
        ours = run(rl_verl.ppo_clip_policy_loss, lp, old, adv, mask, mode, config, weights)
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-9, atol=1e-12)
        return
    needed = "batch_num_tokens" if mode == "token-mean" else "global_batch_size"
    with pytest.raises(ValueError, match=needed):
        run(core_algos.get_policy_loss_fn("vanilla"), lp, old, adv, mask, mode, config, weights)
    with pytest.raises(ValueError, match=f"loss_agg_mode='{mode}' with dp_size = 2 needs "
                                         f"global_batch_info\\['{needed}'\\]"):
        run(rl_verl.ppo_clip_policy_loss, lp, old, adv, mask, mode, config, weights)
