"""Shared by the fused-head tests: the label / z-loss keyword arguments of a term combination, the weighted sum
of the separate ops the head must equal, and the ``head`` config against its separate loss modules."""
import torch

import rl_losses
from rl_losses.config import LanguageModelLossConfig

from conftest import assert_close
from helpers import assert_grad_close

WEIGHTS = {"label": 0.7, "z_loss": 0.3, "grpo": 1.4, "gspo": 1.4}


def assert_terms_close(out, ref, names, dtype, msg_prefix="", **kwargs):
    """Each of the FusedHeadOutput fields `names` of the head against the reference's: None in both (a term of weight
    0 is not computed) or close."""
    for name in names:
        a, b = getattr(out, name), getattr(ref, name)
        assert (a is None) == (b is None), f"{msg_prefix}{name}: {a} against the reference's {b}"
        if a is not None:
            assert_close(a.detach(), b.detach(), dtype, msg=msg_prefix + name, **kwargs)


def other_term_kwargs(terms, target, options):
    """fused_head_loss's keyword arguments of the label and z-loss terms among `terms` (and the scale)."""
    kwargs = dict(logits_scale_factor=options.get("logits_scale_factor", 1.0))
    if "label" in terms:
        kwargs.update(label_weight=WEIGHTS["label"], label_smoothing=options.get("label_smoothing", 0.0),
                      label_divisor=options.get("label_divisor"))
    if "z_loss" in terms:
        z_mask = (torch.rand(target.shape, device=target.device) > 0.3) if options.get("z_loss_mask") else None
        kwargs.update(z_loss_weight=WEIGHTS["z_loss"], z_loss_divisor=options.get("z_loss_divisor"),
                      z_loss_mask=z_mask)
    return kwargs


def separate_ops(x, target, kwargs):
    """The weighted sum of the separate ops (rl_losses.cross_entropy, z_loss, grpo_loss or gspo_loss) on the
    head's keyword arguments, each differentiable (the policy terms' ε are the tests' 0.15 / 0.25)."""
    s = kwargs["logits_scale_factor"]
    total = 0.0
    if kwargs.get("label_weight"):
        total = total + kwargs["label_weight"] * rl_losses.cross_entropy(
            x, target, logits_scale_factor=s, label_smoothing=kwargs["label_smoothing"],
            divisor=kwargs["label_divisor"])
    if kwargs.get("z_loss_weight"):
        total = total + kwargs["z_loss_weight"] * rl_losses.z_loss(
            x, loss_mask=kwargs["z_loss_mask"], logits_scale_factor=s, divisor=kwargs["z_loss_divisor"])
    if kwargs.get("grpo_weight"):
        total = total + kwargs["grpo_weight"] * rl_losses.grpo_loss(
            x, target, kwargs["advantages"], kwargs["old_log_probs"], epsilon_low=0.15, epsilon_high=0.25,
            delta=kwargs["delta"], beta=kwargs["beta"], ref_log_probs=kwargs["ref_log_probs"],
            loss_weights=kwargs["loss_weights"], divisor=kwargs["grpo_divisor"], logits_scale_factor=s).loss
    if kwargs.get("gspo_weight"):
        total = total + kwargs["gspo_weight"] * rl_losses.gspo_loss(
            x, target, kwargs["advantages"], kwargs["old_log_probs"], kwargs["document_index"],
            num_documents=kwargs["num_documents"], label_counts=kwargs["label_counts"], epsilon_low=0.15,
            epsilon_high=0.25, weighting=kwargs["weighting"], divisor=kwargs["gspo_divisor"],
            logits_scale_factor=s, ref_log_probs=kwargs["ref_log_probs"], beta=kwargs["beta"]).loss
    return total


def head_equals_separate_modules(losses, logits, batch):
    """The ``fused_head`` config of `losses` gives the sum of the separate loss modules: loss, gradient, each metric."""
    head = LanguageModelLossConfig.from_dict({"type": "fused_head", "losses": losses}).get_loss()
    assert LanguageModelLossConfig.from_dict(head.config.to_dict()) == head.config
    x = logits.clone().requires_grad_()
    loss, metrics = head(x, batch)
    loss.backward()
    y = logits.clone().requires_grad_()
    expected, expected_metrics = 0.0, {}
    for name, cfg in losses.items():
        part, m = LanguageModelLossConfig.from_dict(cfg).get_loss(name=name)(y, batch)
        expected = expected + part
        expected_metrics.update(m)
    expected.backward()
    assert_close(loss.detach(), expected.detach(), torch.float32, scale=4.0)
    assert_grad_close(x.grad, y.grad, torch.float32, scale=2.0)
    assert set(metrics) == set(expected_metrics) | {"fused_head"}  # the head's own (weighted) total
    for name, value in expected_metrics.items():
        assert_close(metrics[name], value, torch.float32, scale=4.0, msg=name)


def head_equals_separate_ops(logits, target, kwargs, dtype, n_terms):
    """fused_head_loss on `kwargs` against the weighted sum of the separate ops: loss and gradient (for an
    upstream gradient of 1.3). Returns the head's output and its gradient. The same fp32 formulas in another
    order: the gradient to its dtype's rounding, the loss to fp32's. The separate ops' gradient is a sum of
    terms each rounded to the dtype, which may cancel (the label column of CE and a policy term): in bf16/fp16
    its own error reaches a few roundings of the terms."""
    from rl_losses.fused_head import fused_head_loss

    x = logits.clone().requires_grad_()
    out = fused_head_loss(x, target, **kwargs)
    (out.loss * 1.3).backward()
    y = logits.clone().requires_grad_()
    (separate_ops(y, target, kwargs) * 1.3).backward()
    assert_close(out.loss.detach(), separate_ops(logits, target, kwargs).detach(), torch.float32, scale=4.0)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    assert_grad_close(x.grad, y.grad, dtype, scale=8.0 if low_precision and n_terms > 1 else 2.0)
    return out, x.grad
