"""Functional wrappers around ``torch.ops.rl_losses``: keyword-only options with SPEC defaults, docstrings
that give each tensor's shape and dtype, and the named result of the policy losses."""
from __future__ import annotations

import os

import torch

from rl_losses.reference import PolicyLossOutput  # noqa: F401  (re-exported: the ops' named result)

_ops = torch.ops.rl_losses


def cuda_kernels_available() -> bool:
    """True when the extension was built with its CUDA kernels (a CPU-only build runs only on the CPU)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("rl_losses::_cross_entropy_forward", "CUDA")


def _check_inputs_enabled() -> bool:
    # Opt-in host-side validation of label / document ids on CUDA (it synchronises with the device).
    # On the CPU the kernels always check; on CUDA an out-of-range label trips a device-side assert.
    return os.environ.get("RL_LOSSES_CHECK_INPUTS", "0") not in ("", "0")


def _check_labels(name: str, target: torch.Tensor, vocab_size: int) -> None:
    if target.is_cuda and target.numel() > 0 and _check_inputs_enabled():
        high = int(target.max())
        if high >= vocab_size:
            raise ValueError(f"{name}: target holds label {high} but the vocabulary has {vocab_size} entries")


def _divisor(divisor) -> float | None:
    if divisor is None:
        return None
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.item()
    return float(divisor)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, logits_scale_factor: float = 1.0,
                  label_smoothing: float = 0.0, z_loss_factor: float = 0.0, reduction: str = "mean",
                  divisor: float | None = None, inplace_backward: bool = False, tp_group=None) -> torch.Tensor:
    """Fused cross-entropy from labels (SPEC §2.1).

    Args:
        logits: (..., V) float32/bfloat16/float16/float64, unit stride in the last dim (under ``tp_group``:
            this rank's vocabulary shard).
        target: (...) int64/int32 label ids; any negative value means "no label".
        logits_scale_factor: s > 0; the softmax is over s·logits.
        label_smoothing: ε in [0, 1). z_loss_factor: ζ >= 0, adds ζ·lse² per labelled token.
        reduction: "mean" (divided by ``divisor``, default the number of labelled tokens), "sum" or "none".
        inplace_backward: write the gradient into ``logits`` (which is then overwritten): zero extra memory.
        tp_group: vocabulary-parallel process group (see rl_losses.distributed).
    Returns: the loss, float32 (float64 for float64 logits): a scalar, or shaped like ``target`` for "none".
    """
    if tp_group is not None:
        from rl_losses import distributed

        return distributed.cross_entropy(logits, target, tp_group=tp_group, logits_scale_factor=logits_scale_factor,
                                         label_smoothing=label_smoothing, z_loss_factor=z_loss_factor,
                                         reduction=reduction, divisor=_divisor(divisor),
                                         inplace_backward=inplace_backward)
    _check_labels("cross_entropy", target, logits.shape[-1])
    loss, _ = _ops.cross_entropy(logits, target, logits_scale_factor=logits_scale_factor,
                                 label_smoothing=label_smoothing, z_loss_factor=z_loss_factor,
                                 reduction=reduction, divisor=_divisor(divisor), inplace_backward=inplace_backward)
    return loss


def _mask_as_target(logits: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    # The z-loss is the cross-entropy op with the label term switched off; its "labels" only carry the mask.
    shape = logits.shape[:-1]
    if loss_mask is None:
        return torch.zeros(shape, dtype=torch.long, device=logits.device)
    if loss_mask.shape != shape:
        raise ValueError(f"z_loss: loss_mask has shape {tuple(loss_mask.shape)} but logits has batch shape "
                         f"{tuple(shape)}")
    return torch.where(loss_mask.bool(), 0, -1).to(torch.long)


def z_loss(logits: torch.Tensor, *, loss_mask: torch.Tensor | None = None, logits_scale_factor: float = 1.0,
           divisor: float | None = None, tp_group=None) -> torch.Tensor:
    """Z-loss alone (Fast-LLM's ``z_loss``): Σ_t mask_t·lse_t² / D, D = Σ mask by default.

    Args:
        logits: (..., V) float tensor; loss_mask: (...) bool/int, default all ones.
    """
    target = _mask_as_target(logits, loss_mask)
    if tp_group is not None:
        from rl_losses import distributed

        return distributed.cross_entropy(logits, target, tp_group=tp_group, logits_scale_factor=logits_scale_factor,
                                         z_loss_factor=1.0, label_weight=0.0, divisor=_divisor(divisor))
    loss, _ = _ops.cross_entropy(logits, target, logits_scale_factor=logits_scale_factor, z_loss_factor=1.0,
                                 label_weight=0.0, divisor=_divisor(divisor))
    return loss


def grpo_loss(*args, **kwargs):  # defined with the GRPO op
    raise NotImplementedError


def gspo_loss(*args, **kwargs):  # defined with the GSPO op
    raise NotImplementedError
