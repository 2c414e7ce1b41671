"""clip_cov and kl_cov (verl's Clip-Cov and KL-Cov) as loss types of grpo, linear_grpo and policy_token_loss, and
registered in verl as rl_losses_clip_cov / rl_losses_kl_cov, against verl's own functions (verl 0.9.1,
compute_policy_loss_clip_cov / _kl_cov) and the float64 references on fresh random ragged (B, T) batches: the loss,
its gradient w.r.t. the logits (the log-probs for policy_token_loss) and verl's metrics, for every loss_agg_mode.
clip_cov's random subset: the op draws torch.randperm from the default CPU generator as verl does, so that the two
agree from the same seed."""
import math

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

import rl_losses  # noqa: E402
from rl_losses import config, reference, reference_verl  # noqa: E402
from rl_losses.integrations import verl as rl_verl  # noqa: E402

from helpers_verl import make_config  # noqa: E402
from test_verl_menu_ops import MODES, aggregation_of, batch  # noqa: E402

# verl's loss_mode -> (the op's options, verl's ActorConfig overrides, verl's PolicyLossConfig overrides); the
# ratios keep a few percent of the tokens, the band [lb, ub] many candidates: clip_cov's draw decides its subset.
CASES = {
    "clip_cov": (dict(epsilon_low=0.15, epsilon_high=0.25, clip_cov_ratio=0.04, clip_cov_lb=0.2, clip_cov_ub=3.0),
                 dict(clip_ratio_low=0.15, clip_ratio_high=0.25),
                 dict(clip_cov_ratio=0.04, clip_cov_lb=0.2, clip_cov_ub=3.0)),
    "kl_cov": (dict(kl_cov_ratio=0.05, ppo_kl_coef=0.4), {}, dict(kl_cov_ratio=0.05, ppo_kl_coef=0.4)),
}


def config_of(name, global_batch_info=None):
    _, overrides, policy = CASES[name]
    return make_config(global_batch_info, policy_loss=verl_config.PolicyLossConfig(loss_mode=name, **policy),
                       **overrides)


def fresh_seed():
    return int(torch.randint(0, 2**31 - 1, ()))


