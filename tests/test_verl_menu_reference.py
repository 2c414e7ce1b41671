"""rl_losses.reference_verl (the float64 references of verl's policy losses that the fused ops do not have yet)
against verl's own registered functions (verl 0.9.1, verl/trainer/ppo/core_algos.py) on fresh random ragged
batches: the loss, its gradient w.r.t. the log-probs and verl's metrics, for each loss_agg_mode, with and without
rollout importance weights and verl's global batch sizes."""
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

from rl_losses import reference_verl  # noqa: E402

from helpers_verl import make_config, make_inputs, run  # noqa: E402

MODES = list(reference_verl.LOSS_AGG_MODES)
# name -> (the reference's options, verl's ActorConfig overrides, verl's PolicyLossConfig overrides)
CASES = {
    "gpg": ({}, {}, {}),
    "dro": (dict(beta=0.7), {}, dict(dro_beta=0.7)),
    "geo_mean": (dict(clip_low=0.15, clip_high=0.25), dict(clip_ratio_low=0.15, clip_ratio_high=0.25), {}),
    "clip_cov": (dict(clip_low=0.15, clip_high=0.25, clip_cov_ratio=0.02, clip_cov_lb=0.3, clip_cov_ub=2.0),
                 dict(clip_ratio_low=0.15, clip_ratio_high=0.25),
                 dict(clip_cov_ratio=0.02, clip_cov_lb=0.3, clip_cov_ub=2.0)),
    "kl_cov": (dict(kl_cov_ratio=0.03, ppo_kl_coef=0.4), {}, dict(kl_cov_ratio=0.03, ppo_kl_coef=0.4)),
    "dppo_tv": (dict(clip_low=0.1, clip_high=0.15, clip_ratio_c=1.5),
                dict(clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1.5), {}),
    "dppo_kl": (dict(clip_low=0.02, clip_high=0.03, clip_ratio_c=1.5),
                dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=1.5), {}),
}
GLOBAL_BATCH_INFO = dict(dp_size=4, batch_num_tokens=517, global_batch_size=23, loss_scale_factor=64)


def inputs(token_advantages):
    """verl's (B, T) inputs on a fresh seed: advantages per sequence (as GMPO assumes) or per token."""
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=int(torch.randint(1 << 30, ())))
    if token_advantages:
        adv = adv + torch.randn_like(adv)
    return lp, old, 2 * adv, weights, mask


def both(name, mode, lp, old, adv, mask, weights, global_batch_info=None):
    """(loss, gradient, metrics) of verl's function and of the reference, the same global RNG state for each."""
    options, overrides, policy = CASES[name]
    config = make_config(global_batch_info, policy_loss=verl_config.PolicyLossConfig(loss_mode=name, **policy),
                         **overrides)
    seed = int(torch.randint(1 << 30, ()))
    torch.manual_seed(seed)
    theirs = run(core_algos.get_policy_loss_fn(name), lp, old, adv, mask, mode, config, weights)

    def ours(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, _config, rollout_is_weights):
        return reference_verl.policy_loss(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                          rollout_is_weights=rollout_is_weights,
                                          global_batch_info=global_batch_info, **options)

    torch.manual_seed(seed)
    return theirs, run(ours, lp, old, adv, mask, mode, None, weights)


def assert_matches(theirs, ours):
    # verl divides by (count + 1e-8) where the references divide by the count: ~3e-10 relative at >= 32 tokens.
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-9, atol=1e-10)
    scale = theirs[1].abs().max().clamp_min(1e-30)
    torch.testing.assert_close(ours[1] / scale, theirs[1] / scale, rtol=1e-9, atol=1e-10)
    assert set(ours[2]) == set(theirs[2])
    for key, value in theirs[2].items():
        assert float(ours[2][key]) == pytest.approx(value, rel=1e-9, abs=1e-10), key


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,token_advantages",  # verl's geo_mean takes one advantage per sequence
                         [(name, t) for name in CASES for t in (False, True) if not (name == "geo_mean" and t)])
def test_matches_verl(name, mode, token_advantages):
    lp, old, adv, weights, mask = inputs(token_advantages)
    for rollout_is_weights in (None, weights):
        assert_matches(*both(name, mode, lp, old, adv, mask, rollout_is_weights))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_global_batch_info(name, mode):
    """verl's data-parallel normalisation (dp_size, the global token and sequence counts, the norm constant)."""
    lp, old, adv, weights, mask = inputs(token_advantages=False)
    assert_matches(*both(name, mode, lp, old, adv, mask, weights, GLOBAL_BATCH_INFO))


