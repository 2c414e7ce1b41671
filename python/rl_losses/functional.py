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


# The number of outputs of the policy ops before GSPO's document_ratios (csrc/registration.cpp).
POLICY_OUTPUTS = 12


def _policy_output(out, compute_entropy: bool, document_ratios=None, *, loss_type: str = "ppo_clip",
                   has_kl: bool = False, has_rollout: bool = False) -> PolicyLossOutput:
    loss, new_lp, low, high, kl_old, entropy, log_probs, ratio_mean, kl, rho, weight, corrected = out[:POLICY_OUTPUTS]
    return PolicyLossOutput(loss, new_lp, low, high, kl_old, entropy if compute_entropy else None, log_probs,
                            ratio_mean, document_ratios, kl if has_kl else None, rho if has_rollout else None,
                            weight if has_rollout else None, corrected if has_rollout else None, loss_type=loss_type)


def _policy_kwargs(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs, rollout_correction,
                   rollout_cap, rollout_mask_bounds, kl_estimator, kl_importance_weighted, entropy_coefficient):
    # The policy family's options as the ops take them (csrc/registration.cpp: RL_LOSSES_POLICY_KWARGS).
    return dict(loss_type=loss_type, sapo_temperature_pos=float(sapo_temperature_pos),
                sapo_temperature_neg=float(sapo_temperature_neg), rollout_log_probs=rollout_log_probs,
                rollout_correction=rollout_correction, rollout_cap=float(rollout_cap),
                rollout_mask_bounds=None if rollout_mask_bounds is None else [float(b) for b in rollout_mask_bounds],
                kl_estimator=kl_estimator, kl_importance_weighted=bool(kl_importance_weighted),
                entropy_coefficient=float(entropy_coefficient))


_POLICY_DOC = """
    The policy family (docs/policy_losses.md has every formula):
        old_log_probs: None for on-policy training (old = sg(lp): r = 1 in value, gradient A·∇lp).
        advantages: per token, or per sequence: (B,) for (B, T) labels, broadcast over each row.
        loss_type: "ppo_clip" (default), "cispo" (−sg(min(r, ε_h))·A·lp: the cap is epsilon_high itself, as
            TRL's and Liger's) or "sapo" (−(4/τ)·σ(τ(r−1))·A, τ = sapo_temperature_pos if A > 0 else
            sapo_temperature_neg). TRL's grpo/bnpo/dapo/dr_grpo/luspo are "ppo_clip" with an aggregation preset
            (rl_losses.aggregation). delta is for "ppo_clip" only.
        rollout_log_probs: (...) the inference engine's log-probs; ρ = exp(old − rollout).
        rollout_correction: None, "token_truncate", "token_mask", "sequence_truncate" or "sequence_mask" (TRL's
            vllm_importance_sampling_mode): the surrogate of each token (not its KL or entropy term) is
            multiplied by sg(min(ρ, rollout_cap)) ("truncate") or sg(ρ·[lo ≤ ρ ≤ hi]) ("mask",
            rollout_mask_bounds = (lo, hi), default (0, rollout_cap)). Sequence level: ρ is the geometric mean
            over the sequence's labelled tokens (document_index, else the rows of (B, T) labels).
        kl_estimator: "k1" (lp − q), "k2" (½(lp − q)²) or "k3" (default) towards ref_log_probs, times beta;
            kl_importance_weighted: r·KL, differentiated through r too (TRL's and Liger's
            use_bias_correction_kl; GSPO: sg(R_s)·KL).
        entropy_coefficient: c, adds −c·Σ_t w_t·H_t / D (differentiated, same pass).
"""


