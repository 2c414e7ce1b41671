"""verl's rollout rejection fused into the policy ops (rollout_rs, rollout_rs_threshold; grpo's aggregation), against
verl's own pipeline (verl 0.9.1: compute_rollout_correction_and_rejection_mask, then its vanilla loss with the mask
after rejection and its importance weights) on fresh random ragged (B, T) batches: loss, gradient w.r.t. the logits
and metrics, for every rollout_rs mode, every loss_agg_mode and verl's rollout_is levels; gspo and the fused lm_head
forms against the same ops given verl's mask as labels."""
import math

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

import rl_losses  # noqa: E402
from rl_losses import aggregation  # noqa: E402
from rl_losses.integrations import verl as rl_verl  # noqa: E402

from helpers_verl import make_config  # noqa: E402
from test_verl_menu_ops import MODES, aggregation_of, batch  # noqa: E402

RS_MODES = sorted(helper.SUPPORTED_ROLLOUT_RS_OPTIONS)


def _statistic(mode, old, rollout, mask):
    """The mode's statistic per token or per row (to pick thresholds that reject some tokens, not all)."""
    delta = (old - rollout).clamp(-20, 20)
    k = {"1": -delta, "2": 0.5 * delta**2, "3": delta.exp() - 1 - delta}[mode[-1]]
    if mode.startswith("token_"):
        return k[mask > 0]
    rows = mask.sum(-1) > 0
    if mode.startswith("seq_max"):
        return k.masked_fill(mask == 0, -math.inf).amax(-1)[rows]
    total = (k * mask).sum(-1)
    return (total / mask.sum(-1) if mode.startswith("seq_mean") else total)[rows]


def threshold_of(mode, old, rollout, mask):
    """verl's threshold specification keeping about the middle of the statistic's range."""
    s = _statistic(mode, old, rollout, mask).double()
    if mode.endswith("k1"):  # ratio bounds: the statistic is log(ratio)
        lo, hi = torch.quantile(s, 0.15).exp(), torch.quantile(s, 0.85).exp()
        return f"{float(lo)!r}_{float(hi)!r}"
    return repr(float(torch.quantile(s, 0.7)))


def rollout_options(rollout_is):
    """verl's rollout_is at threshold 1.5 as the ops' rollout_correction."""
    if rollout_is is None:
        return {}
    return dict(rollout_correction=f"{rollout_is}_truncate", rollout_cap=1.5)


def grpo_aggregation(mode, mask):
    """verl's loss_agg_mode as grpo's aggregation option (token-sum: Σ, divisor 1)."""
    if mode == "token-sum":
        return dict(divisor=1.0)
    return dict(aggregation=aggregation.VERL_LOSS_AGG_MODES[mode])


