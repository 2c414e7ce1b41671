"""verl's bypass_mode fused into the policy ops (bypass_mode=True: old_log_probs := rollout_log_probs, rollout_rs
judging the current log-probs against the rollout's), against verl's own compute_policy_loss_bypass_mode (verl 0.9.1)
on fresh random ragged (B, T) batches: loss, gradient w.r.t. the logits and metrics, for token and sequence rules,
every loss_agg_mode, with and without verl's global counts (the ops' divisor), its loss_type "ppo_clip" and
"reinforce"; gspo and the fused lm_head forms against the same ops given verl's mask as labels; the float64
reference; rl_losses.integrations.verl.fused_policy_options's mapping of bypass_mode."""
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
algorithm = pytest.importorskip("verl.trainer.config.algorithm")
verl_config = pytest.importorskip("verl.workers.config")

import rl_losses  # noqa: E402
from rl_losses import _schema, reference_rejection  # noqa: E402
from rl_losses.integrations import verl as rl_verl  # noqa: E402

from helpers import forward_options  # noqa: E402
from helpers_verl import make_config  # noqa: E402
from test_verl_menu_ops import MODES, batch  # noqa: E402
from test_verl_rejection import (assert_linear_equals_logits, assert_metrics, assert_op_equals_reference,  # noqa: E402
                                 threshold_of)

RULES = ["token_k1", "token_k3", "seq_mean_k2", "seq_sum_k1", "seq_max_k3,token_k1"]
# verl's data-parallel counts (dp_size 1): the global token count (token-mean) and sequence count (the seq modes).
GLOBAL = dict(dp_size=1, batch_num_tokens=517, global_batch_size=23)


def bypass_batch(rules):
    """batch()'s logits, labels, mask and advantages; the rollout's log-probs near the current ones; verl's
    thresholds for ``rules`` on the current log-probs (some tokens rejected, not all)."""
    logits, target, mask, _, adv, _ = batch()
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    rollout = lp + 0.15 * torch.randn_like(lp)
    thresholds = ",".join(threshold_of(m, lp, rollout, mask) for m in rules.split(","))
    return logits, target, mask, lp, rollout, adv, thresholds


def divisor_of(mode, global_info, length):
    """verl's agg_loss denominator from global_batch_info, as the ops' divisor (None: verl recounts locally)."""
    if global_info is None or mode == "token-sum":
        return {}
    if mode == "token-mean":
        return dict(divisor=float(global_info["batch_num_tokens"]))
    norm = length if mode == "seq-mean-token-sum-norm" else 1
    return dict(divisor=float(global_info["global_batch_size"] * norm))


