"""clip_cov and kl_cov (verl's Clip-Cov and KL-Cov) as loss types of grpo, linear_grpo and policy_token_loss, and
registered in verl as rl_losses_clip_cov / rl_losses_kl_cov, against verl's own functions (verl 0.9.1,
compute_policy_loss_clip_cov / _kl_cov) and the float64 references on fresh random ragged (B, T) batches: the loss,
its gradient w.r.t. the logits (the log-probs for policy_token_loss) and verl's metrics, for every loss_agg_mode.
clip_cov's random subset: the op ranks the candidates by keys drawn on its device (no host synchronisation), verl
takes the first k of torch.randperm on the CPU; verl's randperm is given the op's draw (`verl_draws_as_the_op`), so
that the two agree from the same seed."""
from unittest import mock

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

import rl_losses  # noqa: E402
from rl_losses import config, reference, reference_verl  # noqa: E402
from rl_losses.integrations import verl as rl_verl  # noqa: E402

from helpers_verl import make_config  # noqa: E402
from test_verl_menu_ops import (MODES, assert_registered_matches_verl, batch, fused_matches_verl,  # noqa: E402
                               linear_matches_grpo)

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


def randperm_as_the_op(candidates, device):
    """torch.randperm(#candidates), whose first k give verl its subset, patched to the op's clip_cov draw from the
    generator's current state: the candidates (in index order) ordered by the keys torch.rand(N, dtype=float64) on
    ``device``."""
    keys = torch.rand(candidates.numel(), dtype=torch.float64, device=device).cpu()
    order = torch.argsort(keys[candidates.reshape(-1).cpu()], stable=True)

    def randperm(n, **_):
        assert n == order.numel(), (n, order.numel())
        return order

    return mock.patch.object(torch, "randperm", randperm)


def candidates_of(old, lp, adv, mask, options=CASES["clip_cov"][0]):
    return reference_verl.clip_cov_candidates(old, lp.detach(), adv, mask, clip_low=options["epsilon_low"],
                                              clip_high=options["epsilon_high"], clip_cov_lb=options["clip_cov_lb"],
                                              clip_cov_ub=options["clip_cov_ub"])


def draw_as_the_op(device, monkeypatch, options):
    """verl's clip_cov (its registry's) with its torch.randperm(#candidates) returning the op's draw on ``device``,
    taken from the generator's state at the call, as the op takes it (the candidates under ``options``)."""
    verl_clip_cov = core_algos.get_policy_loss_fn("clip_cov")

    def clip_cov(old_log_prob, log_prob, advantages, response_mask, *args, **kwargs):
        with randperm_as_the_op(candidates_of(old_log_prob, log_prob, advantages, response_mask, options), device):
            return verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, *args, **kwargs)

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "clip_cov", clip_cov)