def test_cases_exercise_their_branches():
    """The inputs reach each loss's selective branch: clipped and truncated tokens, rejected divergences, a
    random clip_cov subset drawn from more candidates than it keeps, kl_cov's penalty changing the loss."""
    lp, old, adv, weights, mask = inputs(token_advantages=True)
    metrics = {name: reference_verl.policy_loss(name, old, lp, adv, mask, **CASES[name][0])[1] for name in CASES}
    for name, key in [("geo_mean", "actor/pg_clipfrac"), ("geo_mean", "actor/pg_clipfrac_lower"),
                      ("dppo_tv", "actor/pg_clipfrac"), ("dppo_tv", "actor/pg_clipfrac_lower"),
                      ("dppo_kl", "actor/pg_clipfrac"), ("clip_cov", "actor/pg_clipfrac")]:
        assert 0 < metrics[name][key] < 1, (name, key)
    subsets = {tuple(reference_verl.clip_cov(old, lp, adv, mask, **CASES["clip_cov"][0])[0].eq(0).nonzero().
                     flatten().tolist()) for _ in range(4)}
    assert len(subsets) > 1
    options = CASES["kl_cov"][0]
    penalised = reference_verl.kl_cov(old, lp, adv, mask, **options)[0]
    plain = reference_verl.kl_cov(old, lp, adv, mask, kl_cov_ratio=options["kl_cov_ratio"], ppo_kl_coef=0.0)[0]
    assert int((mask > 0).sum() * options["kl_cov_ratio"]) == (penalised != plain).sum() > 0


def test_bad_options():
    lp, old, adv, weights, mask = inputs(token_advantages=False)
    with pytest.raises(ValueError, match="dro: beta .* must be > 0, got beta=0.0"):
        reference_verl.dro(old, lp, adv, mask, beta=0.0)
    with pytest.raises(ValueError, match="clip_cov: clip_cov_ratio must be > 0, got clip_cov_ratio=0"):
        reference_verl.clip_cov(old, lp, adv, mask, clip_cov_ratio=0)
    with pytest.raises(ValueError, match="kl_cov: kl_cov_ratio must be > 0, got kl_cov_ratio=-0.1"):
        reference_verl.kl_cov(old, lp, adv, mask, kl_cov_ratio=-0.1)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of .* got 'seq-sum'"):
        reference_verl.aggregate(lp, mask, "seq-sum")


# rollout_rs option -> (upper, lower): thresholds that reject part of make_inputs' tokens and rows.
REJECTION = {"token_k1": (1.3, 0.75), "token_k2": (0.05, None), "token_k3": (0.05, None),
             "seq_sum_k1": (3.0, 0.6), "seq_sum_k2": (2.2, None), "seq_sum_k3": (2.2, None),
             "seq_mean_k1": (1.03, 0.97), "seq_mean_k2": (0.045, None), "seq_mean_k3": (0.045, None),
             "seq_max_k2": (0.3, None), "seq_max_k3": (0.3, None)}


def verl_threshold(option, upper, lower):
    return f"{lower}_{upper}" if lower is not None else str(upper)


@pytest.mark.parametrize("options", [[o] for o in REJECTION] + [["token_k1", "seq_mean_k3"],
                                                                ["seq_sum_k2", "seq_max_k3", "token_k3"]])
def test_rejection_mask_matches_verl(options):
    """verl's rollout rejection (rollout_corr_helper.compute_rollout_rejection_mask): the kept mask and the
    masked fractions, alone and chained; k1 also with its default lower bound 1/upper."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    lp, old, adv, weights, mask = make_inputs(torch.float64, seed=int(torch.randint(1 << 30, ())), batch=16)
    log_ratio = lp - old
    for default_lower in (False, True):
        rules = [(o, REJECTION[o][0], None if default_lower else REJECTION[o][1]) for o in options]
        theirs_mask, theirs = helper.compute_rollout_rejection_mask(
            log_ratio, mask, ",".join(options), ",".join(verl_threshold(*rule) for rule in rules))
        ours_mask, ours = reference_verl.rejection_mask(log_ratio, mask, rules)
        torch.testing.assert_close(ours_mask, theirs_mask, rtol=0, atol=0)
        for key, value in ours.items():
            assert float(value) == pytest.approx(theirs[key], rel=1e-9, abs=1e-10), key  # verl: Σ m + 1e-8
        assert 0 < theirs["rollout_rs_masked_fraction"] < 1


def test_rejection_mask_bad_rule():
    lp, old, adv, weights, mask = inputs(token_advantages=False)
    with pytest.raises(ValueError, match="rejection_mask: unknown rule 'seq_min_k2'"):
        reference_verl.rejection_mask(lp - old, mask, [("seq_min_k2", 1.0, None)])