def grpo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
              old_log_probs: torch.Tensor | None, *, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              delta: float | None = None, ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
              loss_weights: torch.Tensor | None = None, divisor: float | None = None,
              logits_scale_factor: float = 1.0, label_counts: torch.Tensor | None = None,
              compute_entropy: bool = False, inplace_backward: bool = False, tp_group=None,
              loss_type: str = "ppo_clip", sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              rollout_log_probs: torch.Tensor | None = None, rollout_correction: str | None = None,
              rollout_cap: float = 3.0, rollout_mask_bounds: tuple[float, float] | None = None,
              kl_estimator: str = "k3", kl_importance_weighted: bool = False, entropy_coefficient: float = 0.0,
              document_index: torch.Tensor | None = None) -> PolicyLossOutput:
    """GRPO: per-token importance ratio, fused with its metrics (docs/policy_losses.md).

    Args:
        logits: (..., V) float32/bfloat16/float16/float64 (this rank's shard under ``tp_group``).
        target: (...) int64/int32 label ids, negative = no label.
        advantages: (...) float per token, or (B,) per sequence for (B, T) labels.
        old_log_probs: (...) float per token, or None (on-policy).
        epsilon_low/epsilon_high: clip range [1-ε_l, 1+ε_h]. delta: optional two-sided clip (> 1+ε_h).
        ref_log_probs: (...) float, with ``beta`` > 0: KL penalty towards the reference policy.
        loss_weights: (...) float per-token weights w_t (default: the label mask), e.g. mask/|o_i| for the
            sequence mean of token means (rl_losses.aggregation builds them). divisor: D (default: the number
            of labelled tokens).
        label_counts: (...) the labelled-token count of each token's document; only used by the
            ``new_logprobs`` metric (mean over documents of each document's mean log-prob).
        compute_entropy: also return the mean entropy over labelled tokens.
        inplace_backward: write the gradient into ``logits``.
        document_index: (...) int, the sequence of each token for a sequence-level rollout correction
            (negative = padding).
    Returns: PolicyLossOutput (``loss`` is differentiable; the rest are detached metrics;
        ``trl_metrics()`` gives them under TRL's names).
    """
    policy = _policy_kwargs(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs,
                            rollout_correction, rollout_cap, rollout_mask_bounds, kl_estimator,
                            kl_importance_weighted, entropy_coefficient)
    if tp_group is not None:
        from rl_losses import distributed

        return distributed.grpo_loss(logits, target, advantages, old_log_probs, tp_group=tp_group,
                                     epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                                     ref_log_probs=ref_log_probs, beta=beta, loss_weights=loss_weights,
                                     divisor=_divisor(divisor), logits_scale_factor=logits_scale_factor,
                                     label_counts=label_counts, compute_entropy=compute_entropy,
                                     inplace_backward=inplace_backward, document_index=document_index, **policy)
    _check_labels("grpo", target, _vocab_size(logits, -1))
    out = _ops.grpo(logits, target, advantages, old_log_probs, ref_log_probs=ref_log_probs,
                    loss_weights=loss_weights, label_counts=label_counts, epsilon_low=epsilon_low,
                    epsilon_high=epsilon_high, delta=delta, beta=beta, divisor=_divisor(divisor),
                    logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                    inplace_backward=inplace_backward, document_index=document_index, **policy)
    return _grpo_output(out, compute_entropy, policy, ref_log_probs)


def _grpo_output(out, compute_entropy, policy, ref_log_probs, document_ratios=None) -> PolicyLossOutput:
    # The named result of grpo/gspo: the optional metrics set where their option is on.
    return _policy_output(out, compute_entropy or policy["entropy_coefficient"] != 0.0, document_ratios,
                          loss_type=policy["loss_type"], has_kl=ref_log_probs is not None,
                          has_rollout=policy["rollout_correction"] is not None)


grpo_loss.__doc__ += _POLICY_DOC