def verl_bypass(logits, target, mask, rollout, adv, mode, rc, global_info):
    """verl's compute_policy_loss_bypass_mode: (loss, gradient w.r.t. the logits, metrics)."""
    cfg = make_config(global_info, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                      policy_loss=verl_config.PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc))
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    loss, metrics = core_algos.get_policy_loss_fn("bypass_mode")(rollout, lp, adv, mask, mode, cfg, None)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def assert_same(out, grad, loss, expected):
    # (verl's seq-mean-token-mean divides by length + 1e-8: ~3e-10 relative)
    torch.testing.assert_close(out.loss, loss, rtol=1e-9, atol=1e-10)
    scale = expected.abs().max()
    torch.testing.assert_close(grad / scale, expected / scale, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("global_info", [None, GLOBAL], ids=["local", "global"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rules", RULES)
def test_grpo_bypass_matches_verl(rules, mode, global_info, device):
    """ppo_clip on π/π_rollout over the tokens the rules keep, judged on the current log-probs; rollout_is (verl's
    metrics only in ppo_clip) changes nothing. With the global counts grpo rejects after its one pass (the rejected
    rows' factor 0 in the backward); without, after a statistics pass."""
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch(rules)
    rc = algorithm.RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip", rollout_is="token",
                                           rollout_is_threshold=1.5, rollout_rs=rules, rollout_rs_threshold=thresholds)
    loss, expected, metrics = verl_bypass(logits, target, mask, rollout, adv, mode, rc, global_info)
    _, kept, _ = helper.compute_rollout_correction_and_rejection_mask(lp, rollout, mask, rollout_is=None,
                                                                      rollout_rs=rules,
                                                                      rollout_rs_threshold=thresholds)
    assert 0 < kept.sum() < mask.sum()
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(1 - float(kept.sum() /
                                                                                             mask.sum()))
    options = rl_verl.fused_policy_options(rc, mode)
    assert options["bypass_mode"] and "rollout_correction" not in options
    options.update(divisor_of(mode, global_info, target.shape[-1]))
    y = logits.to(device).requires_grad_(True)
    out = rl_losses.grpo_loss(y, target.to(device), adv.to(device), None, delta=3.0,
                              rollout_log_probs=rollout.to(device), **options)
    (grad,) = torch.autograd.grad(out.loss, y)
    out = out._replace(**{k: v.cpu() for k, v in out._asdict().items() if isinstance(v, torch.Tensor)})
    assert_same(out, grad.cpu(), loss, expected)
    assert_metrics(out, logits, target, kept, rollout, None)
    assert torch.all(out.log_probs[kept == 0] == 0)
    # verl's own metrics over the kept tokens: the mean of old − lp, and the fraction the clip binds.
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(float(rollout[kept > 0].mean() - out.new_logprobs),
                                                           rel=1e-9, abs=1e-12)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(
        float(out.clipped_fraction_low + out.clipped_fraction_high), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("rollout_is", [None, "token"])
def test_grpo_bypass_reinforce_matches_verl(rollout_is, mode, device):
    """loss_type "reinforce": −A·lp ("gpg"), or with token weights min(π/π_rollout, C) "cispo" with
    epsilon_high = C, over the kept tokens."""
    rules = "token_k2,seq_mean_k1"
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch(rules)
    rc = algorithm.RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is=rollout_is,
                                           rollout_is_threshold=1.2, rollout_rs=rules, rollout_rs_threshold=thresholds)
    loss, expected, _ = verl_bypass(logits, target, mask, rollout, adv, mode, rc, None)
    options = rl_verl.fused_policy_options(rc, mode)
    assert options["loss_type"] == ("cispo" if rollout_is else "gpg")
    y = logits.to(device).requires_grad_(True)
    out = rl_losses.grpo_loss(y, target.to(device), adv.to(device), None, rollout_log_probs=rollout.to(device),
                              **options)
    (grad,) = torch.autograd.grad(out.loss, y)
    torch.testing.assert_close(out.loss.cpu(), loss, rtol=1e-9, atol=1e-10)
    scale = expected.abs().max()
    torch.testing.assert_close(grad.cpu() / scale, expected / scale, rtol=1e-9, atol=1e-10)


def test_grpo_bypass_given_old_and_label_counts():
    """old_log_probs given (the rollout's, as verl's trainer passes them) equals old_log_probs left out; label_counts
    are recounted over the kept tokens; the loss equals grpo on verl's kept labels."""
    rules = "seq_sum_k3,token_k2"
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch(rules)
    _, kept, _ = helper.compute_rollout_correction_and_rejection_mask(lp, rollout, mask, rollout_is=None,
                                                                      rollout_rs=rules,
                                                                      rollout_rs_threshold=thresholds)
    counts = mask.sum(-1, keepdim=True).expand_as(mask)
    for divisor in ({}, dict(divisor=9.0)):  # (the two paths of grpo: a statistics pass first, or after the pass)
        options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs=rules, rollout_rs_threshold=thresholds,
                       **divisor)
        results = []
        for old in (None, rollout):
            x = logits.clone().requires_grad_(True)
            out = rl_losses.grpo_loss(x, target, adv, old, label_counts=counts, **options)
            results.append((out, torch.autograd.grad(out.loss, x)[0]))
        x = logits.clone().requires_grad_(True)
        composed = rl_losses.grpo_loss(x, target.masked_fill(kept == 0, -100), adv, rollout,
                                       label_counts=kept.sum(-1, keepdim=True).expand_as(kept), **divisor)
        (theirs, expected) = composed, torch.autograd.grad(composed.loss, x)[0]
        for out, grad in results:
            for name in ("loss", "new_logprobs", "ratio_mean", "kl_old", "clipped_fraction_low",
                         "clipped_fraction_high"):
                torch.testing.assert_close(getattr(out, name), getattr(theirs, name), rtol=1e-12, atol=1e-14,
                                           msg=name)
            torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rules", ["token_k1", "seq_mean_k3", "seq_max_k2,token_k3"])
def test_gspo_bypass_matches_masked_labels(rules, device):
    """gspo in bypass_mode equals gspo on the labels verl's mask of the current log-probs keeps (old = rollout),
    with and without label_counts (recounted) and a divisor."""
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch(rules)
    _, kept, _ = helper.compute_rollout_correction_and_rejection_mask(lp, rollout, mask, rollout_is=None,
                                                                      rollout_rs=rules,
                                                                      rollout_rs_threshold=thresholds)
    assert 0 < kept.sum() < mask.sum()
    logits, target, mask, rollout, adv, kept = (t.to(device) for t in (logits, target, mask, rollout, adv, kept))
    docs = torch.arange(target.shape[0], device=device).unsqueeze(1).expand_as(target).contiguous()
    for counts, divisor in ((False, {}), (True, dict(divisor=7.0))):
        given = dict(label_counts=mask.sum(-1, keepdim=True).expand_as(mask)) if counts else {}
        kept_counts = dict(label_counts=kept.sum(-1, keepdim=True).expand_as(kept)) if counts else {}
        x, y = (logits.clone().requires_grad_(True) for _ in range(2))
        ours = rl_losses.gspo_loss(x, target, adv, None, docs, rollout_log_probs=rollout, bypass_mode=True,
                                   rollout_rs=rules, rollout_rs_threshold=thresholds, **given, **divisor)
        theirs = rl_losses.gspo_loss(y, target.masked_fill(kept == 0, -100), adv, rollout, docs, **kept_counts,
                                     **divisor)
        for name in ("loss", "new_logprobs", "ratio_mean", "clipped_fraction_low", "kl_old", "document_ratios"):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=1e-12, atol=1e-14, msg=name)
        grads = [torch.autograd.grad(o.loss, t)[0] for o, t in ((ours, x), (theirs, y))]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)
        assert torch.all(ours.log_probs[kept == 0] == 0)


