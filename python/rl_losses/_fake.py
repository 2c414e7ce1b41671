"""Fake (meta) kernels of every op, so that torch.compile and meta tensors can trace them.

They only describe output shapes, dtypes and devices; they mirror the C++ shape logic in csrc/.
"""
import torch
from torch.library import register_fake


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batch(target: torch.Tensor) -> list:
    return list(target.shape)


@register_fake("rl_losses::row_stats")
def _row_stats(logits, target, *, logits_scale_factor=1.0, vocab_start=0, vocab_size=-1, entropy=False,
               smoothing=False):
    return logits.new_empty(_batch(target) + [5], dtype=_acc(logits.dtype))


@register_fake("rl_losses::_scale_grad_")
def _scale_grad_(grad, grad_output):
    return None


def _ce_outputs(logits, target, reduction):
    acc = _acc(logits.dtype)
    loss = logits.new_empty(_batch(target) if reduction == "none" else [], dtype=acc)
    return loss, logits.new_empty(_batch(target), dtype=acc)


@register_fake("rl_losses::cross_entropy")
def _cross_entropy(logits, target, *, logits_scale_factor=1.0, label_smoothing=0.0, z_loss_factor=0.0,
                   label_weight=1.0, reduction="mean", divisor=None, inplace_backward=False, row_stats=None,
                   vocab_start=0, vocab_size=-1):
    return _ce_outputs(logits, target, reduction)


@register_fake("rl_losses::_cross_entropy_forward")
def _cross_entropy_forward(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start, vocab_size,
                           compute_grad):
    loss, lse = _ce_outputs(logits, target, reduction)
    grad = (torch.empty_like(logits, memory_format=torch.contiguous_format) if compute_grad
            else logits.new_empty([0]))
    return loss, lse, grad


@register_fake("rl_losses::_cross_entropy_forward_inplace")
def _cross_entropy_forward_inplace(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start,
                                   vocab_size):
    return _ce_outputs(logits, target, reduction)
