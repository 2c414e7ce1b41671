"""Tests of the fused head's distillation term (docs/distillation_dpo.md): for every kind, alone and with each of
label cross-entropy, z-loss and GRPO, the loss, every term, the log-probs and the gradient equal the float64
reference on fresh random inputs (masked rows, bf16/fp32); the term alone equals rl_losses.distillation_loss;
rows the distillation mask leaves out are not read for it; inplace_backward, gradcheck, opcheck, the
``fused_head`` config with a distillation loss, and the refusals (GSPO, tensor parallelism, a missing teacher)."""
import pytest
import torch

import rl_losses
import rl_losses.fused_head
from rl_losses import reference
from rl_losses.fused_head import fused_head_loss

from conftest import assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, gradcheck_fresh, label_log_probs64, make_logits,
                     make_target, param_id as _id)
from helpers_head import WEIGHTS, assert_terms_close, head_equals_separate_modules, other_term_kwargs

_ops = torch.ops.rl_losses
KINDS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("cross_entropy", 0.5), ("jsd", 0.3), ("jsd", 0.0)]
COMBINATIONS = [(), ("label",), ("z_loss",), ("grpo",), ("label", "z_loss", "grpo")]
DISTILL_WEIGHT = 0.9


def make_inputs(shape, vocab, dtype, device, teacher_dtype=None):
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=0.3)
    # The teacher near the student: divergences of O(1), neither side's gradient dominant.
    teacher = (logits.float() + 1.5 * torch.randn(logits.shape, device=device)).to(teacher_dtype or dtype)
    lp = label_log_probs64(logits, target)
    advantages = torch.randn(shape, device=device)
    old = (lp + 0.3 * torch.randn(shape, device=device, dtype=torch.float64)).float()
    return logits, target, teacher, advantages, old


def head_kwargs(terms, inputs, kind, beta, options):
    _, target, teacher, advantages, old = inputs
    kwargs = other_term_kwargs(terms, target, options)
    if "grpo" in terms:
        kwargs.update(grpo_weight=WEIGHTS["grpo"], advantages=advantages, old_log_probs=old, epsilon_low=0.15,
                      epsilon_high=0.25)
    mask = (torch.rand(target.shape, device=target.device) > 0.3) if options.get("distillation_mask") else None
    kwargs.update(distillation_weight=DISTILL_WEIGHT, teacher_logits=teacher, kind=kind, distillation_beta=beta,
                  temperature=options.get("temperature", 1.0), distillation_mask=mask,
                  distillation_divisor=options.get("distillation_divisor"))
    return kwargs


def as64(kwargs):
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}


def check_against_reference(logits, target, kwargs, dtype, upstream=1.3):
    x = logits.detach().clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    (out.loss * upstream).backward()
    z = logits.detach().double().requires_grad_()
    ref = reference.fused_head_loss(z, target, **as64(kwargs))
    (ref.loss * upstream).backward()
    assert_terms_close(out, ref, ("loss", "label_loss", "z_loss", "grpo_loss", "distillation_loss", "log_probs"), dtype,
                       scale=2.0)
    assert_grad_close(x.grad, z.grad, dtype, scale=2.0)
    return out, x.grad


