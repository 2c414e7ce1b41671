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


def _check_labels(name: str, target: torch.Tensor, vocab_size: int | None) -> None:
    # The opt-in CUDA range check of labels against the (global) vocabulary size; None: the op reports the
    # shape error. It reads a value on the host, so it is skipped inside a compiled graph.
    if (vocab_size is not None and target.is_cuda and target.numel() > 0 and _check_inputs_enabled()
            and not torch.compiler.is_compiling()):
        high = int(target.max())
        if high >= vocab_size:
            raise ValueError(f"{name}: target holds label {high}, out of range for vocab_size {vocab_size}")


def _vocab_size(t: torch.Tensor, dim: int) -> int | None:
    return t.shape[dim] if t.dim() >= 1 else None


def _check_document_ids(name: str, document_index: torch.Tensor, num_documents: int | None) -> None:
    # The opt-in CUDA range check of document ids (the CPU kernels always check).
    if document_index.is_cuda and _check_inputs_enabled() and num_documents is not None and document_index.numel():
        high = int(document_index.max())
        if high >= num_documents:
            raise ValueError(f"{name}: document_index holds {high} but num_documents is {num_documents}")


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
    _check_labels("cross_entropy", target, _vocab_size(logits, -1))
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


def _policy_output(out, compute_entropy: bool, document_ratios=None) -> PolicyLossOutput:
    loss, new_lp, low, high, kl_old, entropy, log_probs, ratio_mean = out[:8]
    return PolicyLossOutput(loss, new_lp, low, high, kl_old, entropy if compute_entropy else None, log_probs,
                            ratio_mean, document_ratios)


def grpo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor, old_log_probs: torch.Tensor,
              *, epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
              ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
              loss_weights: torch.Tensor | None = None, divisor: float | None = None,
              logits_scale_factor: float = 1.0, label_counts: torch.Tensor | None = None,
              compute_entropy: bool = False, inplace_backward: bool = False, tp_group=None) -> PolicyLossOutput:
    """GRPO: per-token clipped importance ratio (SPEC §2.2), fused with its metrics (SPEC §2.4).

    Args:
        logits: (..., V) float32/bfloat16/float16/float64 (this rank's shard under ``tp_group``).
        target: (...) int64/int32 label ids, negative = no label.
        advantages, old_log_probs: (...) float, per token.
        epsilon_low/epsilon_high: clip range [1-ε_l, 1+ε_h]. delta: optional two-sided clip (> 1+ε_h).
        ref_log_probs: (...) float, with ``beta`` > 0: k3 KL penalty towards the reference policy.
        loss_weights: (...) float per-token weights w_t (default: the label mask), e.g. mask/|o_i| for the
            sequence mean of token means. divisor: D (default: the number of labelled tokens).
        label_counts: (...) the labelled-token count of each token's document; only used by the
            ``new_logprobs`` metric (mean over documents of each document's mean log-prob).
        compute_entropy: also return the mean entropy over labelled tokens.
        inplace_backward: write the gradient into ``logits``.
    Returns: PolicyLossOutput (``loss`` is differentiable; the rest are detached metrics).
    """
    if tp_group is not None:
        from rl_losses import distributed

        return distributed.grpo_loss(logits, target, advantages, old_log_probs, tp_group=tp_group,
                                     epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                                     ref_log_probs=ref_log_probs, beta=beta, loss_weights=loss_weights,
                                     divisor=_divisor(divisor), logits_scale_factor=logits_scale_factor,
                                     label_counts=label_counts, compute_entropy=compute_entropy,
                                     inplace_backward=inplace_backward)
    _check_labels("grpo", target, _vocab_size(logits, -1))
    out = _ops.grpo(logits, target, advantages, old_log_probs, ref_log_probs=ref_log_probs,
                    loss_weights=loss_weights, label_counts=label_counts, epsilon_low=epsilon_low,
                    epsilon_high=epsilon_high, delta=delta, beta=beta, divisor=_divisor(divisor),
                    logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                    inplace_backward=inplace_backward)
    return _policy_output(out, compute_entropy)


