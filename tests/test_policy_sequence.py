"""Sequence-level options of the policy family (docs/policy_losses.md):

* the sequence-level rollout correction is TRL's: ρ_s = exp(Σ_t (old_t − rollout_t)), the product of the token
  ratios (trl 1.16 grpo_trainer.py, vllm_importance_sampling_mode="sequence_*"), as verl's rollout_is="sequence"
  (compute_rollout_correction_weights), checked against both formulas, fp32;
* GSPO's importance-weighted KL differentiated through R_s (gradcheck and the float64 reference);
* GSPO with a token-level rollout correction: f(R_s) reaches each token through R_s, weighted by the document's
  Σ κ'·ω (ratios near 1, inside the clip, where it matters; float64 reference);
* GSPO's document_sums: the (S, 6) sums of gspo_document_sums, and (S, 3) still accepted where unused.

The sequence modes and vespo under sdp_group / tp_group (gloo) are cases of tests/test_distributed.py.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import DEVICES, assert_close
from helpers import assert_grad_close, gradcheck_fresh, label_log_probs64, make_logits

_ops = torch.ops.rl_losses


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def make_batch(b=5, t=10, vocab=97, dtype=torch.float32, device="cpu", spread=0.08):
    logits = make_logits((b, t), vocab, dtype, device)
    lengths = torch.randint(2, t + 1, (b,), device=device)
    lengths[0] = t
    mask = torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    target = torch.where(mask, torch.randint(0, vocab, (b, t), device=device), -100)
    lp = label_log_probs64(logits, target)
    old = (lp + 0.3 * torch.randn(b, t, dtype=torch.float64, device=device)).to(dtype)
    rollout = (old.double() + spread * torch.randn(b, t, dtype=torch.float64, device=device)).to(dtype)
    ref = (lp + 0.2 * torch.randn(b, t, dtype=torch.float64, device=device)).to(dtype)
    return logits, target, mask, torch.randn(b, dtype=dtype, device=device), old, ref, rollout


def per_token_logps(x, target):
    lp = torch.log_softmax(x, dim=-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(target >= 0, lp, 0.0)


def rel_err(actual, expected):
    scale = expected.double().abs().max().clamp_min(1e-30)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


# ---- TRL and verl: the sequence ratio is the product of the token ratios -------------------------------------------
@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_modes_match_trl(mode):
    """grpo_trainer.py (trl 1.16.0): per_sequence_logps_diff = ((old − sampling)·mask).sum(-1, keepdim=True),
    ratio = exp(·), clamped (truncate) or masked_fill outside [clip_min, clip_max] (mask); the policy term × ratio,
    KL added after; bnpo's token mean."""
    logits, target, mask, advantages, old, ref, rollout = make_batch()
    cap, bounds = 1.4, (0.75, 1.3)
    diff = ((old - rollout) * mask).sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    ratio = ratio.clamp(max=cap) if mode == "sequence_truncate" else ratio.masked_fill(
        (ratio < bounds[0]) | (ratio > bounds[1]), 0.0)
    x = logits.clone().requires_grad_()
    lp = per_token_logps(x, target)
    coef_1 = torch.exp(lp - old)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_1.clamp(0.8, 1.2) * a) * ratio
    per_token = per_token + 0.04 * (torch.exp(ref - lp) - (ref - lp) - 1)
    expected = (per_token * mask).sum() / mask.sum()
    expected.backward()
    y = logits.clone().requires_grad_()
    options = dict(rollout_cap=cap) if mode == "sequence_truncate" else dict(rollout_mask_bounds=bounds)
    out = rl_losses.grpo_loss(y, target, advantages, old, rollout_log_probs=rollout, rollout_correction=mode,
                              ref_log_probs=ref, beta=0.04, **options)
    out.loss.backward()
    assert rel_err(out.loss.detach(), expected.detach()) <= 1e-5
    assert rel_err(y.grad, x.grad) <= 1e-6
    # TRL logs the mean of the (weighted) ratio over the completion tokens.
    weight = ratio.expand_as(mask)
    assert rel_err(out.trl_metrics()["sampling/importance_sampling_ratio/mean"], weight[mask].mean()) <= 1e-6
    assert rel_err(out.rollout_ratio_mean, torch.exp(diff).expand_as(mask)[mask].mean()) <= 1e-6