def verl_loss(name, mode, logits, target, mask, old, adv, weights, seed):
    """verl's (loss, gradient w.r.t. the logits, metrics) with the default generator at ``seed``."""
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    torch.manual_seed(seed)
    loss, metrics = core_algos.get_policy_loss_fn(name)(old, lp, adv, mask, mode, config_of(name), weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def selected_count(mask, ratio):
    n = int((mask > 0).sum())
    return max(int(ratio * n), 1), n


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_grpo_matches_verl(name, mode, device):
    logits, target, mask, old, adv, weights = batch()
    for rollout_is_weights in (None, weights):
        seed = fresh_seed()
        theirs = verl_loss(name, mode, logits, target, mask, old, adv, rollout_is_weights, seed)
        loss_weights, divisor = aggregation_of(mode, mask)
        if rollout_is_weights is not None:
            loss_weights = loss_weights * rollout_is_weights
        x = logits.to(device).requires_grad_(True)
        torch.manual_seed(seed)
        out = rl_losses.grpo_loss(x, target.to(device), adv.to(device), old.to(device), loss_type=name,
                                  loss_weights=loss_weights.to(device), divisor=divisor, **CASES[name][0])
        (grad,) = torch.autograd.grad(out.loss, x)
        torch.testing.assert_close(out.loss.cpu(), theirs[0], rtol=1e-9, atol=1e-10)
        scale = theirs[1].abs().max()
        torch.testing.assert_close(grad.cpu() / scale, theirs[1] / scale, rtol=1e-9, atol=1e-10)
        k, n = selected_count(mask, CASES[name][0].get("clip_cov_ratio", 0.0))
        if name == "clip_cov":  # pg_clipfrac: the subset, k of its many candidates (verl: Σ m + 1e-8)
            assert float(out.clipped_fraction_high) == pytest.approx(theirs[2]["actor/pg_clipfrac"], rel=1e-9)
            assert float(out.clipped_fraction_high) * n == pytest.approx(k) and k > 1
        assert float(out.clipped_fraction_low) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_registered_loss_matches_verl(name, mode, dtype, device):
    """rl_losses_<name> in verl's registry (policy_token_loss on ``device``) against verl's <name> (on the CPU):
    loss, gradient w.r.t. the log-probs and the same metrics, also with verl's global batch sizes; NaN padding
    not read."""
    logits, target, mask, old, adv, weights = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    lp, old, adv, weights, mask = (t.to(dtype) for t in (lp, old, adv, weights, mask))
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for info in (None, dict(dp_size=4, batch_num_tokens=517, global_batch_size=23, loss_scale_factor=64)):
        cfg, seed, results = config_of(name, info), fresh_seed(), []
        for fn, poison, where in ((core_algos.get_policy_loss_fn(name), 0.0, "cpu"),
                                  (rl_verl.POLICY_LOSSES[f"rl_losses_{name}"], math.nan, device)):
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


def test_registered():
    assert rl_verl.register_verl_policy_losses()
    for name in CASES:
        assert core_algos.get_policy_loss_fn(f"rl_losses_{name}") is rl_verl.POLICY_LOSSES[f"rl_losses_{name}"]


@pytest.mark.parametrize("case", ["clip_cov", "kl_cov", "kl_cov-on-policy", "clip_cov-options"])
def test_grpo_matches_reference(case, device):
    """grpo against reference.grpo_loss (reference_verl's subsets) with the policy family's other terms: the
    rollout correction, the KL penalty, the entropy bonus, loss weights; on-policy kl_cov's penalty is 0."""
    name = case.split("-")[0]
    logits, target, mask, old, adv, weights = batch()
    options = dict(CASES[name][0])
    if case.endswith("options"):
        options.update(rollout_correction="token_truncate", rollout_cap=1.2, rollout_log_probs=old + 0.1,
                       ref_log_probs=old - 0.2, beta=0.05, entropy_coefficient=0.01, loss_weights=weights)
    on_policy = case.endswith("on-policy")
    old = None if on_policy else old
    results, seed = [], fresh_seed()
    for fn, where in ((reference.grpo_loss, "cpu"), (rl_losses.grpo_loss, device)):
        x = logits.to(where).requires_grad_(True)
        moved = {k: v.to(where) if torch.is_tensor(v) else v for k, v in options.items()}
        torch.manual_seed(seed)
        out = fn(x, target.to(where), adv.to(where), None if old is None else old.to(where), loss_type=name, **moved)
        results.append((out, torch.autograd.grad(out.loss, x)[0].cpu()))
    (theirs, expected), (ours, grad) = results
    torch.testing.assert_close(ours.loss.cpu(), theirs.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    for field in ("clipped_fraction_low", "clipped_fraction_high", "ratio_mean", "kl_old", "kl", "entropy"):
        if getattr(theirs, field) is not None:
            torch.testing.assert_close(getattr(ours, field).cpu(), getattr(theirs, field), rtol=1e-10, atol=1e-12)
    if on_policy:  # −A·r alone (r = 1, no clip reached): the penalty's |δ| = 0
        plain = reference.grpo_loss(logits, target, adv, None).loss
        torch.testing.assert_close(ours.loss.cpu(), plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_linear_grpo_matches_grpo(name, device):
    """The fused lm_head form (options lists shared): loss, metrics and the gradients w.r.t. the hidden states and
    the weight equal those through grpo on hidden @ weight.T, from the same seed."""
    logits, target, mask, old, adv, weights = batch()
    hidden = torch.randn(*target.shape, 16, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(logits.shape[-1], 16, dtype=torch.float64, device=device, requires_grad=True)
    target, adv, old, seed = target.to(device), adv.to(device), old.to(device), fresh_seed()
    torch.manual_seed(seed)
    ours = rl_losses.linear_grpo_loss(hidden, weight, target, adv, old, loss_type=name, **CASES[name][0])
    grads = torch.autograd.grad(ours.loss, (hidden, weight))
    torch.manual_seed(seed)
    theirs = rl_losses.grpo_loss(hidden @ weight.T, target, adv, old, loss_type=name, **CASES[name][0])
    expected = torch.autograd.grad(theirs.loss, (hidden, weight))
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-14)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for field in ("clipped_fraction_low", "clipped_fraction_high", "ratio_mean"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), rtol=1e-12, atol=1e-14)


def test_subset_follows_the_generator(device):
    """clip_cov's subset is the default CPU generator's draw: the same seed gives the same loss, another seed
    (almost surely) another subset; kl_cov's top k does not depend on it."""
    logits, target, mask, old, adv, weights = batch()
    args = (logits.to(device), target.to(device), adv.to(device), old.to(device))
    losses = {}
    for name in CASES:
        for seed in (1, 1, 2):
            torch.manual_seed(seed)
            losses.setdefault(name, []).append(float(rl_losses.grpo_loss(*args, loss_type=name,
                                                                         **CASES[name][0]).loss))
    assert losses["clip_cov"][0] == losses["clip_cov"][1] != losses["clip_cov"][2]
    assert losses["kl_cov"][0] == losses["kl_cov"][1] == losses["kl_cov"][2]
    # verl's clip_num: k = max(⌊ρ·Σm⌋, 1), at least one even for a tiny ratio
    torch.manual_seed(3)
    out = rl_losses.grpo_loss(*args, loss_type="clip_cov", **dict(CASES["clip_cov"][0], clip_cov_ratio=1e-9))
    assert float(out.clipped_fraction_high) * int((mask > 0).sum()) == pytest.approx(1.0)


def test_policy_token_matches_reference_verl(device):
    """policy_token_loss's per-token loss and gradient equal reference_verl's per-token matrices (the mask's
    tokens only, their statistics over the mask)."""
    logits, target, mask, old, adv, weights = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    for name, fn in (("clip_cov", reference_verl.clip_cov), ("kl_cov", reference_verl.kl_cov)):
        options, verl_options, seed = CASES[name][0], dict(CASES[name][2]), fresh_seed()
        if name == "clip_cov":
            verl_options.update(clip_low=options["epsilon_low"], clip_high=options["epsilon_high"])
        x = lp.clone().requires_grad_(True)
        torch.manual_seed(seed)
        expected = fn(old, x, adv, mask, **verl_options)[0]
        y = lp.to(device).requires_grad_(True)
        torch.manual_seed(seed)
        out = rl_losses.policy_token_loss(y, old.to(device), adv.to(device), loss_mask=mask.to(device) > 0,
                                          loss_type=name, **options)
        on = mask > 0
        torch.testing.assert_close(out.loss.cpu()[on], expected.detach()[on], rtol=1e-12, atol=1e-14)
        (g_ref,) = torch.autograd.grad(torch.where(on, expected, 0.0).sum(), x)
        (g,) = torch.autograd.grad(out.loss.sum(), y)
        torch.testing.assert_close(g.cpu(), g_ref, rtol=1e-12, atol=1e-14)


def test_bad_options():
    logits, target, mask, old, adv, weights = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    with pytest.raises(RuntimeError, match=r"grpo: kl_cov_ratio \(kl_cov's share of the tokens\) must be in "
                                           r"\(0, 1\], got 0"):
        rl_losses.grpo_loss(logits, target, adv, old, loss_type="kl_cov", kl_cov_ratio=0.0)
    with pytest.raises(RuntimeError, match="policy_token_loss: delta .* applies to loss_type 'ppo_clip' only"):
        rl_losses.policy_token_loss(lp, old, adv, loss_type="clip_cov", delta=3.0)
    with pytest.raises(RuntimeError, match="gspo: loss_type 'kl_cov' weighs each token's own log-prob ratio"):
        rl_losses.gspo_loss(logits, target, adv, old, torch.zeros_like(target), loss_type="kl_cov")
    with pytest.raises(ValueError, match="clip_cov_ub must be a value > clip_cov_lb = 5.0"):
        config.LanguageModelGRPOLossConfig(loss_type="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be a finite number > 0.0 and <= 1.0"):
        config.LanguageModelGRPOLossConfig(loss_type="kl_cov", kl_cov_ratio=2.0)
    with pytest.raises(ValueError, match="LanguageModelGSPOLossConfig.loss_type must be one of 'ppo_clip'"):
        config.LanguageModelGSPOLossConfig(loss_type="clip_cov")
    with pytest.raises(RuntimeError, match=r"clip_cov_ratio \(clip_cov's share of the tokens\) must be a finite value "
                                           r"> 0, got -1"):
        rl_verl.clip_cov_policy_loss(old, lp, adv, mask, "token-mean", make_config(
            policy_loss=verl_config.PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=-1.0)))