def gspo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor, old_log_probs: torch.Tensor,
              document_index: torch.Tensor, *, num_documents: int | None = None,
              label_counts: torch.Tensor | None = None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              weighting: str = "document", token_advantages: bool = False, divisor: float | None = None,
              logits_scale_factor: float = 1.0, compute_entropy: bool = False, inplace_backward: bool = False,
              tp_group=None, sdp_group=None) -> PolicyLossOutput:
    """GSPO: sequence-level geometric-mean ratio over packed documents (SPEC §2.3) with its metrics.

    Args:
        logits: (..., V) float; target: (...) int labels, negative = no label.
        advantages, old_log_probs: (...) float per token (advantages are averaged per document).
        document_index: (...) int, 0-based document of each token; negative = padding (ignored).
        num_documents: size of the per-document buffers (default max(document_index)+1, which synchronises).
        label_counts: (...) labelled-token count of each token's whole document (default: counted).
        weighting: "document" (each document weighs 1) or "token" (each weighs its labelled-token count).
        token_advantages: GSPO-token: each token's own advantage inside the sequence ratio.
        divisor: D (default: documents holding at least one labelled token).
        sdp_group: sequence-data-parallel group over which documents are split (rl_losses.distributed).
    Returns: PolicyLossOutput with ``document_ratios`` (num_documents,) set.
    """
    if tp_group is not None or sdp_group is not None:
        from rl_losses import distributed

        return distributed.gspo_loss(logits, target, advantages, old_log_probs, document_index,
                                     tp_group=tp_group, sdp_group=sdp_group, num_documents=num_documents,
                                     label_counts=label_counts, epsilon_low=epsilon_low,
                                     epsilon_high=epsilon_high, weighting=weighting,
                                     token_advantages=token_advantages, divisor=_divisor(divisor),
                                     logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                                     inplace_backward=inplace_backward)
    _check_labels("gspo", target, _vocab_size(logits, -1))
    _check_document_ids("gspo", document_index, num_documents)
    out = _ops.gspo(logits, target, advantages, old_log_probs, document_index, num_documents=num_documents,
                    label_counts=label_counts, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                    weighting=weighting, token_advantages=token_advantages, divisor=_divisor(divisor),
                    logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                    inplace_backward=inplace_backward)
    return _policy_output(out, compute_entropy, document_ratios=out[8])


# ---- fused lm_head -------------------------------------------------------------------------------------------
_LINEAR_ARGS_DOC = """
    Args:
        hidden: (..., H) float32/bfloat16/float16/float64 hidden states (the lm_head's input).
        weight: (V, H) the lm_head weight, same dtype and device; bias: optional (V,).
        chunk_size: rows of logits computed at a time (default: as many as fit 512 MiB of logits). Peak extra
            memory is one (chunk_size, V) block of logits plus, when the weight needs a gradient, its
            (V, H) float32 accumulator.
    The logits are ``hidden @ weight.T + bias``; they and their gradient are never materialised whole.
    Differentiable w.r.t. hidden, weight and bias (the gradients are computed in the forward, chunk by chunk).
    An FSDP2 / DTensor weight (sharded or replicated) is gathered whole for the call (``full_tensor()``; its
    gradient goes back to the weight's own placements); hidden must be a plain tensor.
"""