@pytest.fixture
def verl_draws_as_the_op(device, monkeypatch):
    draw_as_the_op(device, monkeypatch, CASES["clip_cov"][0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_grpo_matches_verl(name, mode, device, verl_draws_as_the_op):
    for out, metrics, mask in fused_matches_verl(name, mode, CASES[name][0], config_of, device):
        if name == "clip_cov":  # pg_clipfrac: the subset, k of its many candidates (verl: Σ m + 1e-8)
            n = int((mask > 0).sum())
            k = max(int(CASES[name][0]["clip_cov_ratio"] * n), 1)
            assert float(out.clipped_fraction_high) == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-9)
            assert float(out.clipped_fraction_high) * n == pytest.approx(k) and k > 1
        assert float(out.clipped_fraction_low) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_registered_loss_matches_verl(name, mode, dtype, device, verl_draws_as_the_op):
    assert_registered_matches_verl(name, mode, dtype, config_of, device)


@pytest.mark.parametrize("case", ["clip_cov", "kl_cov", "kl_cov-on-policy", "clip_cov-options"])
def test_grpo_matches_reference(case, device):
    """grpo against reference.grpo_loss (reference_verl's subsets) with the policy family's other terms: the
    rollout correction, the KL penalty, the entropy bonus, loss weights; on-policy kl_cov's penalty is 0. The
    reference runs on the op's device: clip_cov's keys come from that device's generator."""
    name = case.split("-")[0]
    logits, target, mask, old, adv, weights = batch()
    options = dict(CASES[name][0])
    if case.endswith("options"):
        options.update(rollout_correction="token_truncate", rollout_cap=1.2, rollout_log_probs=old + 0.1,
                       ref_log_probs=old - 0.2, beta=0.05, entropy_coefficient=0.01, loss_weights=weights)
    on_policy = case.endswith("on-policy")
    old = None if on_policy else old
    results, seed = [], fresh_seed()
    for fn, where in ((reference.grpo_loss, device), (rl_losses.grpo_loss, device)):
        x = logits.to(where).requires_grad_(True)
        moved = {k: v.to(where) if torch.is_tensor(v) else v for k, v in options.items()}
        torch.manual_seed(seed)
        out = fn(x, target.to(where), adv.to(where), None if old is None else old.to(where), loss_type=name, **moved)
        results.append((out, torch.autograd.grad(out.loss, x)[0].cpu()))
    (theirs, expected), (ours, grad) = results
    if name == "clip_cov":  # the draw decides: k of more candidates
        lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        n = int((mask > 0).sum())
        k = max(int(options["clip_cov_ratio"] * n), 1)
        assert float(ours.clipped_fraction_high) * n == pytest.approx(k)
        assert 1 < k < int(candidates_of(old, lp, adv, mask).sum())
    torch.testing.assert_close(ours.loss.cpu(), theirs.loss.cpu(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    for field in ("clipped_fraction_low", "clipped_fraction_high", "ratio_mean", "kl_old", "kl", "entropy"):
        if getattr(theirs, field) is not None:
            torch.testing.assert_close(getattr(ours, field).cpu(), getattr(theirs, field).cpu(), rtol=1e-10,
                                       atol=1e-12)
    if on_policy:  # −A·r alone (r = 1, no clip reached): the penalty's |δ| = 0
        plain = reference.grpo_loss(logits, target, adv, None).loss
        torch.testing.assert_close(ours.loss.cpu(), plain, rtol=1e-10, atol=1e-12)


def many(name, ratio):
    """A case (CASES' layout) selecting many tokens: clip_cov's band holds nearly every token, so that its subset
    is k = ⌊ratio·N⌋ of more candidates; kl_cov's top k leaves the rest of the sort's first rows unselected."""
    if name == "clip_cov":
        band = dict(clip_cov_ratio=ratio, clip_cov_lb=-50.0, clip_cov_ub=50.0)
        return (dict(epsilon_low=0.15, epsilon_high=0.25, **band), dict(clip_ratio_low=0.15, clip_ratio_high=0.25),
                band)
    return dict(kl_cov_ratio=ratio, ppo_kl_coef=0.4), {}, dict(kl_cov_ratio=ratio, ppo_kl_coef=0.4)


# grpo over the batch's 512 rows: a bound max(⌊ratio·512⌋, 1) of at most 64 rows (an eighth) runs the selected rows
# again after the loss pass (0.02: 10 rows, found by sweeps of the keys; 0.1: 51 rows, by a sort; most of them
# selected); past it a statistics pass comes first (0.5).
RATIOS = [0.02, 0.1, 0.5]


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", list(CASES))
def test_many_selected_match_verl(name, mode, ratio, device, monkeypatch):
    """Many tokens selected, through both of grpo's orders (the loss pass first, whose selected rows then run
    again; or a statistics pass first): the loss and the gradient w.r.t. the logits equal verl's."""
    case = many(name, ratio)
    draw_as_the_op(device, monkeypatch, many("clip_cov", ratio)[0])

    def config(loss_mode, global_batch_info=None):
        return make_config(global_batch_info, policy_loss=verl_config.PolicyLossConfig(loss_mode=loss_mode, **case[2]),
                           **case[1])

    for out, metrics, mask in fused_matches_verl(name, mode, case[0], config, device):
        n = int((mask > 0).sum())
        if name == "clip_cov":  # k of more candidates (0.1), or most of the candidates (0.5)
            selected = float(out.clipped_fraction_high) * n
            assert selected == pytest.approx(int(ratio * n)) if ratio < 0.2 else 0.25 * n < selected <= ratio * n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_many_selected_low_precision(name, inplace, dtype, device):
    """16-bit logits (fp16: each gradient row stored pre-scaled by its own power of two, a selected row's
    different from its first pass's), with the sampler's top_k floors, and inplace_backward (which keeps a
    statistics pass before the loss pass): the loss, log-probs and gradient against the float64 reference on the
    same rounded logits."""
    logits, target, mask, old, adv, weights = batch(vocab=33)
    logits = logits.to(dtype)
    options = dict(many(name, RATIOS[0])[0], top_k=20)
    results, seed = [], fresh_seed()
    for fn, x in ((reference.grpo_loss, logits.double()), (rl_losses.grpo_loss, logits.to(device))):
        x = x.clone().requires_grad_(True)
        torch.manual_seed(seed)
        kw = dict(inplace_backward=True) if inplace and fn is rl_losses.grpo_loss else {}
        out = fn(x.clone() if kw else x, target.to(x.device), adv.to(x.device), old.to(x.device), loss_type=name,
                 loss_weights=weights.to(x.device), **options, **kw)
        results.append((out, torch.autograd.grad(out.loss, x)[0].double().cpu()))
    (theirs, expected), (ours, grad) = results
    torch.testing.assert_close(ours.loss.double().cpu(), theirs.loss, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(ours.log_probs.double().cpu(), theirs.log_probs.double(), rtol=1e-5, atol=1e-5)
    scale = expected.abs().max()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grad / scale, expected / scale, rtol=4 * eps, atol=4 * eps)


@pytest.mark.parametrize("name", list(CASES))
def test_linear_grpo_matches_grpo(name, device):
    linear_matches_grpo(name, CASES[name][0], device)


def test_subset_follows_the_generator(device):
    """clip_cov's subset is a draw from the default generator of the op's device: the same seed gives the same
    loss, another seed (almost surely) another subset; kl_cov's top k does not depend on it."""
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
    tokens only, their statistics over the mask; clip_cov's torch.randperm given the op's draw)."""
    logits, target, mask, old, adv, weights = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    for name, fn in (("clip_cov", reference_verl.clip_cov), ("kl_cov", reference_verl.kl_cov)):
        options, verl_options, seed = CASES[name][0], dict(CASES[name][2]), fresh_seed()
        if name == "clip_cov":
            verl_options.update(clip_low=options["epsilon_low"], clip_high=options["epsilon_high"])
        x = lp.clone().requires_grad_(True)
        torch.manual_seed(seed)
        with randperm_as_the_op(candidates_of(old, lp, adv, mask), device):
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
