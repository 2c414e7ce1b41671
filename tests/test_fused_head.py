"""Tests of the fused head (several losses in one pass; docs/distillation_dpo.md): for every combination of label
cross-entropy, z-loss and GRPO, the loss, each term and the gradient equal the weighted sum of the separate ops
and the float64 reference; opcheck, gradcheck, torch.compile, inplace_backward, the ``head`` config, bad input."""
import itertools

import pytest
import torch

import rl_losses
import rl_losses.fused_head
from rl_losses import reference
from rl_losses.config import LanguageModelLossConfig
from rl_losses.fused_head import fused_head_loss

from conftest import assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, gradcheck_fresh, label_log_probs64,
                     make_logits, make_target, param_id as _id)
from helpers_head import (WEIGHTS, assert_terms_close, head_equals_separate_modules, head_equals_separate_ops,
                          other_term_kwargs)

_ops = torch.ops.rl_losses
TERMS = ("label", "z_loss", "grpo")
COMBINATIONS = [c for r in (1, 2, 3) for c in itertools.combinations(TERMS, r)]


def make_inputs(shape, vocab, dtype, device):
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=0.3)
    lp = label_log_probs64(logits, target)
    advantages = torch.randn(shape, device=device)
    old = (lp + 0.3 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    ref = (lp + 0.2 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    weights = torch.rand(shape, device=device)
    return logits, target, advantages, old, ref, weights


def head_kwargs(terms, inputs, options):
    _, target, advantages, old, ref, weights = inputs
    kwargs = other_term_kwargs(terms, target, options)
    if "grpo" in terms:
        kwargs.update(grpo_weight=WEIGHTS["grpo"], advantages=advantages, old_log_probs=old,
                      epsilon_low=0.15, epsilon_high=0.25, beta=options.get("beta", 0.0),
                      ref_log_probs=ref if options.get("beta") else None,
                      loss_weights=weights if options.get("loss_weights") else None,
                      grpo_divisor=options.get("grpo_divisor"), delta=options.get("delta"))
    return kwargs


OPTIONS = {
    "plain": {},
    "options": {"logits_scale_factor": 0.8, "label_smoothing": 0.1, "beta": 0.05, "loss_weights": True,
                "delta": 1.5, "z_loss_mask": True},
    "divisors": {"label_divisor": 7.0, "z_loss_divisor": 3.0, "grpo_divisor": 11.0},
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("vocab", [7, 769])
@pytest.mark.parametrize("terms", COMBINATIONS, ids="+".join)
def test_equals_the_sum_of_the_separate_ops(terms, vocab, dtype, option, device):
    inputs = make_inputs((13,), vocab, dtype, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(terms, inputs, OPTIONS[option])
    out, grad = head_equals_separate_ops(logits, target, kwargs, dtype, len(terms))
    # And against the float64 reference, loss, every term and the gradient.
    z = logits.detach().double().requires_grad_()
    ref = reference.fused_head_loss(z, target, **{k: v.double() if isinstance(v, torch.Tensor) and
                                                   v.is_floating_point() else v for k, v in kwargs.items()})
    if "z_loss" in terms:  # the z-loss covers unlabelled tokens too (its own mask)
        z_rows = kwargs["z_loss_mask"] if kwargs["z_loss_mask"] is not None else torch.ones_like(target, dtype=bool)
        assert torch.count_nonzero(grad[(target < 0) & ~z_rows]) == 0
    (ref.loss * 1.3).backward()
    assert_terms_close(out, ref, ("loss", "label_loss", "z_loss", "grpo_loss", "log_probs"), dtype)
    assert_grad_close(grad, z.grad, dtype)
    if "z_loss" not in terms:
        assert torch.count_nonzero(grad[target < 0]) == 0


@pytest.mark.parametrize("vocab", [7, 769])
@pytest.mark.parametrize("z_mask", ["labels", "random", "none"])
def test_reads_only_the_rows_its_terms_use(z_mask, vocab, device):
    """A row with neither a label nor the z-loss is skipped unread (NaN logits there change nothing, and its
    gradient is 0); the z-loss's unlabelled rows are read and get their gradient."""
    inputs = make_inputs((4, 9), vocab, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(TERMS, inputs, {"z_loss_mask": z_mask == "random", "label_smoothing": 0.1})
    if z_mask == "labels":
        kwargs["z_loss_mask"] = target >= 0
    z_rows = kwargs["z_loss_mask"] if kwargs["z_loss_mask"] is not None else torch.ones_like(target, dtype=bool)
    unused = (target < 0) & ~z_rows
    poisoned = logits.masked_fill(unused[..., None], float("nan"))
    x = poisoned.clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    (out.loss * 0.9).backward()
    z = logits.detach().double().requires_grad_()
    ref = reference.fused_head_loss(z, target, **{k: v.double() if isinstance(v, torch.Tensor) and
                                                   v.is_floating_point() else v for k, v in kwargs.items()})
    (ref.loss * 0.9).backward()
    assert_terms_close(out, ref, ("loss", "label_loss", "z_loss", "grpo_loss", "log_probs"), torch.float32)
    assert_grad_close(x.grad, z.grad, torch.float32)
    assert torch.count_nonzero(x.grad[unused]) == 0
    assert torch.count_nonzero(x.grad[(target < 0) & z_rows]) == ((target < 0) & z_rows).sum() * vocab


def test_inplace_backward_matches(device):
    inputs = make_inputs((4, 5), 97, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(TERMS, inputs, OPTIONS["options"])
    x = logits.clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    out.loss.backward()
    y = logits.clone().requires_grad_()
    out_inplace = fused_head_loss(y * 1.0, target, inplace_backward=True, **kwargs)
    out_inplace.loss.backward()
    torch.testing.assert_close(out_inplace.loss, out.loss)
    torch.testing.assert_close(y.grad, x.grad)


@pytest.mark.parametrize("path", ["autograd", "no_grad", "inplace", "meta", "forward_backward"])
@pytest.mark.parametrize("terms", [("label",), ("z_loss",), ("label", "grpo"), TERMS], ids="+".join)
def test_terms_of_weight_0_are_none(terms, path, device):
    """A term whose weight is 0 is not computed and its loss is None on every path (the op makes no output for it);
    the others are 0-dim tensors equal to the float64 reference's."""
    inputs = make_inputs((3, 4), 30, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(terms, inputs, {})
    x = logits.clone().requires_grad_()
    if path == "no_grad":
        out = fused_head_loss(logits, target, **kwargs)
    elif path == "inplace":
        out = fused_head_loss(x * 1.0, target, inplace_backward=True, **kwargs)
    elif path == "meta":
        out = fused_head_loss(logits.to("meta"), target.to("meta"),
                              **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    elif path == "forward_backward":
        out, _ = rl_losses.forward_backward(fused_head_loss, logits, target, **kwargs)
    else:
        out = fused_head_loss(x, target, **kwargs)
    on = {"label_loss": "label" in terms, "z_loss": "z_loss" in terms, "grpo_loss": "grpo" in terms,
          "gspo_loss": False, "distillation_loss": False}
    for name, is_on in on.items():
        assert (getattr(out, name) is not None) == is_on, (name, getattr(out, name))
    if path != "meta":
        ref = reference.fused_head_loss(logits.double(), target, **{
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()})
        assert_terms_close(out, ref, ("loss", *on), torch.float32)


def test_gradcheck(device):
    inputs = make_inputs((5,), 6, torch.float64, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(TERMS, inputs, OPTIONS["options"])
    gradcheck_fresh(lambda x: fused_head_loss(x, target, **kwargs).loss, logits.clone().requires_grad_())


def test_opcheck(device):
    inputs = make_inputs((6,), 11, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(TERMS, inputs, OPTIONS["options"])
    torch.library.opcheck(_ops.fused_head, (logits.clone().requires_grad_(), target), kwargs)
    # The tensor-parallel hooks: given statistics (as the all-reduce leaves them), a shard's columns.
    stats = _ops.row_stats(logits, target, logits_scale_factor=kwargs["logits_scale_factor"], smoothing=True)
    torch.library.opcheck(_ops.fused_head, (logits[:, 4:].clone().requires_grad_(), target),
                          dict(kwargs, row_stats=stats, vocab_start=4, vocab_size=11))


def test_compile_fullgraph(device):
    inputs = make_inputs((3, 4), 30, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(TERMS, inputs, OPTIONS["plain"])

    def fn(x, t):
        out = fused_head_loss(x, t, **kwargs)
        return out.loss, out.label_loss, out.grpo_loss

    assert_compiled_matches_eager(fn, logits, target, backend="aot_eager")


def test_head_config_fuses_and_matches_the_separate_modules(device, monkeypatch):
    calls = []
    monkeypatch.setattr(rl_losses.fused_head, "fused_head_loss", lambda *a, **k: calls.append(k) or fused_head_loss(*a, **k))
    inputs = make_inputs((12,), 40, torch.float32, device)
    logits, target, advantages, old = inputs[:4]
    batch = {"labels": target, "advantages": advantages, "old_log_probabilities": old,
             "loss_mask": torch.rand(target.shape, device=device) > 0.2}
    losses = {"ce": {"type": "label", "weight": 0.5, "label_smoothing": 0.1}, "z": {"type": "z_loss", "weight": 0.1},
              "pg": {"type": "grpo", "weight": 2.0, "epsilon_high": 0.3}}
    head_equals_separate_modules(losses, logits, batch)
    assert len(calls) == 1 and calls[0]["label_weight"] and calls[0]["z_loss_weight"] and calls[0]["grpo_weight"]


def test_bad_input(device):
    logits = torch.randn(4, 10, device=device)
    target = torch.tensor([1, 2, -100, 3], device=device)
    with pytest.raises(RuntimeError, match="grpo_weight = 1 > 0 needs advantages and old_log_probs"):
        fused_head_loss(logits, target, grpo_weight=1.0)
    with pytest.raises(RuntimeError, match="label_weight must be finite and >= 0, got -1"):
        fused_head_loss(logits, target, label_weight=-1.0)
    with pytest.raises(RuntimeError, match=r"label_smoothing must be in \[0, 1\), got 1"):
        fused_head_loss(logits, target, label_weight=1.0, label_smoothing=1.0)
    with pytest.raises(RuntimeError, match="advantages has shape"):
        fused_head_loss(logits, target, grpo_weight=1.0, advantages=torch.zeros(3, device=device),
                        old_log_probs=torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="losses must be a non-empty dict"):
        LanguageModelLossConfig.from_dict({"type": "fused_head", "losses": {}})


def test_head_config_adds_the_losses_it_cannot_fuse(device, monkeypatch):
    calls = []
    monkeypatch.setattr(rl_losses.fused_head, "fused_head_loss", lambda *a, **k: calls.append(k) or fused_head_loss(*a, **k))
    """Distillation and DPO run on their own beside the fused pass; the head's loss and gradient are the sums."""
    inputs = make_inputs((2, 12), 40, torch.float32, device)
    logits, target = inputs[:2]
    teacher = logits.float() + torch.randn_like(logits.float())
    batch = {"labels": target, "reference_logits": {"teacher": teacher, "reference": teacher},
             "chosen_spans": [[(0, 4)], [(1, 3)]], "rejected_spans": [[(5, 11)], [(6, 12)]]}
    losses = {"ce": {"type": "label"}, "z": {"type": "z_loss", "weight": 0.2},
              "kd": {"type": "distillation", "loss_type": "reverse_kl", "weight": 0.5},
              "pref": {"type": "dpo", "beta": 0.2}}
    head = LanguageModelLossConfig.from_dict({"type": "fused_head", "losses": losses}).get_loss()
    x = logits.clone().requires_grad_()
    loss, metrics = head(x, batch)
    loss.backward()
    y = logits.clone().requires_grad_()
    expected = sum(LanguageModelLossConfig.from_dict(cfg).get_loss(name=name)(y, batch)[0]
                   for name, cfg in losses.items())
    expected.backward()
    assert_close(loss.detach(), expected.detach(), torch.float32, scale=4.0)
    assert_grad_close(x.grad, y.grad, torch.float32, scale=2.0)
    assert {"ce", "z", "kd", "pref", "pref_accuracy"} <= set(metrics)
    assert len(calls) == 1 and calls[0]["label_weight"] == 1.0 and calls[0]["z_loss_weight"] == 0.2