def verl_pipeline(logits, target, mask, old, rollout, adv, mode, rules, thresholds, rollout_is):
    """verl's (loss, gradient w.r.t. the logits, kept mask, weights): its rejection and weights, then vanilla."""
    weights, kept, _ = helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=1.5, rollout_rs=rules,
        rollout_rs_threshold=thresholds)
    weights = None if weights is None else weights.batch["rollout_is_weights"]
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    cfg = make_config(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(old, lp, adv, kept, mode, cfg, weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, kept, weights


def assert_metrics(out, logits, target, kept, old, weights):
    """The op's metrics over the tokens verl keeps (float64 from the same inputs)."""
    keep = kept > 0
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)[keep]
    o = old[keep]
    expected = {"new_logprobs": lp.mean(), "ratio_mean": (lp - o).exp().mean(),
                "kl_old": ((o - lp).exp() - (o - lp) - 1).mean()}
    if weights is not None:
        expected["rollout_weight_mean"] = weights[keep].mean()
    for name, value in expected.items():
        torch.testing.assert_close(getattr(out, name), value, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("rollout_is", [None, "token", "sequence"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rules", RS_MODES + ["token_k3,seq_mean_k2", "seq_max_k2,token_k1,seq_sum_k3",
                                   "token_k3,seq_max_k3"])  # the last: one k3 statistic for two rules
def test_grpo_rejection_matches_verl(rules, mode, rollout_is):
    logits, target, mask, old, adv, _ = batch()
    rollout = old + 0.15 * torch.randn_like(old)
    thresholds = ",".join(threshold_of(m, old, rollout, mask) for m in rules.split(","))
    loss, grad, kept, weights = verl_pipeline(logits, target, mask, old, rollout, adv, mode, rules, thresholds,
                                              rollout_is)
    assert 0 < kept.sum() < mask.sum()  # some tokens rejected, not all
    y = logits.clone().requires_grad_(True)
    out = rl_losses.grpo_loss(y, target, adv, old, delta=3.0, rollout_log_probs=rollout, rollout_rs=rules,
                              rollout_rs_threshold=thresholds, **rollout_options(rollout_is),
                              **grpo_aggregation(mode, mask))
    (ours,) = torch.autograd.grad(out.loss, y)
    # (verl's seq-mean-token-mean divides by length + 1e-8: ~3e-10 relative)
    torch.testing.assert_close(out.loss, loss, rtol=1e-9, atol=1e-10)
    scale = grad.abs().max()
    torch.testing.assert_close(ours / scale, grad / scale, rtol=1e-9, atol=1e-10)
    assert_metrics(out, logits, target, kept, old, weights)
    assert torch.all(out.log_probs[kept == 0] == 0)


def test_grpo_rejection_packed_and_label_counts():
    """The sequences of the sequence rules from document_index (here the rows, numbered in reverse) equal the rows'
    own; label_counts given are recounted over the kept tokens (the new_logprobs metric: mean over documents)."""
    logits, target, mask, old, adv, _ = batch()
    rollout = old + 0.15 * torch.randn_like(old)
    rules = "seq_mean_k3,token_k2"
    thresholds = ",".join(threshold_of(m, old, rollout, mask) for m in rules.split(","))
    _, kept, _ = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_rs=rules,
                                                                      rollout_rs_threshold=thresholds)
    options = dict(rollout_log_probs=rollout, rollout_rs=rules, rollout_rs_threshold=thresholds,
                   aggregation="sequence_mean_token_mean")
    b = target.shape[0]
    rows = torch.arange(b - 1, -1, -1).unsqueeze(1).expand_as(target).contiguous()
    counts = mask.sum(-1, keepdim=True).expand_as(mask)
    plain = rl_losses.grpo_loss(logits, target, adv, old, label_counts=counts, **options)
    packed = rl_losses.grpo_loss(logits, target, adv, old, document_index=rows, num_documents=b, label_counts=counts,
                                 **options)
    composed = rl_losses.grpo_loss(logits, target.masked_fill(kept == 0, -100), adv, old,
                                   label_counts=kept.sum(-1, keepdim=True).expand_as(kept),
                                   **aggregation_weights_of("seq-mean-token-mean", kept))
    for out in (plain, packed):
        for name in ("loss", "new_logprobs", "ratio_mean", "clipped_fraction_low", "clipped_fraction_high"):
            torch.testing.assert_close(getattr(out, name), getattr(composed, name), rtol=1e-12, atol=1e-14)


def aggregation_weights_of(mode, kept):
    weights, divisor = aggregation_of(mode, kept)
    return dict(loss_weights=weights, divisor=divisor)


@pytest.mark.parametrize("rollout_correction", [None, "token_truncate", "sequence_mask"])
@pytest.mark.parametrize("rules", ["token_k1", "seq_sum_k2", "seq_max_k3,token_k2"])
def test_gspo_rejection_matches_masked_labels(rules, rollout_correction):
    """gspo with rollout_rs equals gspo on the labels verl's mask keeps (a fully rejected row no longer counts as a
    document: the default divisor), its label_counts recounted."""
    logits, target, mask, old, adv, _ = batch()
    rollout = old + 0.15 * torch.randn_like(old)
    thresholds = ",".join(threshold_of(m, old, rollout, mask) for m in rules.split(","))
    _, kept, _ = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_rs=rules,
                                                                      rollout_rs_threshold=thresholds)
    assert 0 < kept.sum() < mask.sum()
    docs = torch.arange(target.shape[0]).unsqueeze(1).expand_as(target).contiguous()
    correction = dict(rollout_correction=rollout_correction) if rollout_correction else {}
    for counts in (None, mask):
        given = {} if counts is None else dict(label_counts=counts.sum(-1, keepdim=True).expand_as(mask))
        kept_counts = {} if counts is None else dict(label_counts=kept.sum(-1, keepdim=True).expand_as(kept))
        x, y = (logits.clone().requires_grad_(True) for _ in range(2))
        ours = rl_losses.gspo_loss(x, target, adv, old, docs, rollout_log_probs=rollout, rollout_rs=rules,
                                   rollout_rs_threshold=thresholds, **correction, **given)
        theirs = rl_losses.gspo_loss(y, target.masked_fill(kept == 0, -100), adv, old, docs,
                                     **(dict(rollout_log_probs=rollout, **correction) if correction else {}),
                                     **kept_counts)
        for name in ("loss", "new_logprobs", "ratio_mean", "clipped_fraction_low", "kl_old", "document_ratios"):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-12, atol=1e-14)
        grads = [torch.autograd.grad(o.loss, t)[0] for o, t in ((ours, x), (theirs, y))]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_linear_rejection_matches_logits(op):
    """The fused lm_head forms take the same options (the shared list): loss, metrics and gradients w.r.t. the hidden
    states and the weight equal those through the logits op on hidden @ weight.T; the lean strategy too."""
    logits, target, mask, old, adv, _ = batch()
    rollout = old + 0.15 * torch.randn_like(old)
    rules = "token_k3,seq_sum_k1"
    thresholds = ",".join(threshold_of(m, old, rollout, mask) for m in rules.split(","))
    hidden = torch.randn(*target.shape, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(logits.shape[-1], 16, dtype=torch.float64, requires_grad=True)
    options = dict(rollout_log_probs=rollout, rollout_rs=rules, rollout_rs_threshold=thresholds,
                   rollout_correction="token_truncate")
    if op == "grpo":
        options["aggregation"] = "sequence_mean_token_mean"
    assert_linear_equals_logits(op, (hidden, weight, target, adv, old), options, "rollout_weight_mean")


def assert_linear_equals_logits(op, inputs, options, metric):
    """linear_<op>_loss (fast and lean, chunks of 13 rows) and <op>_loss on hidden @ weight.T (gspo: one document
    per row): loss, the metrics (`metric` beside the common ones) and both gradients equal."""
    hidden, weight, target, adv, old = inputs
    docs = (torch.arange(target.shape[0]).unsqueeze(1).expand_as(target).contiguous(),) if op == "gspo" else ()
    theirs = getattr(rl_losses, f"{op}_loss")(hidden @ weight.T, target, adv, old, *docs, **options)
    expected = torch.autograd.grad(theirs.loss, (hidden, weight))
    for strategy in ("fast", "lean"):
        ours = getattr(rl_losses, f"linear_{op}_loss")(hidden, weight, target, adv, old, *docs, strategy=strategy,
                                                      chunk_size=13, **options)
        grads = torch.autograd.grad(ours.loss, (hidden, weight))
        for name in ("loss", "new_logprobs", "ratio_mean", "clipped_fraction_high", metric):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-12, atol=1e-14, msg=name)
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fused_policy_options_from_verl_config():
    """rl_losses.integrations.verl.fused_policy_options maps verl's algorithm.rollout_correction (and loss_agg_mode)
    to the ops' options; batch normalisation and an unknown loss_agg_mode are refused (bypass_mode:
    tests/test_verl_bypass.py)."""
    algorithm = pytest.importorskip("verl.trainer.config.algorithm")
    rc = algorithm.RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                           rollout_rs_threshold="0.8_1.25")
    assert rl_verl.fused_policy_options(rc, "seq-mean-token-sum") == dict(
        rollout_correction="sequence_truncate", rollout_cap=2.0, rollout_rs="token_k1",
        rollout_rs_threshold="0.8_1.25", aggregation="luspo")
    icepop = algorithm.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs=None)
    assert rl_verl.fused_policy_options(icepop) == dict(rollout_correction="token_mask", rollout_mask_bounds=(0.5, 2.0))
    # verl weighs only where rollout_is and its threshold are both set.
    no_threshold = algorithm.RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=None, rollout_rs=None)
    assert rl_verl.fused_policy_options(no_threshold) == {}
    numeric = algorithm.RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_max_k2", rollout_rs_threshold=2.5)
    assert rl_verl.fused_policy_options(numeric, "token-sum") == dict(rollout_rs="seq_max_k2",
                                                                      rollout_rs_threshold="2.5", divisor=1.0)
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        rl_verl.fused_policy_options(algorithm.RolloutCorrectionConfig(rollout_is="token",
                                                                       rollout_is_batch_normalize=True))
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        rl_verl.fused_policy_options(rc, "seq-sum")