OPTIONS = {
    "plain": {},
    "options": {"logits_scale_factor": 0.8, "label_smoothing": 0.1, "temperature": 1.7, "z_loss_mask": True,
                "distillation_mask": True},
    "divisors": {"label_divisor": 7.0, "z_loss_divisor": 3.0, "distillation_divisor": 5.0, "distillation_mask": True},
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("terms", COMBINATIONS, ids=lambda t: "+".join(("distill",) + t))
@pytest.mark.parametrize("kind,beta", KINDS, ids=lambda v: str(v))
def test_equals_the_reference(kind, beta, terms, dtype, option, device):
    inputs = make_inputs((13,), 264, dtype, device)
    kwargs = head_kwargs(terms, inputs, kind, beta, OPTIONS[option])
    _, grad = check_against_reference(inputs[0], inputs[1], kwargs, dtype)
    mask = kwargs["distillation_mask"]
    if mask is not None and not terms:  # the distillation term alone: its masked rows get exact zeros
        assert torch.count_nonzero(grad[~mask]) == 0


@pytest.mark.parametrize("kind,beta", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_distillation_term_equals_the_op(kind, beta, teacher_dtype, device):
    logits, target, teacher, _, _ = make_inputs((3, 5), 136, torch.bfloat16, device, teacher_dtype)
    mask = torch.rand(target.shape, device=device) > 0.3
    x = logits.clone().requires_grad_()
    out = fused_head_loss(x, target, distillation_weight=1.0, teacher_logits=teacher, kind=kind,
                          distillation_beta=beta, temperature=1.2, distillation_mask=mask)
    out.loss.backward()
    y = logits.clone().requires_grad_()
    op = rl_losses.distillation_loss(y, teacher, kind=kind, beta=beta, temperature=1.2, loss_mask=mask)
    op.loss.backward()
    torch.testing.assert_close(out.distillation_loss, op.loss.detach())
    torch.testing.assert_close(out.loss.detach(), op.loss.detach())
    torch.testing.assert_close(x.grad, y.grad)
    assert out.label_loss is None and out.z_loss is None and out.grpo_loss is None and out.gspo_loss is None  # weight 0


# On CUDA, V = 264 runs the cluster kernel with the head (bf16/fp32, teacher of the student's dtype), V = 97 the
# separate passes.
@pytest.mark.parametrize("vocab", [97, 264])
@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("jsd", 0.3)], ids=lambda v: str(v))
def test_masked_rows_read_no_teacher(kind, beta, vocab, device):
    """A row the distillation mask leaves out: its teacher's values (NaN here) change nothing, and the other terms
    still see the row (its label CE and gradient)."""
    inputs = make_inputs((4, 6), vocab, torch.float32, device)
    logits, target, teacher = inputs[:3]
    kwargs = head_kwargs(("label", "z_loss", "grpo"), inputs, kind, beta, {"distillation_mask": True})
    mask = kwargs["distillation_mask"]
    kwargs["teacher_logits"] = teacher.masked_fill(~mask[..., None], float("nan"))
    x = logits.clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    out.loss.backward()
    kwargs["teacher_logits"] = teacher
    z = logits.double().requires_grad_()
    ref = reference.fused_head_loss(z, target, **as64(kwargs))
    ref.loss.backward()
    assert_close(out.loss.detach(), ref.loss.detach(), torch.float32, scale=2.0)
    assert_grad_close(x.grad, z.grad, torch.float32, scale=2.0)


@pytest.mark.parametrize("vocab", [97, 264])
def test_inplace_backward_matches(vocab, device):
    inputs = make_inputs((4, 5), vocab, torch.bfloat16, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "grpo"), inputs, "reverse_kl", 0.5, OPTIONS["options"])
    x = logits.clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    out.loss.backward()
    y = logits.clone().requires_grad_()
    out_inplace = fused_head_loss(y * 1.0, target, inplace_backward=True, **kwargs)
    out_inplace.loss.backward()
    torch.testing.assert_close(out_inplace.loss, out.loss)
    torch.testing.assert_close(y.grad, x.grad)


@pytest.mark.parametrize("kind,beta", [("reverse_kl", 0.5), ("jsd", 0.3)], ids=lambda v: str(v))
@pytest.mark.parametrize("shape,vocab", [((1100,), 1024), ((6,), 131080)], ids=["many_rows", "wide_rows"])
def test_many_and_wide_rows(shape, vocab, kind, beta, device):
    """More rows than the cluster kernel's resident clusters (its tail launch: the head indexes the rows of the
    whole call) and rows split over several CTAs (the label's column in one slice of the row)."""
    inputs = make_inputs(shape, vocab, torch.bfloat16, device)
    kwargs = head_kwargs(("label", "z_loss", "grpo"), inputs, kind, beta, {"distillation_mask": True})
    check_against_reference(inputs[0], inputs[1], kwargs, torch.bfloat16)


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.5), ("jsd", 0.4)], ids=lambda v: str(v))
def test_gradcheck(kind, beta, device):
    inputs = make_inputs((5,), 6, torch.float64, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "grpo"), inputs, kind, beta, OPTIONS["options"])
    gradcheck_fresh(lambda x: fused_head_loss(x, target, **kwargs).loss, logits.clone().requires_grad_())