def gspo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
              old_log_probs: torch.Tensor | None, document_index: torch.Tensor, *, num_documents: int | None = None,
              label_counts: torch.Tensor | None = None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
              weighting: str = "document", token_advantages: bool = False, divisor: float | None = None,
              logits_scale_factor: float = 1.0, compute_entropy: bool = False, inplace_backward: bool = False,
              tp_group=None, sdp_group=None, ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
              loss_type: str = "ppo_clip", sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              rollout_log_probs: torch.Tensor | None = None, rollout_correction: str | None = None,
              rollout_cap: float = 3.0, rollout_mask_bounds: tuple[float, float] | None = None,
              kl_estimator: str = "k3", kl_importance_weighted: bool = False,
              entropy_coefficient: float = 0.0) -> PolicyLossOutput:
    """GSPO: sequence-level geometric-mean ratio over packed documents (SPEC §2.3) with its metrics.

    Args:
        logits: (..., V) float; target: (...) int labels, negative = no label.
        advantages: (...) float per token (averaged per document), (B,) per sequence for (B, T) labels, or
            (num_documents,) per document.
        old_log_probs: (...) float per token, or None (on-policy).
        document_index: (...) int, 0-based document of each token; negative = padding (ignored).
        num_documents: size of the per-document buffers (default max(document_index)+1, which synchronises).
        label_counts: (...) labelled-token count of each token's whole document (default: counted).
        weighting: "document" (each document weighs 1) or "token" (each weighs its labelled-token count).
        token_advantages: GSPO-token: each token's own advantage inside the sequence ratio.
        divisor: D (default: documents holding at least one labelled token).
        sdp_group: sequence-data-parallel group over which documents are split (rl_losses.distributed).
    The policy family applies at the sequence ratio R_s (loss_type, no delta); the rollout correction, KL and
    entropy bonus per token, each weighted like the token's share of its document (docs/policy_losses.md).
    Returns: PolicyLossOutput with ``document_ratios`` (num_documents,) set.
    """
    policy = _policy_kwargs(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs,
                            rollout_correction, rollout_cap, rollout_mask_bounds, kl_estimator,
                            kl_importance_weighted, entropy_coefficient)
    if tp_group is not None or sdp_group is not None:
        from rl_losses import distributed

        return distributed.gspo_loss(logits, target, advantages, old_log_probs, document_index,
                                     tp_group=tp_group, sdp_group=sdp_group, num_documents=num_documents,
                                     label_counts=label_counts, epsilon_low=epsilon_low,
                                     epsilon_high=epsilon_high, weighting=weighting,
                                     token_advantages=token_advantages, divisor=_divisor(divisor),
                                     logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                                     inplace_backward=inplace_backward, ref_log_probs=ref_log_probs, beta=beta,
                                     **policy)
    _check_labels("gspo", target, _vocab_size(logits, -1))
    _check_document_ids("gspo", document_index, num_documents)
    out = _ops.gspo(logits, target, advantages, old_log_probs, document_index, num_documents=num_documents,
                    label_counts=label_counts, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                    weighting=weighting, token_advantages=token_advantages, divisor=_divisor(divisor),
                    logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                    inplace_backward=inplace_backward, ref_log_probs=ref_log_probs, beta=beta, **policy)
    return _grpo_output(out, compute_entropy, policy, ref_log_probs, document_ratios=out[POLICY_OUTPUTS])


gspo_loss.__doc__ += _POLICY_DOC


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
"""


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         bias: torch.Tensor | None = None, logits_scale_factor: float = 1.0,
                         label_smoothing: float = 0.0, z_loss_factor: float = 0.0, reduction: str = "mean",
                         divisor: float | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits (see cross_entropy).
    ``reduction="none"`` is available without gradients only (the weight gradient is summed over tokens)."""
    _check_labels("linear_cross_entropy", target, _vocab_size(weight, 0))
    loss, _ = _ops.linear_cross_entropy(hidden, weight, target, bias=bias, logits_scale_factor=logits_scale_factor,
                                        label_smoothing=label_smoothing, z_loss_factor=z_loss_factor,
                                        reduction=reduction, divisor=_divisor(divisor), chunk_size=chunk_size)
    return loss


def linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor | None, *, bias: torch.Tensor | None = None,
                     epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
                     ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
                     loss_weights: torch.Tensor | None = None, divisor: float | None = None,
                     logits_scale_factor: float = 1.0, label_counts: torch.Tensor | None = None,
                     compute_entropy: bool = False, chunk_size: int | None = None, loss_type: str = "ppo_clip",
                     sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                     rollout_log_probs: torch.Tensor | None = None, rollout_correction: str | None = None,
                     rollout_cap: float = 3.0, rollout_mask_bounds: tuple[float, float] | None = None,
                     kl_estimator: str = "k3", kl_importance_weighted: bool = False,
                     entropy_coefficient: float = 0.0, document_index: torch.Tensor | None = None) -> PolicyLossOutput:
    """GRPO of ``hidden @ weight.T (+ bias)`` without materialising the logits (see grpo_loss, whose policy-family
    options it takes)."""
    policy = _policy_kwargs(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs,
                            rollout_correction, rollout_cap, rollout_mask_bounds, kl_estimator,
                            kl_importance_weighted, entropy_coefficient)
    _check_labels("linear_grpo", target, _vocab_size(weight, 0))
    out = _ops.linear_grpo(hidden, weight, target, advantages, old_log_probs, bias=bias, ref_log_probs=ref_log_probs,
                           loss_weights=loss_weights, label_counts=label_counts, epsilon_low=epsilon_low,
                           epsilon_high=epsilon_high, delta=delta, beta=beta, divisor=_divisor(divisor),
                           logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                           chunk_size=chunk_size, document_index=document_index, **policy)
    return _grpo_output(out, compute_entropy, policy, ref_log_probs)


def linear_gspo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor | None, document_index: torch.Tensor, *,
                     bias: torch.Tensor | None = None, num_documents: int | None = None,
                     label_counts: torch.Tensor | None = None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                     weighting: str = "document", token_advantages: bool = False, divisor: float | None = None,
                     logits_scale_factor: float = 1.0, compute_entropy: bool = False,
                     chunk_size: int | None = None, ref_log_probs: torch.Tensor | None = None, beta: float = 0.0,
                     loss_type: str = "ppo_clip", sapo_temperature_pos: float = 1.0,
                     sapo_temperature_neg: float = 1.05, rollout_log_probs: torch.Tensor | None = None,
                     rollout_correction: str | None = None, rollout_cap: float = 3.0,
                     rollout_mask_bounds: tuple[float, float] | None = None, kl_estimator: str = "k3",
                     kl_importance_weighted: bool = False, entropy_coefficient: float = 0.0) -> PolicyLossOutput:
    """GSPO of ``hidden @ weight.T (+ bias)`` without materialising the logits (see gspo_loss, whose policy-family
    options it takes). The logits are computed twice, chunk by chunk: once for the per-document ratios, once for
    the gradient."""
    policy = _policy_kwargs(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs,
                            rollout_correction, rollout_cap, rollout_mask_bounds, kl_estimator,
                            kl_importance_weighted, entropy_coefficient)
    _check_labels("linear_gspo", target, _vocab_size(weight, 0))
    _check_document_ids("linear_gspo", document_index, num_documents)
    out = _ops.linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, bias=bias,
                           num_documents=num_documents, label_counts=label_counts, epsilon_low=epsilon_low,
                           epsilon_high=epsilon_high, weighting=weighting, token_advantages=token_advantages,
                           divisor=_divisor(divisor), logits_scale_factor=logits_scale_factor,
                           compute_entropy=compute_entropy, chunk_size=chunk_size, ref_log_probs=ref_log_probs,
                           beta=beta, **policy)
    return _grpo_output(out, compute_entropy, policy, ref_log_probs, document_ratios=out[POLICY_OUTPUTS])


for _f in (linear_cross_entropy, linear_grpo_loss, linear_gspo_loss):
    _f.__doc__ += _LINEAR_ARGS_DOC