@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_reference_rejection_matches_op(op):
    """rl_losses.reference (the configs' path without the extension) takes the same options: loss, gradient and
    metrics equal the op's, with label_counts recounted and a sequence-level rollout correction."""
    logits, target, mask, old, adv, _ = batch()
    rollout = old + 0.15 * torch.randn_like(old)
    rules = "seq_sum_k3,token_k1"
    thresholds = ",".join(threshold_of(m, old, rollout, mask) for m in rules.split(","))
    counts = mask.sum(-1, keepdim=True).expand_as(mask)
    options = dict(rollout_log_probs=rollout, rollout_rs=rules, rollout_rs_threshold=thresholds,
                   rollout_correction="sequence_truncate", label_counts=counts)
    if op == "grpo":
        options["aggregation"] = "sequence_mean_token_mean"
    assert_op_equals_reference(op, (logits, target, adv, old), options, "rollout_weight_mean")


def assert_op_equals_reference(op, inputs, options, metric):
    """`op` (grpo or gspo: one document per row) and rl_losses.reference's: loss, log-probs, gradient and the
    metrics (`metric` beside the common ones) equal."""
    from rl_losses import reference

    logits, target, adv, old = inputs
    docs = (torch.arange(target.shape[0]).unsqueeze(1).expand_as(target).contiguous(),) if op == "gspo" else ()
    results = []
    for fn in (getattr(rl_losses, f"{op}_loss"), getattr(reference, f"{op}_loss")):
        x = logits.clone().requires_grad_(True)
        out = fn(x, target, adv, old, *docs, **options)
        results.append((out, torch.autograd.grad(out.loss, x)[0]))
    (ours, grad), (theirs, expected) = results
    for name in ("loss", "new_logprobs", "ratio_mean", "kl_old", "clipped_fraction_low", metric):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours.log_probs, theirs.log_probs.reshape(ours.log_probs.shape), rtol=1e-12, atol=0)