@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_reference_bypass_matches_op(op):
    """The float64 reference takes bypass_mode too: loss, gradient and metrics equal the op's."""
    rules = "seq_mean_k1,token_k3"
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch(rules)
    options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs=rules, rollout_rs_threshold=thresholds,
                   label_counts=mask.sum(-1, keepdim=True).expand_as(mask))
    if op == "grpo":
        options.update(aggregation="sequence_mean_token_mean", divisor=11.0)
    assert_op_equals_reference(op, (logits, target, adv, None), options, "clipped_fraction_high")


def test_grpo_bypass_nan_rollout_rejected_in_the_pass():
    """A NaN rollout log-prob fails every token rule (as verl's comparisons): with a divisor grpo rejects that token
    inside its pass, its gradient row exactly 0, and loss, gradient and metrics equal the reference's."""
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch("token_k2")
    rollout = rollout.clone()
    labelled = (target >= 0).nonzero()
    nan_at = tuple(labelled[:: max(1, len(labelled) // 5)].T)
    rollout[nan_at] = float("nan")
    options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs="token_k2", rollout_rs_threshold=thresholds,
                   divisor=40.0)
    assert_op_equals_reference("grpo", (logits, target, adv, None), options, "clipped_fraction_high")
    x = logits.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(rl_losses.grpo_loss(x, target, adv, None, **options).loss, x)
    assert torch.all(grad[nan_at] == 0)


@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_linear_bypass_matches_logits(op):
    """The fused lm_head forms take bypass_mode (the shared list): loss, metrics and the gradients w.r.t. the hidden
    states and the weight equal those through the logits op on hidden @ weight.T; the lean strategy too."""
    logits, target, mask, _, adv, _ = batch()
    hidden = torch.randn(*target.shape, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(logits.shape[-1], 16, dtype=torch.float64, requires_grad=True)
    z = (hidden @ weight.T).detach()
    lp = torch.log_softmax(z, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    rollout = lp + 0.15 * torch.randn_like(lp)
    rules = "token_k1,seq_sum_k2"
    thresholds = ",".join(threshold_of(m, lp, rollout, mask) for m in rules.split(","))
    options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs=rules, rollout_rs_threshold=thresholds)
    if op == "grpo":
        options["aggregation"] = "token_mean"
    assert_linear_equals_logits(op, (hidden, weight, target, adv, None), options, "kl_old")
    # Without a gradient, with a divisor, grpo rejects after its pass: the same loss.
    docs = (torch.arange(target.shape[0]).unsqueeze(1).expand_as(target).contiguous(),) if op == "gspo" else ()
    with torch.no_grad():
        options["divisor"] = 50.0
        theirs = getattr(rl_losses, f"{op}_loss")(hidden @ weight.T, target, adv, None, *docs, **options)
        ours = getattr(rl_losses, f"linear_{op}_loss")(hidden, weight, target, adv, None, *docs, chunk_size=13,
                                                      **options)
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-14)
    if op == "grpo":  # token rules alone, a divisor and a gradient: judged inside each chunk's pass
        options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs="token_k2", divisor=50.0,
                       rollout_rs_threshold=threshold_of("token_k2", lp, rollout, mask))
        assert_linear_equals_logits(op, (hidden, weight, target, adv, None), options, "kl_old")


@pytest.mark.parametrize("rules,aggregation", [("token_k2", None), ("token_k3,seq_mean_k1", None),
                                               ("seq_mean_k3", "sequence_mean_token_mean")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grpo_bypass_paths_agree(dtype, rules, aggregation, device):
    """In the logits' dtype (fp16: the pass's pre-scaled rows, their factors then zeroed where rejected): grpo in
    bypass_mode with a divisor (rejection after the pass) equals grpo on the labels the rules keep on the op's own
    log-probs, with old = rollout; so does inplace_backward, and the loss without a gradient. (With
    sequence_mean_token_mean the sequence modes alone reject after the pass: a sequence is kept or rejected whole.)"""
    divisor = 300.0
    logits, target, mask, _, adv, _ = batch()
    logits, target, adv = logits.to(device, dtype), target.to(device), adv.to(device)
    lp = rl_losses.grpo_loss(logits, target, adv, None).log_probs
    rollout = lp + 0.15 * torch.randn_like(lp)
    thresholds = ",".join(threshold_of(m, lp.double().cpu(), rollout.double().cpu(), mask) for m in rules.split(","))
    rows = torch.arange(target.shape[0], device=device).unsqueeze(1).expand_as(target)
    kept = reference_rejection.rejected_labels(target, lp, rollout, rows, rules, thresholds)
    assert 0 < (kept >= 0).sum() < (target >= 0).sum()
    options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs=rules, rollout_rs_threshold=thresholds,
                   divisor=divisor, aggregation=aggregation)
    for upstream in (1.0, 3.0):  # (3: the backward's factor times an upstream gradient other than 1)
        x, y = (logits.clone().requires_grad_(True) for _ in range(2))
        ours = rl_losses.grpo_loss(x, target, adv, None, **options)
        (grad,) = torch.autograd.grad(ours.loss * upstream, x)
        theirs = rl_losses.grpo_loss(y, kept, adv, rollout, divisor=divisor, aggregation=aggregation)
        (expected,) = torch.autograd.grad(theirs.loss * upstream, y)
        for name in ("loss", "new_logprobs", "ratio_mean", "kl_old", "clipped_fraction_high", "log_probs"):
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    leaf = logits.clone().requires_grad_(True)
    inplace = rl_losses.grpo_loss(leaf.clone(), target, adv, None, inplace_backward=True, **options)
    (inplace.loss * 3).backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(rl_losses.grpo_loss(logits, target, adv, None, **options).loss, theirs.loss,
                                   rtol=0, atol=0)


def test_fused_policy_options_bypass():
    """bypass_mode maps onto the ops' bypass_mode; the weights are the loss type's (ppo_clip: none; reinforce: gpg,
    or cispo capped at the threshold); what has no op form is refused."""
    rc = algorithm.RolloutCorrectionConfig(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    assert rl_verl.fused_policy_options(rc, "token-mean") == dict(
        bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25", aggregation="token_mean")
    reinforce = algorithm.RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token",
                                                  rollout_is_threshold=2.5)
    assert rl_verl.fused_policy_options(reinforce) == dict(bypass_mode=True, loss_type="cispo", epsilon_high=2.5)
    plain = algorithm.RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is=None)
    assert rl_verl.fused_policy_options(plain) == dict(bypass_mode=True, loss_type="gpg")
    with pytest.raises(ValueError, match="takes rollout_is='token' with an upper threshold"):
        rl_verl.fused_policy_options(algorithm.RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce"))
    with pytest.raises(ValueError, match="bypass_mode's loss_type must be 'ppo_clip' or 'reinforce'"):
        rl_verl.fused_policy_options(dict(bypass_mode=True, loss_type="ppo"))


def test_bypass_refusals():
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch("token_k1")
    with pytest.raises(RuntimeError, match="bypass_mode needs rollout_log_probs"):
        rl_losses.grpo_loss(logits, target, adv, None, bypass_mode=True)
    with pytest.raises(RuntimeError, match="bypass_mode takes no rollout_correction"):
        rl_losses.grpo_loss(logits, target, adv, None, bypass_mode=True, rollout_log_probs=rollout,
                            rollout_correction="token_truncate")
    with pytest.raises(RuntimeError, match="not the fused head's"):
        rl_losses.fused_head_loss(logits, target, grpo_weight=1.0, advantages=adv, old_log_probs=rollout,
                                  rollout_log_probs=rollout, bypass_mode=True)


@pytest.mark.parametrize("divisor", [None, 40.0])
def test_opcheck(divisor, device):
    """The op and its _forward (whose grad_row_unscale holds a factor per row in bypass_mode with rollout_rs,
    whatever the dtype) agree with their fake kernels, on both of grpo's paths."""
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch("token_k1")
    logits, target, adv, rollout = (t[:2, :24].to(device) for t in (logits, target, adv, rollout))
    options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1",
                   divisor=divisor)
    ops = torch.ops.rl_losses
    torch.library.opcheck(ops.grpo, (logits.float().requires_grad_(), target, adv, None), options)
    for dtype in (torch.float32, torch.float16):
        torch.library.opcheck(ops._grpo_forward, (logits.to(dtype), target, adv, None),
                              forward_options("grpo", compute_grad=True, **options))


@pytest.mark.parametrize("rules,aggregation,with_divisor", [
    ("token_k2", None, "in_pass"), ("token_k3", "token_mean", "in_pass"),
    ("seq_sum_k2", "sequence_mean_token_mean", "after"), ("token_k1,seq_mean_k3", None, "both"),
    ("token_k2", "sequence_mean_token_mean", "first")])
def test_grpo_bypass_path(rules, aggregation, with_divisor, device):
    """Which of grpo's paths runs, seen in _grpo_forward's per-row factors and gradient rows. With a divisor the
    token rules are judged in the pass (the rejected rows' factor 1, their gradient 0) and the sequence rules after
    it (factor 0, their gradient still written); without one, or where a token rule changes
    sequence_mean_token_mean's counts, after a statistics pass (factors 1, the rejected rows' gradient 0)."""
    logits, target, mask, lp, rollout, adv, thresholds = bypass_batch(rules)
    logits, target, adv, rollout = (t.to(device, torch.float32 if t.is_floating_point() else t.dtype)
                                    for t in (logits, target, adv, rollout))
    options = dict(rollout_log_probs=rollout, bypass_mode=True, rollout_rs=rules, rollout_rs_threshold=thresholds,
                   aggregation=aggregation)
    token_rules = ",".join(m for m in rules.split(",") if m.startswith("token_"))
    sequence_rules = ",".join(m for m in rules.split(",") if not m.startswith("token_"))
    # The tokens the sequence rules reject, judged here in float64.
    by_sequence = torch.zeros_like(target, dtype=torch.bool)
    if sequence_rules:
        current = torch.log_softmax(logits.double(), -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        spec = dict(zip(rules.split(","), thresholds.split(",")))
        rows = torch.arange(target.shape[0], device=device).unsqueeze(1).expand_as(target)
        kept = reference_rejection.rejected_labels(target, current, rollout.double(), rows, sequence_rules,
                                                   ",".join(spec[m] for m in sequence_rules.split(",")))
        by_sequence = (target >= 0) & (kept < 0)
    for divisor in (None, 30.0):
        results = torch.ops.rl_losses._grpo_forward(logits, target, adv, None,
                                                    **forward_options("grpo", compute_grad=True, divisor=divisor,
                                                                      **options))
        r = dict(zip(_schema.results("_grpo_forward"), results))
        grad, factors = r["grad"], r["grad_row_unscale"].view_as(target)
        rejected = (r["log_probs"] == 0) & (target >= 0)  # (a rejected token's log-prob output is 0)
        assert rejected.any() and not rejected.all()
        zeroed_after = with_divisor in ("after", "both") and divisor is not None
        assert torch.equal(factors == 0, by_sequence if zeroed_after else torch.zeros_like(rejected))
        assert torch.all(factors[~(by_sequence & zeroed_after)] == 1)
        written = rejected & (by_sequence if zeroed_after else torch.zeros_like(rejected))
        assert torch.all(grad[rejected & ~written] == 0)
        assert bool((grad[written] != 0).any()) == bool(written.any())  # (a clipped token's row is 0 either way)
        if token_rules and divisor is not None and with_divisor != "first":
            assert (rejected & ~by_sequence).any()  # the token rules rejected rows in the pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_scale_grad_rows_of_factor_zero(dtype, device):
    """The backward of grpo's rejection after its pass touches the rejected rows alone: _scale_grad_ leaves a row
    of factor 1 as it is (NaN stays NaN: not rewritten) and writes zeros over a row of factor 0 without reading it
    (NaN becomes 0), the other rows scaled; rows that start off a 16-byte boundary and odd lengths included."""
    rows, cols = 6, 37
    buffer = torch.randn(rows, cols + 3, device=device).to(dtype)
    grad = buffer[:, 1:-2]  # rows 1 element past the buffer's alignment, 37 long
    grad[0] = float("nan")
    grad[1] = float("nan")
    before, edges = grad.clone(), buffer[:, [0, -2, -1]].clone()
    factors = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 0.0], device=device)
    torch.ops.rl_losses._scale_grad_(grad, torch.tensor(1.0, device=device, dtype=torch.float64), factors)
    assert torch.isnan(grad[0]).all()
    assert torch.all(grad[[1, 2, 5]] == 0)
    torch.testing.assert_close(grad[3], (before[3].double() * 0.5).to(dtype), rtol=0, atol=0)
    assert torch.equal(grad[4], before[4])
    assert torch.equal(buffer[:, [0, -2, -1]], edges)  # nothing written outside the rows