def test_opcheck(device):
    inputs = make_inputs((6,), 11, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "z_loss", "grpo"), inputs, "jsd", 0.3, OPTIONS["options"])
    torch.library.opcheck(_ops.fused_head, (logits.clone().requires_grad_(), target), kwargs)


def test_compile_fullgraph(device):
    inputs = make_inputs((3, 4), 32, torch.float32, device)
    logits, target = inputs[:2]
    kwargs = head_kwargs(("label", "grpo"), inputs, "jsd", 0.3, {"distillation_mask": True})

    def fn(x, t):
        out = fused_head_loss(x, t, **kwargs)
        return out.loss, out.distillation_loss, out.label_loss

    assert_compiled_matches_eager(fn, logits, target, backend="aot_eager")


def test_head_config_fuses_a_distillation_loss(device, monkeypatch):
    calls = []
    monkeypatch.setattr(rl_losses.fused_head, "fused_head_loss", lambda *a, **k: calls.append(k) or fused_head_loss(*a, **k))
    logits, target, teacher, advantages, old = make_inputs((12,), 40, torch.float32, device)
    batch = {"labels": target, "advantages": advantages, "old_log_probabilities": old,
             "loss_mask": torch.rand(target.shape, device=device) > 0.2, "reference_logits": {"teacher": teacher}}
    losses = {"ce": {"type": "label", "weight": 0.5}, "z": {"type": "z_loss", "weight": 0.1},
              "pg": {"type": "grpo", "weight": 2.0}, "kd": {"type": "distillation", "weight": 0.7,
                                                             "loss_type": "reverse_kl", "temperature": 1.5}}
    head_equals_separate_modules(losses, logits, batch)
    assert len(calls) == 1 and calls[0]["distillation_weight"] == 0.7 and calls[0]["kind"] == "reverse_kl"


def test_bad_input(device):
    logits, target, teacher, advantages, old = make_inputs((4,), 10, torch.float32, device)
    with pytest.raises(RuntimeError, match="distillation_weight = 1 > 0 needs teacher_logits"):
        fused_head_loss(logits, target, distillation_weight=1.0)
    with pytest.raises(RuntimeError, match="distillation_weight must be finite and >= 0, got -1"):
        fused_head_loss(logits, target, distillation_weight=-1.0, teacher_logits=teacher)
    with pytest.raises(RuntimeError, match=r"fused_head: distillation_beta must be in \[0, 1\], got 2"):
        fused_head_loss(logits, target, distillation_weight=1.0, teacher_logits=teacher, kind="jsd",
                        distillation_beta=2.0)
    with pytest.raises(RuntimeError, match="fused_head: teacher_logits has shape"):
        fused_head_loss(logits, target, distillation_weight=1.0, teacher_logits=teacher[:, :9])
    with pytest.raises(RuntimeError, match="fused_head: distillation_mask has shape"):
        fused_head_loss(logits, target, distillation_weight=1.0, teacher_logits=teacher,
                        distillation_mask=torch.ones(3, dtype=torch.bool, device=device))
    with pytest.raises(RuntimeError, match="are both > 0; the head fuses distillation with CE, z-loss and GRPO"):
        fused_head_loss(logits, target, distillation_weight=1.0, teacher_logits=teacher, gspo_weight=1.0,
                        advantages=advantages, document_index=torch.zeros_like(target))
    stats = _ops.row_stats(logits, target)
    with pytest.raises(RuntimeError, match=r"runs without tensor parallelism \(row_stats given\)"):
        _ops.fused_head(logits, target, distillation_weight=1.0, teacher_logits=teacher, row_stats=stats)
