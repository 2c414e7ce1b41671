"""Tests of the GRPO op (docs/math.md): loss, gradient and metrics against the float64 reference.

The op is compared with rl_losses.reference.grpo_loss in float64 (on logits rounded to the test dtype first),
and its conventions are checked against formulas written out here: TRL's loss_type="grpo" and Helion's GRPO
example. Clip decisions are tested on ratios placed 1e-3 inside or outside each bound, never on it. The
autograd contract, opcheck, torch.compile, CPU == CUDA and bad input are in test_grpo_contract.py.
"""
import pytest
import torch

import rl_losses

from conftest import assert_close
from helpers import DTYPES, assert_grad_close, label_log_probs64, make_logits, make_target, param_id as _id
from helpers_grpo import (METRICS, assert_outputs_close, check_against_reference, designed_ratio_inputs, make_inputs, natural_scale,
                          run_op, run_reference)

SHAPES = [(64,), (16, 8)]


# ---- Fast-LLM's grid --------------------------------------------------------------------------------------
# (options, upstream gradient g)
OPTIONS = {
    "plain": ({}, 1.0),
    "scaled": ({"logits_scale_factor": 0.6}, 1.7),
    "epsilons": ({"epsilon_low": 0.1, "epsilon_high": 0.3}, -0.5),
    "entropy": ({"logits_scale_factor": 1.3, "compute_entropy": True}, 2.0),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("vocab", [256, 500, 1000])
def test_matches_reference(vocab, shape, dtype, option, device):
    kwargs, upstream = OPTIONS[option]
    inputs = make_inputs(shape, vocab, dtype, device, logits_scale_factor=kwargs.get("logits_scale_factor", 1.0))
    logits, target, advantages, old_log_probs, _ = inputs
    check_against_reference(logits, target, advantages, old_log_probs, upstream, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("shape", [(4,), (2, 3)], ids=_id)
def test_large_vocab(shape, dtype, device):
    # V = 32000 with few rows: the looped-vocabulary path of Fast-LLM's grid, cheap on a CPU.
    kwargs = dict(logits_scale_factor=1 / 0.9, beta=0.04, compute_entropy=True)
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs(
        shape, 32000, dtype, device, masked=0.3, logits_scale_factor=kwargs["logits_scale_factor"])
    check_against_reference(logits, target, advantages, old_log_probs, 1.3, ref_log_probs=ref_log_probs, **kwargs)


# ---- every option -----------------------------------------------------------------------------------------
def _feature_kwargs(feature, target, ref_log_probs):
    shape, device = target.shape, target.device
    mask = (target >= 0).float()
    lengths = mask.sum(-1, keepdim=True)
    label_counts = lengths.expand(shape).clamp_min(1)  # each row is one document
    features = {
        "beta": dict(beta=0.04, ref_log_probs=ref_log_probs),
        "beta_large": dict(beta=0.5, ref_log_probs=ref_log_probs),
        "delta": dict(delta=1.3, epsilon_high=0.25),
        "weights": dict(loss_weights=torch.rand(shape, device=device) * 2),  # nonzero on unlabelled tokens too
        "sequence_mean_weights": dict(loss_weights=mask / lengths.clamp_min(1), divisor=float(shape[0])),
        "divisor": dict(divisor=100.0),
        "label_counts": dict(label_counts=label_counts),
        "everything": dict(beta=0.1, ref_log_probs=ref_log_probs, delta=1.4, epsilon_low=0.15, epsilon_high=0.3,
                           loss_weights=torch.rand(shape, device=device), divisor=57.0, label_counts=label_counts,
                           logits_scale_factor=0.8, compute_entropy=True),
    }
    return features[feature]


FEATURES = ["beta", "beta_large", "delta", "weights", "sequence_mean_weights", "divisor", "label_counts",
            "everything"]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_options(feature, dtype, device):
    shape, vocab = (16, 8), 500
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs(shape, vocab, dtype, device,
                                                                           spread=0.4)
    kwargs = _feature_kwargs(feature, target, ref_log_probs)
    if "logits_scale_factor" in kwargs:  # keep the ratios near 1 at this scale
        lp = label_log_probs64(logits, target, kwargs["logits_scale_factor"])
        old_log_probs = (lp + 0.4 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    check_against_reference(logits, target, advantages, old_log_probs, -1.3, **kwargs)


def test_float64(device):
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs((16, 8), 300, torch.float64, device)
    check_against_reference(logits, target, advantages, old_log_probs, 0.7, ref_log_probs=ref_log_probs,
                            beta=0.04, delta=1.5, compute_entropy=True, logits_scale_factor=1.1)


def test_label_counts_metric_is_mean_of_document_means(device):
    # docs/math.md: new_logprobs is the mean over documents of each document's mean log-prob (Fast-LLM's metric),
    # the plain token mean without label_counts.
    shape, vocab = (8, 12), 200
    logits, target, advantages, old_log_probs, _ = make_inputs(shape, vocab, torch.float32, device)
    target[2] = -100  # a row with no label is no document
    mask = target >= 0
    counts = mask.sum(-1, keepdim=True).expand(shape)
    lp = label_log_probs64(logits, target)
    documents = [lp[i][mask[i]].mean() for i in range(shape[0]) if mask[i].any()]
    with torch.no_grad():
        by_document = rl_losses.grpo_loss(logits, target, advantages, old_log_probs, label_counts=counts)
        by_token = rl_losses.grpo_loss(logits, target, advantages, old_log_probs)
    assert_close(by_document.new_logprobs, torch.stack(documents).mean(), torch.float32)
    assert_close(by_token.new_logprobs, lp[mask].mean(), torch.float32)
    # label_counts as a strided view (every other element of a wider tensor): read at its strides.
    strided = torch.stack([counts, torch.full_like(counts, 1000)], -1)[..., 0]
    assert not strided.is_contiguous()
    with torch.no_grad():
        by_strided = rl_losses.grpo_loss(logits, target, advantages, old_log_probs, label_counts=strided)
    assert_close(by_strided.new_logprobs, torch.stack(documents).mean(), torch.float32)


@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int64], ids=_id)
def test_label_dtypes(label_dtype, device):
    logits, target, advantages, old_log_probs, _ = make_inputs((16, 8), 300, torch.float32, device)
    check_against_reference(logits, target.to(label_dtype), advantages, old_log_probs, 1.2)


def test_non_contiguous_logits(device):
    big = make_logits((16, 8), 311, torch.float32, device)
    logits = big[..., :300]
    target = make_target((16, 8), 300, device)
    lp = label_log_probs64(logits, target)
    old_log_probs = (lp + 0.3 * torch.randn((16, 8), device=device, dtype=torch.float64)).float()
    advantages = torch.randn((16, 8), device=device)
    x = big.detach().clone().requires_grad_()
    out = rl_losses.grpo_loss(x[..., :300], target, advantages, old_log_probs)
    (out.loss * 1.5).backward()
    ref, ref_grad = run_reference(logits, target, advantages, old_log_probs, 1.5)
    assert_outputs_close(out, ref, torch.float32)
    assert_grad_close(x.grad[..., :300], ref_grad, torch.float32)
    assert torch.count_nonzero(x.grad[..., 300:]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_inplace_backward(dtype, device):
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs((16, 8), 300, dtype, device)
    kwargs = dict(beta=0.04, ref_log_probs=ref_log_probs, delta=1.6)
    leaf = logits.clone().requires_grad_()
    work = leaf.clone()  # a non-leaf copy that the op may overwrite
    out = rl_losses.grpo_loss(work, target, advantages, old_log_probs, inplace_backward=True, **kwargs)
    (out.loss * 1.9).backward()
    ref, ref_grad = run_reference(logits, target, advantages, old_log_probs, 1.9, **kwargs)
    assert_outputs_close(out, ref, dtype)
    assert_grad_close(leaf.grad, ref_grad, dtype, natural_scale=natural_scale(target, advantages, 1.9))
    assert torch.equal(work.detach(), leaf.grad)  # the gradient lives in the logits' storage


# ---- masking ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_masked_rows(dtype, device):
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs((16, 8), 256, dtype, device)
    target[[0, 5, 11]] = -100  # whole sequences without a label
    out, grad = check_against_reference(logits, target, advantages, old_log_probs, 1.4, beta=0.04,
                                        ref_log_probs=ref_log_probs, compute_entropy=True)
    assert torch.count_nonzero(grad[[0, 5, 11]]) == 0


@pytest.mark.parametrize("with_options", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_all_masked(dtype, with_options, device):
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs((16, 8), 100, dtype, device,
                                                                           masked=1.0)
    kwargs = dict(beta=0.04, ref_log_probs=ref_log_probs, delta=2.0, label_counts=torch.zeros_like(advantages),
                  loss_weights=torch.ones_like(advantages), compute_entropy=True) if with_options else {}
    out, grad = run_op(logits, target, advantages, old_log_probs, 1.5, **kwargs)
    assert out.loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    for name in METRICS + (("entropy",) if with_options else ()):
        value = getattr(out, name)
        assert torch.isfinite(value).all(), f"{name} is not finite on an all-masked batch"
    assert torch.equal(out.log_probs, torch.zeros_like(out.log_probs))


# ---- clip bounds ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_delta", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_ratios_next_to_each_clip_bound(dtype, use_delta, device):
    """Ratios 1e-3 inside or outside 1-ε_l, 1+ε_h (and δ): the clip decisions, the clipped fractions and which
    tokens get a gradient follow from the design alone; loss and gradient also match the reference."""
    eps_low, eps_high, delta = 0.2, 0.28, 1.6
    n, vocab, margin = 96, 300, 1e-3
    designed = [1 - eps_low - margin, 1 - eps_low + margin, 1 + eps_high - margin, 1 + eps_high + margin]
    if use_delta:
        designed += [delta - margin, delta + margin]
    logits, target, advantages, old_log_probs, ratio = designed_ratio_inputs(designed, n, vocab, dtype, device)
    kwargs = dict(epsilon_low=eps_low, epsilon_high=eps_high, delta=delta if use_delta else None)

    out, grad = check_against_reference(logits, target, advantages, old_log_probs, 1.0, **kwargs)
    positive, negative = advantages > 0, advantages < 0
    low = (ratio < 1 - eps_low) & negative
    high = (ratio > 1 + eps_high) & positive
    assert out.clipped_fraction_low.item() == pytest.approx(low.sum().item() / n)
    assert out.clipped_fraction_high.item() == pytest.approx(high.sum().item() / n)
    assert out.ratio_mean.item() == pytest.approx(ratio.mean().item(), rel=1e-5)
    # c_t = 0 (no gradient) where a clip is active (docs/math.md).
    no_grad_expected = low | high | ((ratio > delta) if use_delta else torch.zeros_like(low))
    has_grad = grad.double().abs().sum(-1) > 0
    assert torch.equal(has_grad, ~no_grad_expected)


# ---- a long row count -------------------------------------------------------------------------------------
def test_many_rows(device):
    # N > 65535: more rows than a CUDA grid's y/z dimension can hold.
    shape, vocab = (70000,), 8
    logits, target, advantages, old_log_probs, ref_log_probs = make_inputs(shape, vocab, torch.float32, device)
    check_against_reference(logits, target, advantages, old_log_probs, 1.1, ref_log_probs=ref_log_probs,
                            beta=0.04)


# ---- conventions of other implementations -----------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trl_loss_type_grpo(beta, device):
    """TRL's GRPOTrainer, loss_type="grpo": the mean over sequences of each sequence's mean per-token loss,
    per_token_loss = -min(r·A, clip(r, 1-ε_l, 1+ε_h)·A) + β·k3 with the advantage per sequence. The op gives it
    with loss_weights = mask / |o_i| and divisor = B."""
    batch, length, vocab = 6, 10, 64
    eps_low, eps_high = 0.2, 0.28
    logits = make_logits((batch, length), vocab, torch.float64, device)
    completion_ids = torch.randint(0, vocab, (batch, length), device=device)
    lengths = torch.tensor([10, 7, 1, 4, 9, 0], device=device)  # the last sequence is empty
    completion_mask = (torch.arange(length, device=device) < lengths[:, None]).double()
    advantages = torch.randn(batch, device=device, dtype=torch.float64)
    lp_now = label_log_probs64(logits, completion_ids)
    old = lp_now + 0.3 * torch.randn(batch, length, device=device, dtype=torch.float64)
    ref = lp_now + 0.2 * torch.randn(batch, length, device=device, dtype=torch.float64)

    # The TRL formula, written out.
    x = logits.detach().clone().requires_grad_()
    per_token_logps = torch.log_softmax(x, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    coef_1 = torch.exp(per_token_logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if beta != 0.0:
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    trl_loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    trl_loss.backward()

    target = torch.where(completion_mask > 0, completion_ids, -100)
    y = logits.detach().clone().requires_grad_()
    out = rl_losses.grpo_loss(y, target, advantages[:, None].expand(batch, length).contiguous(), old,
                              epsilon_low=eps_low, epsilon_high=eps_high, beta=beta,
                              ref_log_probs=ref if beta else None,
                              loss_weights=completion_mask / completion_mask.sum(-1, keepdim=True).clamp(min=1.0),
                              divisor=float(batch))
    out.loss.backward()
    assert_close(out.loss.detach(), trl_loss.detach(), torch.float64)
    assert_grad_close(y.grad, x.grad, torch.float64)


def test_helion_grpo_example_convention(device):
    """Helion's GRPO example (examples/grpo_loss.py: temperature 0.9, β = 0.04, ε_low 0.2, ε_high 0.4, one
    advantage per sequence, completion mask). Its reference formula, written out below, gives per token
        loss = -min(r·A, clip(r)·A)·mask + β·k3(ref - lp)·mask,   kl = k3(ref - lp)·mask,
        is_clipped = (r·A < clip(r)·A).
    The op's per-token loss is read with a one-hot loss weight and divisor 1, its per-token KL from β·k3 with
    A = 0, its per-token clip decision from the clipped fractions of a batch with one labelled token.
    (Helion drops the last logit row of each sequence; the logits here are already the L kept rows.)
    """
    batch, length, vocab = 3, 5, 64
    temperature, beta, eps_low, eps_high = 0.9, 0.04, 0.2, 0.4
    logits = make_logits((batch, length), vocab, torch.float32, device)
    completion_ids = torch.randint(0, vocab, (batch, length), device=device)
    completion_mask = (torch.rand(batch, length, device=device) < 0.8).float()
    seq_advantages = torch.randn(batch, device=device)
    lp = label_log_probs64(logits, completion_ids, 1 / temperature)
    old = (lp + 0.35 * torch.randn(batch, length, device=device, dtype=torch.float64)).float()
    ref = (lp + 0.2 * torch.randn(batch, length, device=device, dtype=torch.float64)).float()

    # Helion's reference formula, in float64.
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    per_token_logps = logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    coef_1 = torch.exp(per_token_logps - old.double())
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    loss1 = coef_1 * seq_advantages.double().unsqueeze(1)
    loss2 = coef_2 * seq_advantages.double().unsqueeze(1)
    mask64 = completion_mask.double()
    per_token_kl = (torch.exp(ref.double() - per_token_logps) - (ref.double() - per_token_logps) - 1) * mask64
    helion_loss = -torch.min(loss1, loss2) * mask64 + beta * per_token_kl
    helion_is_clipped = loss1 < loss2

    target = torch.where(completion_mask > 0, completion_ids, -100)
    advantages = seq_advantages[:, None].expand(batch, length).contiguous()
    common = dict(logits_scale_factor=1 / temperature, epsilon_low=eps_low, epsilon_high=eps_high,
                  ref_log_probs=ref)
    for i in range(batch):
        for t in range(length):
            one_hot = torch.zeros(batch, length, device=device)
            one_hot[i, t] = 1.0
            only = torch.full_like(target, -100)
            only[i, t] = completion_ids[i, t]
            with torch.no_grad():
                loss = rl_losses.grpo_loss(logits, target, advantages, old, beta=beta, loss_weights=one_hot,
                                           divisor=1.0, **common).loss
                kl = rl_losses.grpo_loss(logits, target, torch.zeros_like(advantages), old, beta=beta,
                                         loss_weights=one_hot, divisor=1.0, **common).loss / beta
                single = rl_losses.grpo_loss(logits, only, advantages, old, **common)
            where = f"token ({i}, {t})"
            assert_close(loss, helion_loss[i, t], torch.float32, msg=f"per-token loss at {where}")
            assert_close(kl, per_token_kl[i, t], torch.float32, msg=f"per-token kl at {where}")
            if completion_mask[i, t] == 0:
                continue
            # The op counts the tokens whose clipped term is the smaller one (loss2 < loss1: TRL's
            # is_low/high_clipped); Helion's is_clipped marks the opposite strict inequality. Outside the
            # clip range with A != 0 exactly one of the two holds; inside it neither does.
            op_clipped = (single.clipped_fraction_low + single.clipped_fraction_high).item() > 0
            assert op_clipped == bool(loss2[i, t] < loss1[i, t]), where
            outside = not (1 - eps_low <= coef_1[i, t].item() <= 1 + eps_high)
            assert bool(helion_is_clipped[i, t]) == (outside and seq_advantages[i].item() != 0 and not op_clipped)