def _plain_lm_head(name: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The lm_head as plain tensors. An FSDP2 / DTensor weight (sharded or replicated) is gathered whole with
    ``full_tensor()``, which autograd differentiates back to the weight's own placements (its backward
    reduce-scatters a sharded weight's gradient), as TRL's fused head does; the hidden states must be a
    plain tensor (this rank's tokens)."""
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):
        raise ValueError(f"{name}: hidden is a DTensor ({hidden.placements}); pass this rank's tokens as a plain "
                         f"tensor (hidden.to_local() for sequence-sharded hidden states, or hidden.full_tensor())")
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    if isinstance(bias, DTensor):
        bias = bias.full_tensor()
    return weight, bias


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         bias: torch.Tensor | None = None, logits_scale_factor: float = 1.0,
                         label_smoothing: float = 0.0, z_loss_factor: float = 0.0, reduction: str = "mean",
                         divisor: float | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits (see cross_entropy).
    ``reduction="none"`` is available without gradients only (the weight gradient is summed over tokens)."""
    weight, bias = _plain_lm_head("linear_cross_entropy", hidden, weight, bias)
    _check_labels("linear_cross_entropy", target, _vocab_size(weight, 0))
    loss, _ = _ops.linear_cross_entropy(hidden, weight, target, bias=bias, logits_scale_factor=logits_scale_factor,
                                        label_smoothing=label_smoothing, z_loss_factor=z_loss_factor,
                                        reduction=reduction, divisor=_divisor(divisor), chunk_size=chunk_size)
    return loss


def linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor, *, bias: torch.Tensor | None = None, epsilon_low: float = 0.2,
                     epsilon_high: float = 0.2, delta: float | None = None,
                     ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
                     loss_weights: torch.Tensor | None = None, divisor: float | None = None,
                     logits_scale_factor: float = 1.0, label_counts: torch.Tensor | None = None,
                     compute_entropy: bool = False, chunk_size: int | None = None) -> PolicyLossOutput:
    """GRPO of ``hidden @ weight.T (+ bias)`` without materialising the logits (see grpo_loss)."""
    weight, bias = _plain_lm_head("linear_grpo", hidden, weight, bias)
    _check_labels("linear_grpo", target, _vocab_size(weight, 0))
    out = _ops.linear_grpo(hidden, weight, target, advantages, old_log_probs, bias=bias, ref_log_probs=ref_log_probs,
                           loss_weights=loss_weights, label_counts=label_counts, epsilon_low=epsilon_low,
                           epsilon_high=epsilon_high, delta=delta, beta=beta, divisor=_divisor(divisor),
                           logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                           chunk_size=chunk_size)
    return _policy_output(out, compute_entropy)


def linear_gspo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor, document_index: torch.Tensor, *, bias: torch.Tensor | None = None,
                     num_documents: int | None = None, label_counts: torch.Tensor | None = None,
                     epsilon_low: float = 0.2, epsilon_high: float = 0.2, weighting: str = "document",
                     token_advantages: bool = False, divisor: float | None = None, logits_scale_factor: float = 1.0,
                     compute_entropy: bool = False, chunk_size: int | None = None) -> PolicyLossOutput:
    """GSPO of ``hidden @ weight.T (+ bias)`` without materialising the logits (see gspo_loss). The logits are
    computed twice, chunk by chunk: once for the per-document ratios, once for the gradient."""
    weight, bias = _plain_lm_head("linear_gspo", hidden, weight, bias)
    _check_labels("linear_gspo", target, _vocab_size(weight, 0))
    _check_document_ids("linear_gspo", document_index, num_documents)
    out = _ops.linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, bias=bias,
                           num_documents=num_documents, label_counts=label_counts, epsilon_low=epsilon_low,
                           epsilon_high=epsilon_high, weighting=weighting, token_advantages=token_advantages,
                           divisor=_divisor(divisor), logits_scale_factor=logits_scale_factor,
                           compute_entropy=compute_entropy, chunk_size=chunk_size)
    return _policy_output(out, compute_entropy, document_ratios=out[8])


for _f in (linear_cross_entropy, linear_grpo_loss, linear_gspo_loss):
    _f.__doc__ += _LINEAR_ARGS_DOC


# ---- per-token log-probs and entropies -------------------------------------------------------------------------
def _scale_of_temperature(name: str, temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    return 1.0 / float(temperature)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                    compute_entropy: bool = False, tp_group=None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probability of each label and, on request, the entropy, in one pass over the logits.

    ``log_probs[t] = log softmax(logits[t] / T)[labels[t]]`` and ``entropy[t] = −Σ_j p_tj log p_tj``: what
    TRL's ``selective_log_softmax`` and verl's log-prob/entropy kernel compute. Both outputs are
    differentiable w.r.t. the logits with any upstream gradients (the backward is one more pass).

    Args:
        logits: (..., V) float32/bfloat16/float16/float64, unit stride in the last dim (under ``tp_group``:
            this rank's vocabulary shard).
        labels: (...) int64/int32 label ids; a negative id means "no label": its log-prob is 0 (no gradient),
            its entropy is still computed.
        temperature: T > 0; the softmax is over logits / T.
        compute_entropy: also return the entropy per token.
        tp_group: vocabulary-parallel process group (rl_losses.distributed).
    Returns: (log_probs, entropy or None), each shaped like ``labels``, float32 (float64 for float64 logits).
    """
    scale = _scale_of_temperature("token_log_probs", temperature)
    if tp_group is not None:
        from rl_losses import distributed

        return distributed.token_log_probs(logits, labels, tp_group=tp_group, logits_scale_factor=scale,
                                           compute_entropy=compute_entropy)
    _check_labels("token_log_probs", labels, _vocab_size(logits, -1))
    log_probs, entropy = _ops.token_log_probs(logits, labels, logits_scale_factor=scale,
                                              compute_entropy=compute_entropy)
    return log_probs, entropy if compute_entropy else None


def linear_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                           bias: torch.Tensor | None = None, temperature: float = 1.0,
                           compute_entropy: bool = False, chunk_size: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_log_probs of ``hidden @ weight.T (+ bias)`` without materialising the logits. The backward
    computes each chunk's logits again (it needs the upstream gradients), so it costs one more GEMM per
    chunk than the forward-computed gradients of the linear losses."""
    scale = _scale_of_temperature("linear_token_log_probs", temperature)
    weight, bias = _plain_lm_head("linear_token_log_probs", hidden, weight, bias)
    _check_labels("linear_token_log_probs", labels, _vocab_size(weight, 0))
    log_probs, entropy = _ops.linear_token_log_probs(hidden, weight, labels, bias=bias, logits_scale_factor=scale,
                                                     compute_entropy=compute_entropy, chunk_size=chunk_size)
    return log_probs, entropy if compute_entropy else None


linear_token_log_probs.__doc__ += _LINEAR_ARGS_DOC.replace(
    "    Differentiable w.r.t. hidden, weight and bias (the gradients are computed in the forward, chunk by chunk).\n",
    "    Differentiable w.r.t. hidden, weight and bias.\n")