@pytest.mark.parametrize("threshold", [1.5, "0.8_1.3"], ids=["tis", "icepop"])
def test_sequence_weights_match_verl(threshold):
    """verl 0.9.1 rollout_corr_helper.compute_rollout_correction_weights(rollout_is="sequence"): exp of the masked
    sum of the log-ratios (clamped at ±20, not reached here), truncated (TIS) or zeroed outside [lo, hi]
    (IcePop). Our mean correction weight over labelled tokens is the mean of verl's weights over the mask."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    logits, target, mask, advantages, old, _, rollout = make_batch()
    weights, _ = helper.compute_rollout_correction_weights(old - rollout, mask.float(), rollout_is="sequence",
                                                           rollout_is_threshold=threshold)
    if isinstance(threshold, str):
        lo, hi = (float(v) for v in threshold.split("_"))
        options = dict(rollout_correction="sequence_mask", rollout_mask_bounds=(lo, hi))
    else:
        options = dict(rollout_correction="sequence_truncate", rollout_cap=threshold)
    out = rl_losses.grpo_loss(logits, target, advantages, old, rollout_log_probs=rollout, **options)
    assert rel_err(out.rollout_weight_mean, weights[mask].mean()) <= 1e-6


@pytest.mark.parametrize("num_documents", [None, 4, 7], ids=["counted", "given", "given_larger"])
def test_sequence_sum_matches_reference_documents(num_documents, device):
    """Packed documents, one spanning two rows: ρ_s sums over the whole document, CPU and CUDA vs float64; with
    num_documents given (no host synchronisation), also a larger count than the ids need."""
    logits, target, _, _, old, _, rollout = make_batch(3, 8, 50, device=device)
    doc = torch.tensor([[0] * 5 + [1] * 3, [1] * 4 + [2] * 4, [3] * 6 + [-1] * 2], device=device)
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(3, 8, device=device)
    for on_policy in (False, True):
        for mode in ("sequence_truncate", "sequence_mask"):
            options = dict(rollout_log_probs=rollout, rollout_correction=mode, document_index=doc)
            options.update(rollout_cap=1.1) if mode.endswith("truncate") else options.update(
                rollout_mask_bounds=(0.8, 1.2))
            old_arg = None if on_policy else old
            x = logits.clone().requires_grad_()
            out = rl_losses.grpo_loss(x, target, advantages, old_arg, num_documents=num_documents, **options)
            out.loss.backward()
            x64 = logits.double().requires_grad_()
            opts64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in options.items()}
            expected = reference.grpo_loss(x64, target, advantages.double(), None if on_policy else old.double(),
                                           **opts64)
            expected.loss.backward()
            assert_close(out.loss.detach(), expected.loss.detach(), torch.float32)
            assert_grad_close(x.grad, x64.grad, torch.float32)
            for name in ("rollout_ratio_mean", "rollout_weight_mean", "rollout_corrected_fraction"):
                assert_close(getattr(out, name), getattr(expected, name), torch.float32, msg=name)


def test_linear_grpo_takes_num_documents(device):
    """linear_grpo_loss with document_index and num_documents equals the float64 reference on the logits."""
    g = torch.Generator(device=device).manual_seed(5)
    hidden = torch.randn(12, 16, device=device, generator=g, dtype=torch.float64)
    weight = torch.randn(30, 16, device=device, generator=g, dtype=torch.float64) * 0.3
    target = torch.randint(0, 30, (12,), device=device, generator=g)
    target[[2, 7]] = -100
    doc = torch.tensor([0] * 5 + [1] * 4 + [2] * 3, device=device)
    advantages = torch.randn(12, device=device, generator=g, dtype=torch.float64)
    logits = hidden @ weight.T
    old = label_log_probs64(logits, target) + 0.2 * torch.randn(12, device=device, generator=g, dtype=torch.float64)
    rollout = old + 0.1 * torch.randn(12, device=device, generator=g, dtype=torch.float64)
    options = dict(rollout_log_probs=rollout, rollout_correction="sequence_truncate", rollout_cap=1.05,
                   document_index=doc)
    out = rl_losses.linear_grpo_loss(hidden, weight, target, advantages, old, num_documents=3, chunk_size=5, **options)
    expected = reference.grpo_loss(logits, target, advantages, old, **options)
    assert_close(out.loss, expected.loss, torch.float64)
    assert_close(out.rollout_weight_mean, expected.rollout_weight_mean, torch.float64)


def test_num_documents_errors(device):
    logits, target, _, advantages, old, _, rollout = make_batch(2, 6, 20, device=device)
    doc = torch.tensor([[0] * 6, [1] * 3 + [2] * 3], device=device)
    options = dict(rollout_log_probs=rollout, rollout_correction="sequence_truncate")
    with pytest.raises(RuntimeError, match="num_documents = 3 counts the ids of document_index, which is not given"):
        rl_losses.grpo_loss(logits, target, advantages, old, num_documents=3, **options)
    with pytest.raises(RuntimeError, match=r"num_documents must be in \[0, \d+\], got -1"):
        rl_losses.grpo_loss(logits, target, advantages, old, document_index=doc, num_documents=-1, **options)
    if device == "cpu":  # CUDA: a device-side assert (or the host check of RL_LOSSES_CHECK_INPUTS=1)
        with pytest.raises(RuntimeError, match="document_index holds 2 but num_documents is 2"):
            rl_losses.grpo_loss(logits, target, advantages, old, document_index=doc, num_documents=2, **options)


# ---- GSPO: the importance-weighted KL through R_s --------------------------------------------------------------------
def _label_counts(target, doc):
    """Each token's document's labelled-token count (the label_counts of a document split across ranks)."""
    on = ((target >= 0) & (doc >= 0)).double().view(-1)
    counts = torch.zeros(4, dtype=torch.float64, device=doc.device).index_add_(0, doc.clamp_min(0).view(-1), on)
    return counts[doc.clamp_min(0)]


def _gspo_matches_reference(logits, target, advantages, old, doc, options):
    """gspo_loss on float64 logits against the reference, loss and gradient; returns both outputs."""
    x = logits.clone().requires_grad_()
    out = rl_losses.gspo_loss(x, target, advantages, old, doc, **options)
    out.loss.backward()
    x64 = logits.clone().requires_grad_()
    expected = reference.gspo_loss(x64, target, advantages, old, doc, **options)
    expected.loss.backward()
    assert_close(out.loss.detach(), expected.loss.detach(), torch.float64)
    assert_grad_close(x.grad, x64.grad, torch.float64)
    return out, expected


def _packed(device):
    return torch.tensor([[0] * 5 + [1] * 3, [1] * 4 + [2] * 4, [3] * 6 + [-1] * 2], device=device)


@pytest.mark.parametrize("weighting,token_advantages,label_counts",
                         [("document", False, False), ("token", False, False), ("document", False, True),
                          ("document", True, False)], ids=["document", "token", "label_counts", "gspo_token"])
def test_gspo_importance_weighted_kl_gradient(weighting, token_advantages, label_counts, device):
    """R_s·KL_t differentiated through R_s, so every token of the document gets β·R_s·u_t·Σ_j κ_j·KL_j/D beside
    its own term (GSPO-token: its own ratio only), against the reference's autograd, float64."""
    logits, target, _, _, old, ref, _ = make_batch(3, 8, 29, torch.float64, device)
    doc = _packed(device)
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(3, 8, dtype=torch.float64, device=device)
    options = dict(ref_log_probs=ref, beta=0.3, kl_importance_weighted=True, kl_estimator="k3", weighting=weighting,
                   token_advantages=token_advantages, num_documents=4)
    if label_counts:
        options["label_counts"] = _label_counts(target, doc)
    for old_arg in (old, None):
        out, expected = _gspo_matches_reference(logits, target, advantages, old_arg, doc, options)
        assert_close(out.kl, expected.kl, torch.float64)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
