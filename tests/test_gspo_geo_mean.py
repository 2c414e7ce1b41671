"""GMPO (loss_type="geo_mean", verl's geo_mean) on the GSPO op: loss, gradient w.r.t. the logits and the clipped
fractions against verl's own compute_policy_loss_geo_mean (verl 0.9.1), rl_losses.reference_verl.geo_mean and
rl_losses.reference.gspo_loss, all float64, on fresh random ragged batches; its refused options on the real op
(their fake-kernel twins: tests/test_fake_checks.py)."""
import pytest
import torch

import rl_losses
from rl_losses import reference, reference_verl

from conftest import assert_close
from helpers import DTYPES, assert_grad_close, label_log_probs64, make_logits, param_id as _id
from helpers_gspo import document_index_from_lengths, make_inputs, natural_scale, random_lengths, run_op


def ragged_rows(device, batch=6, length=40, vocab=96):
    """verl's layout: (B, T) rows, each a sequence right-padded by the mask (row 2 empty), one advantage per row,
    old log-probs 0.3 off the new ones so that tokens fall outside the clip on both sides."""
    logits = make_logits((batch, length), vocab, torch.float64, device)
    lengths = torch.randint(length // 2, length + 1, (batch,), device=device)
    lengths[2] = 0
    mask = torch.arange(length, device=device) < lengths.unsqueeze(1)
    target = torch.randint(0, vocab, (batch, length), device=device).masked_fill(~mask, -100)
    lp = label_log_probs64(logits, target.clamp_min(0), 1.0)
    old = lp + 0.3 * torch.randn_like(lp)
    adv = torch.randn(batch, 1, device=device, dtype=torch.float64).expand(batch, length).contiguous()
    rows = torch.arange(batch, device=device).unsqueeze(1).expand(batch, length)
    return logits, target, adv, old, mask, rows


def verl_geo_mean(logits, target, adv, old, mask, clip_low, clip_high):
    """verl's compute_policy_loss_geo_mean on the log-softmax of the logits: its loss, gradient, metrics."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from helpers_verl import make_config

    x = logits.detach().clone().requires_grad_()
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    config = make_config(clip_ratio_low=clip_low, clip_ratio_high=clip_high)
    loss, metrics = core_algos.get_policy_loss_fn("geo_mean")(old, lp, adv, mask.double(), "token-mean", config)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.15, 0.3), (0.4, 0.05)])
def test_matches_verl(clip, device):
    clip_low, clip_high = clip
    logits, target, adv, old, mask, rows = ragged_rows(device)
    out, grad = run_op(logits, target, adv, old, rows, loss_type="geo_mean", epsilon_low=clip_low,
                       epsilon_high=clip_high, divisor=target.shape[0], num_documents=target.shape[0])
    # reference_verl's per-sequence losses, through the log-softmax of the logits.
    x = logits.detach().clone().requires_grad_()
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    per_seq, ref_metrics = reference_verl.geo_mean(old, lp, adv, mask.double(), clip_low=clip_low,
                                                   clip_high=clip_high)
    per_seq.mean().backward()
    verl_loss, verl_grad, verl_metrics = verl_geo_mean(logits, target, adv, old, mask, clip_low, clip_high)
    for loss, expected_grad, metrics in ((per_seq.mean(), x.grad, ref_metrics),
                                         (verl_loss, verl_grad, verl_metrics)):
        # verl divides by (count + 1e-8): ~5e-10 relative at >= 20 tokens.
        torch.testing.assert_close(out.loss.detach().cpu(), loss.detach().cpu(), rtol=1e-8, atol=1e-10)
        scale = expected_grad.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(grad / scale, expected_grad / scale, rtol=1e-8, atol=1e-10)
        for ours, theirs in (("clipped_fraction_high", "actor/pg_clipfrac"),
                             ("clipped_fraction_low", "actor/pg_clipfrac_lower")):
            assert float(getattr(out, ours)) == pytest.approx(float(metrics[theirs]), rel=1e-9, abs=1e-12)
    assert float(out.clipped_fraction_high) + float(out.clipped_fraction_low) > 0  # the batch reaches the clip
    # A clipped token gets no gradient from the ratio.
    delta = out.log_probs.double() - old
    clipped = mask & (((adv > 0) & (delta > clip_high)) | ((adv < 0) & (delta < -clip_low)))
    assert torch.count_nonzero(grad[clipped]) == 0


def trl_gmpo(logits, target, adv, old, mask, epsilon_low, epsilon_high, beta, ref):
    """TRL's GMPOTrainer._compute_loss (trl.experimental.gmpo) on a stand-in trainer whose per-token log-probs are
    the log-softmax of the logits: its loss and gradient (no entropy filter, no gradient accumulation)."""
    import collections
    import types

    gmpo = pytest.importorskip("trl.experimental.gmpo")
    x = logits.detach().clone().requires_grad_()
    lp = torch.log_softmax(x, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (lp, torch.zeros_like(lp), None),
        top_entropy_quantile=1.0, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=types.SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t),
        _metrics={"train": collections.defaultdict(list)})
    batch = target.shape[0]
    inputs = {"prompt_ids": target.new_zeros(batch, 0), "prompt_mask": target.new_zeros(batch, 0),
              "completion_ids": target.clamp_min(0), "completion_mask": mask.to(torch.int64), "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref}
    loss = gmpo.GMPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("beta", [0.0, 0.15])
def test_matches_trl(beta, device):
    """TRL's GMPO: per-sequence advantages, KL = the sequence's mean k3 (weighting "document"), the plain mean over
    the sequences (divisor B). Every sequence holds a token here: TRL's loss of an empty one is −A, verl's 0."""
    logits, target, adv, old, mask, rows = ragged_rows(device)
    keep = mask.clone()
    keep[:, 0] = True
    target = torch.where(keep, target.clamp_min(0), -100)
    ref = old + 0.2 * torch.randn_like(old)
    out, grad = run_op(logits, target, adv, old, rows, loss_type="geo_mean", epsilon_low=0.4, epsilon_high=0.3,
                       beta=beta, ref_log_probs=ref, kl_estimator="k3", divisor=target.shape[0])
    loss, expected_grad = trl_gmpo(logits, target, adv[:, 0], old, keep, 0.4, 0.3, beta, ref)
    torch.testing.assert_close(out.loss.detach().cpu(), loss.cpu(), rtol=1e-9, atol=1e-12)
    scale = expected_grad.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(grad / scale, expected_grad / scale, rtol=1e-9, atol=1e-12)


OPTIONS = {
    "plain": {},
    "token_weighting_divisor": dict(weighting="token", divisor=37.0, epsilon_low=0.1, epsilon_high=0.15),
    "kl_entropy": dict(beta=0.3, kl_estimator="k3", entropy_coefficient=0.02, compute_entropy=True),
    "kl_importance_weighted": dict(beta=0.2, kl_importance_weighted=True, epsilon_low=0.05, epsilon_high=0.1),
    "scaled_on_policy": dict(logits_scale_factor=0.7),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES], ids=_id)
def test_packed_documents_match_reference(option, dtype, device):
    """Packed documents crossing rows, per-token advantages of mixed signs inside a document (the clip's side is
    each token's), against rl_losses.reference.gspo_loss."""
    kwargs = dict(OPTIONS[option], loss_type="geo_mean")
    shape = (8, 25)
    doc = document_index_from_lengths(random_lengths(200, 6), 200, device).view(shape)
    logits, target, advantages, old = make_inputs(shape, 160, dtype, device, doc, token_spread=0.3,
                                                  logits_scale_factor=kwargs.get("logits_scale_factor", 1.0))
    if option == "scaled_on_policy":
        old = None
    if "beta" in kwargs:
        kwargs["ref_log_probs"] = (old if old is not None else torch.zeros(shape, device=device)) + \
            0.2 * torch.randn(shape, device=device)
    upstream = 1.3
    out, grad = run_op(logits, target, advantages, old, doc, upstream, **kwargs)
    x = logits.detach().double().requires_grad_()
    vec = reference.gspo_loss(x, target.long(), advantages.double(), None if old is None else old.double(), doc,
                              **{k: v.double() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    (vec.loss * upstream).backward()
    vec_grad = x.grad
    assert_close(out.loss.detach(), vec.loss.detach(), dtype, msg="loss")
    for metric in ("clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean", "new_logprobs"):
        assert_close(getattr(out, metric), getattr(vec, metric), dtype, msg=metric)
    scale = natural_scale(target, advantages, doc, upstream, **kwargs)
    assert_grad_close(grad, vec_grad, dtype, natural_scale=scale)


@pytest.mark.parametrize("kwargs,message", [
    (dict(token_advantages=True), "loss_type 'geo_mean' takes its document's mean advantage, got token_advantages"),
    (dict(rollout_correction="sequence_truncate", rollout_log_probs=True), "loss_type 'geo_mean' takes no "
     "rollout_correction, got 'sequence_truncate'"),
    (dict(delta=3.0), "delta \\(the two-sided clip\\) applies to loss_type 'ppo_clip' only, got loss_type 'geo_mean'"),
])
def test_refused_options(kwargs, message, device):
    shape = (4, 10)
    doc = document_index_from_lengths([15, 25], 40, device).view(shape)
    logits, target, advantages, old = make_inputs(shape, 32, torch.float32, device, doc)
    kwargs = dict(kwargs)  # the parameter's dict is shared by every device's case
    if kwargs.pop("rollout_log_probs", None):
        kwargs["rollout_log_probs"] = old
    with pytest.raises(RuntimeError, match=message):
        rl_losses.gspo_loss(logits, target, advantages, old, doc, loss_type="geo_mean", **kwargs)


def test_grpo_refuses_geo_mean(device):
    logits = make_logits((3, 8), 32, torch.float32, device)
    target = torch.randint(0, 32, (3, 8), device=device)
    with pytest.raises(RuntimeError, match="loss_type 'geo_mean' takes the geometric mean of a sequence's clipped "
                                           "ratios: use gspo"):
        rl_losses.grpo_loss(logits, target, torch.randn(3, device=device), None, loss_type="geo_mean")


def test_configs():
    from rl_losses.config import LanguageModelGRPOLossConfig, LanguageModelGSPOLossConfig

    assert LanguageModelGSPOLossConfig(loss_type="geo_mean").loss_type == "geo_mean"
    with pytest.raises(ValueError, match="LanguageModelGRPOLossConfig.loss_type must be not 'geo_mean'"):
        LanguageModelGRPOLossConfig(loss_type="geo_mean")
    for options in (dict(token_advantages=True), dict(rollout_correction="token_mask")):
        with pytest.raises(ValueError, match="loss_type must be not 'geo_mean' with token_advantages or a "
                                             "rollout_correction"):
            LanguageModelGSPOLossConfig(loss_type="geo_mean", **options)
