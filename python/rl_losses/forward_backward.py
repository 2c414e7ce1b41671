"""The loss and its gradient in one call, without autograd: Fast-LLM's ``*_forward_backward`` form.

The loss ops compute the gradient of their inputs in their forward pass (for an upstream gradient of 1) and autograd's
backward only scales it. A trainer that runs its own backward (Fast-LLM's engine, a hand-written pipeline stage) can
take that gradient from the call itself: ``forward_backward(rl_losses.grpo_loss, logits, target, ...)`` returns the
wrapper's result and the gradient, with no autograd node, no ``loss.backward()`` and, for an upstream gradient of 1,
no scaling launch (but where fp16 gradient rows are stored pre-scaled). On CUDA this spares the host the autograd
step, which costs a one-node graph ~110-150 µs more with CUDA tensors than with CPU ones (docs/host_time.md).

Any functional wrapper over one loss op works: of the logits (``cross_entropy``, ``z_loss``, ``grpo_loss``,
``gspo_loss``, ``distillation_loss``, ``dpo_loss``, ``fused_head_loss``, ``topk_distillation_loss``) or of the hidden
states (``linear_cross_entropy``, ``linear_grpo_loss``, ``linear_gspo_loss``, ``linear_topk_distillation_loss``),
with every option it takes but ``tp_group`` / ``sdp_group`` (the distributed layer's autograd functions exchange
gradients in their backward) and ``inplace_backward``. Not a loss module (it weights its loss), not a function that
scales or combines a wrapper's loss (the gradient is the op's loss's), not under torch.compile.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from rl_losses import _schema
from rl_losses._inputs import _CAPTURE

_ops = torch.ops.rl_losses
# The ops whose forward returns the gradient: the public op's arguments less inplace_backward, then compute_grad
# (csrc/common/fused_loss_autograd.cpp).
_LOSS_OPS = ("cross_entropy", "grpo", "gspo", "distillation", "dpo", "fused_head", "topk_distillation")
# The lm_head's: the public op's arguments, then output_mask; the gradients of hidden, weight and bias after the
# results.
_LINEAR_OPS = ("linear_cross_entropy", "linear_grpo", "linear_gspo", "linear_topk_distillation")


def _forward_call(op: str) -> Callable:
    """``call(capture, <the public op's arguments>)``: runs the op's forward asked for the gradients, hands them to
    `capture` and returns the public op's results. The forwards take the public op's arguments with its defaults
    (registration.cpp), so the call passes on what the wrapper gave: binding every one of GRPO's ~48 arguments from
    Python had cost more than the op."""
    forward = getattr(_ops, f"_{op}_forward").default
    n = len(_schema.results(op))
    if op in _LINEAR_OPS:
        def call(capture, *args, **kwargs):
            # The public op's bias and weight_main_grad are keyword-only; with weight_main_grad the weight's
            # gradient is added to it in the forward, none returned.
            bias, main_grad = kwargs.get("bias"), kwargs.get("weight_main_grad")
            out = forward(*args, output_mask=[True, True, bias is not None], **kwargs)
            grads = (out[n], None if main_grad is not None else out[n + 1], out[n + 2] if bias is not None else None)
            capture.found(op, grads, out[0], None, main_grad is not None)
            return out[:n]
        return call
    unscale = forward._schema.returns[-1].name == "grad_row_unscale"

    def call(capture, *args, inplace_backward=False, **kwargs):
        if inplace_backward:
            raise ValueError("rl_losses.forward_backward: inplace_backward is not supported; the gradient is returned")
        out = forward(*args, compute_grad=True, **kwargs)
        capture.found(op, out[n], out[0], out[-1] if unscale else None, False)
        return out[:n]
    return call


_FORWARDS = {op: _forward_call(op) for op in _LOSS_OPS + _LINEAR_OPS}


class _Capture:
    """A forward_backward call in progress: what the wrapper's op call gave."""

    __slots__ = ("grad", "loss", "version", "unscale", "into_main_grad", "ops")

    def __init__(self):
        self.grad = self.loss = self.unscale = None
        self.into_main_grad = False
        self.ops = []

    def found(self, op: str, grad, loss: torch.Tensor, unscale: torch.Tensor | None, into_main_grad: bool) -> None:
        self.ops.append(op)
        self.grad, self.loss, self.unscale, self.into_main_grad = grad, loss, unscale, into_main_grad
        self.version = loss._version  # an in-place change of the loss (loss /= k) would leave the gradient behind

    def stub(self, packet) -> Callable:
        op = packet._qualified_op_name.partition("::")[2]
        forward = _FORWARDS.get(op)
        if forward is None:
            raise TypeError(f"rl_losses.forward_backward: the op {op} does not compute its gradient in the forward "
                            f"(the loss ops do: {', '.join(_LOSS_OPS + _LINEAR_OPS)})")
        return partial(forward, self)


def forward_backward(loss_fn: Callable, *args: Any, grad_output: float | torch.Tensor | None = None,
                     **options: Any) -> tuple[Any, torch.Tensor]:
    """``loss_fn(*args, **options)`` and the gradient of its loss with respect to the logits (``args[0]``), or to the
    hidden states, the lm_head weight and bias, in one call without autograd.

    Args:
        loss_fn: a functional wrapper over one loss op: of the logits (rl_losses.cross_entropy, z_loss, grpo_loss,
            gspo_loss, distillation_loss, dpo_loss, fused_head_loss, topk_distillation_loss) or of the hidden states
            (linear_cross_entropy, linear_grpo_loss, linear_gspo_loss, linear_topk_distillation_loss).
        grad_output: the upstream gradient of the returned loss: None (1 for every loss value: the gradient as
            computed, no launch but for fp16 gradient rows stored pre-scaled; the number 1 alike), a number or 0-dim
            tensor (for every
            loss value) or a tensor of the loss's shape (reduction "none": one per token), scaled into the gradient
            in place.
        options: the wrapper's options, but ``tp_group``, ``sdp_group`` and ``inplace_backward`` (refused).
    Returns: (the wrapper's result, the gradient): the logits' gradient (their shape and dtype), or for the lm_head
        ops (grad_hidden, grad_weight, grad_bias), grad_weight None where weight_main_grad took it (which takes no
        grad_output), grad_bias None without a bias. Nothing records an autograd graph (the result's tensors do not
        require grad).
    """
    if options.get("tp_group") is not None or options.get("sdp_group") is not None:
        raise ValueError("rl_losses.forward_backward: tp_group and sdp_group are not supported (the distributed "
                         "losses exchange their gradients in autograd's backward); call the wrapper and "
                         "loss.backward()")
    if isinstance(loss_fn, torch.nn.Module):
        raise TypeError("rl_losses.forward_backward takes a functional wrapper (rl_losses.grpo_loss, ...), not a loss "
                        "module: a module weights its loss and may call its op directly")
    if torch.compiler.is_compiling():
        raise RuntimeError("rl_losses.forward_backward: not supported under torch.compile (it traces the ops, not "
                           "their forward with its gradient); compile the wrapper and call loss.backward()")
    if getattr(_CAPTURE, "call", None) is not None:
        raise RuntimeError("rl_losses.forward_backward: called inside another forward_backward's loss_fn")
    c = _CAPTURE.call = _Capture()
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without its context object's frames
    try:
        result = loss_fn(*args, **options)
    finally:
        torch._C._set_grad_enabled(grad_mode)
        _CAPTURE.call = None
    name = getattr(loss_fn, "__name__", loss_fn)
    if len(c.ops) != 1:
        raise TypeError(f"rl_losses.forward_backward: {name!r} called {len(c.ops)} loss ops, not one (its loss has no "
                        f"single fused gradient)")
    # The gradient is the op's loss's: the returned loss must be that tensor, unchanged (every wrapper returns it).
    loss = result if isinstance(result, torch.Tensor) else getattr(result, "loss", None)
    if loss is not c.loss or loss._version != c.version:
        raise TypeError(f"rl_losses.forward_backward: {name!r} returned a loss other than its op's (scaled, "
                        f"combined, sliced or changed in place), whose gradient the op did not compute; pass the "
                        f"wrapper itself")
    grad = c.grad
    linear = isinstance(grad, tuple)
    unit = grad_output is None or (not isinstance(grad_output, torch.Tensor) and grad_output == 1.0)
    if unit and (linear or c.unscale is None or c.unscale.numel() == 0):
        return result, grad  # the gradient as computed: for an upstream gradient of 1
    if grad_output is None or not isinstance(grad_output, torch.Tensor):  # the same for every loss value
        value = 1.0 if grad_output is None else float(grad_output)
        grad_output = torch.full(loss.shape, value, dtype=c.loss.dtype, device=c.loss.device)
    elif grad_output.dim() == 0:
        grad_output = grad_output.to(device=c.loss.device, dtype=c.loss.dtype).expand(loss.shape)
    if grad_output.shape != loss.shape:
        raise ValueError(f"rl_losses.forward_backward: grad_output must have the loss's shape {tuple(loss.shape)} "
                         f"(or be a number), got {tuple(grad_output.shape)}")
    upstream = grad_output.reshape(c.loss.shape).to(c.loss.dtype)
    if not linear:
        _ops._scale_grad_(grad, upstream, c.unscale)
        return result, grad
    if c.into_main_grad:
        raise ValueError("rl_losses.forward_backward: with weight_main_grad the weight's gradient is added to the "
                         "buffer for an upstream gradient of 1; give no grad_output or 1 (scale the loss through "
                         "divisor)")
    for g in grad:
        if g is not None:
            _ops._scale_grad_(g, upstream, None)
    return result, grad