@pytest.mark.parametrize("weighting,label_counts", [("document", False), ("token", False), ("document", True)],
                         ids=["document", "token", "label_counts"])
def test_gspo_token_rollout_gradient(mode, weighting, label_counts, device):
    logits, target, _, _, _, _, _ = make_batch(3, 8, 29, torch.float64, device)
    doc = _packed(device)
    target = torch.where(doc < 0, -100, target)
    lp = label_log_probs64(logits, target)
    old = lp + 0.01 * torch.randn_like(lp)  # R_s near 1: the surrogate's gradient is not clipped away
    rollout = old + 0.3 * torch.randn_like(lp)
    options = dict(rollout_log_probs=rollout, rollout_correction=mode, rollout_cap=1.2, weighting=weighting,
                   num_documents=4, epsilon_low=0.1, epsilon_high=0.15)
    if mode == "token_mask":
        options = dict(options, rollout_cap=3.0, rollout_mask_bounds=(0.8, 1.25))
    if label_counts:
        options["label_counts"] = _label_counts(target, doc)
    advantages = torch.randn(4, dtype=torch.float64, device=device)
    _gspo_matches_reference(logits, target, advantages, old, doc, options)


def test_gspo_importance_weighted_kl_gradcheck():
    logits, target, _, _, old, ref, _ = make_batch(3, 8, 7, torch.float64)
    doc = _packed("cpu")
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(4, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    assert gradcheck_fresh(lambda t: rl_losses.gspo_loss(
        t, target, advantages, old, doc, ref_log_probs=ref, beta=0.5, kl_importance_weighted=True,
        kl_estimator="k2", num_documents=4).loss, x)


# ---- GSPO's document_sums -------------------------------------------------------------------------------------------
def test_document_sums_columns(device):
    """gspo_document_sums gives the six columns of gspo.h (GspoSum); its first three are the original sums."""
    logits, target, _, _, old, ref, rollout = make_batch(3, 8, 31, torch.float64, device)
    doc = _packed(device)
    target = torch.where(doc < 0, -100, target)
    advantages = torch.randn(3, 8, dtype=torch.float64, device=device)
    lp = label_log_probs64(logits, target)
    on = (target >= 0) & (doc >= 0)
    counts = torch.ones_like(lp)
    sums = _ops.gspo_document_sums(lp, target, advantages, old, doc, counts, 4, ref_log_probs=ref, beta=0.1,
                                   kl_importance_weighted=True, loss_type="vespo", rollout_log_probs=rollout,
                                   rollout_correction="token_truncate", rollout_cap=1.1)
    assert sums.shape == (4, 6)

    def per_doc(v):
        return torch.zeros(4, dtype=torch.float64, device=device).index_add_(
            0, doc.clamp_min(0).view(-1), torch.where(on, v, 0.0).view(-1))

    log_rho = old - rollout
    omega = torch.log(torch.exp(log_rho).clamp(max=1.1)).clamp(min=-18.420680743952367, max=20.0)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    expected = torch.stack([per_doc(lp - old), per_doc(advantages), per_doc(torch.ones_like(lp)),
                            per_doc(torch.exp(log_rho).clamp(max=1.1)),  # Σ κ'·ω (a token-level correction)
                            per_doc((lp - old).clamp(-20, 20) + omega), per_doc(kl)], 1)
    assert_close(sums, expected, torch.float64)
    # Without the policy family's columns in use, (S, 3) sums are still accepted; with them, refused.
    out3 = _ops.gspo(logits, target, advantages, old, doc, num_documents=4, document_sums=sums[:, :3].contiguous())
    out6 = _ops.gspo(logits, target, advantages, old, doc, num_documents=4, document_sums=sums)
    assert_close(out3[0], out6[0], torch.float64)
    with pytest.raises(RuntimeError, match=r"document_sums must be \(4, 6\) Double"):
        _ops.gspo(logits, target, advantages, old, doc, num_documents=4, document_sums=sums[:, :3].contiguous(),
                  loss_type="vespo")
