"""Functional wrappers around ``torch.ops.rl_losses``: tensors positional, options keyword-only, docstrings that
give each tensor's shape and dtype, and the named result of the policy losses (``PolicyLossOutput``).

The math of every option: docs/math.md; how a batch maps onto the arguments (label shift, masks, divisors,
padded or packed batches): docs/conventions.md. With ``tp_group`` / ``sdp_group`` the wrappers run the
distributed layer (rl_losses.distributed, docs/distributed.md)."""
from __future__ import annotations

import functools

import torch

from rl_losses import _schema, distributed
from rl_losses._inputs import (_CHECK_INPUTS, _ENVIRON, _check_document_ids, _check_labels_in, _direct, _options,
                               policy_output)
from rl_losses.outputs import PolicyLossOutput

_ops = torch.ops.rl_losses
# The tensor-parallel hooks the wrappers fill themselves (through tp_group) and so leave out of their signatures.
_TP_HOOKS = ("row_stats", "vocab_start", "vocab_size")


@functools.cache  # the registered kernels do not change: asked once (the loss modules ask per call)
def cuda_kernels_available() -> bool:
    """True when the extension was built with its CUDA kernels (a CPU-only build runs only on the CPU tensors).

    Returns: bool; the configs' ``use_cuda_kernel=None`` uses it to choose between the op and the reference.
    """
    return torch._C._dispatch_has_kernel_for_dispatch_key("rl_losses::_cross_entropy_forward", "CUDA")


def _wrapper(fn, op: str, *, drop=(), only=None, rename=None, extra=None, returns=None) -> frozenset[str]:
    """Gives a wrapper over `op` its documented signature (the schema's, less `drop` or only `only`, names changed by
    `rename`, then the wrapper's own `extra` options); returns the keyword options it passes on."""
    if only is not None:
        drop = tuple(a.name for a in _schema.schema(op).arguments if a.kwarg_only and a.name not in only)
    fn.__signature__ = _schema.signature(op, drop=drop, rename=rename, extra=extra, returns=returns)
    return _schema.keywords(op, drop=drop)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, tp_group=None, **options) -> torch.Tensor:
    """Fused cross-entropy from labels, with optional label smoothing and z-loss (docs/math.md).

    Args:
        logits: (..., V) float32/bfloat16/float16/float64 (float64 on the CPU only), unit stride in the last
            dim. Leading dims are flattened; no copy is made.
        target: (...) int64/int32 next-token labels (``target[t] = input_ids[t + 1]``); any negative value
            means "no label" (no loss, zero gradient).
        logits_scale_factor: s > 0; every softmax is over s·logits (a sampling temperature T is s = 1/T); the
            gradient carries the factor s.
        label_smoothing: ε in [0, 1): weight of the cross-entropy against the uniform distribution.
        z_loss_factor: ζ >= 0: adds ζ·lse² per labelled token.
        reduction: "mean" (sum over labelled tokens divided by ``divisor``), "sum" or "none" (per token).
        divisor: D for "mean": a number or 0-dim tensor (default: the number of labelled tokens, counted on
            the device). Pass a global count under data parallelism.
        inplace_backward: write the gradient into ``logits``' own storage during the forward (zero extra
            memory); ``logits`` then holds the gradient, so nothing else may use it afterwards. Refused for a leaf
            that requires grad (or a view of one) and for logits whose rows overlap in memory.
        tp_group: vocabulary-parallel process group: ``logits`` is then this rank's contiguous slice of the
            vocabulary (even shards; uneven ones through rl_losses.distributed), ``target`` holds global ids,
            and the loss is the same on every rank (docs/distributed.md). None: one device.
    Returns: the loss, float32 (float64 for float64 logits): a scalar, or shaped like ``target`` for "none".
        Differentiable w.r.t. ``logits`` (the gradient is computed in the forward pass).
    """
    options = _options("cross_entropy", options, _CROSS_ENTROPY)
    if tp_group is not None:
        return distributed.cross_entropy(logits, target, tp_group=tp_group, **options)
    if _CHECK_INPUTS in _ENVIRON:  # RL_LOSSES_CHECK_INPUTS set: the opt-in host checks (else one lookup)
        _check_labels_in("cross_entropy", target, logits, -1)
    op = _direct(_ops.cross_entropy)
    return op(logits, target, **options)[0]


_CROSS_ENTROPY = _wrapper(cross_entropy, "cross_entropy", drop=_TP_HOOKS + ("label_weight",), extra={"tp_group": None})


def _mask_as_target(logits: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    # The z-loss is the cross-entropy op with the label term switched off; its "labels" only carry the mask.
    shape = logits.shape[:-1]
    if loss_mask is None:
        return torch.zeros(shape, dtype=torch.long, device=logits.device)
    if loss_mask.shape != shape:
        raise ValueError(f"z_loss: loss_mask has shape {tuple(loss_mask.shape)} but logits has batch shape "
                         f"{tuple(shape)}")
    return torch.where(loss_mask.bool(), 0, -1).to(torch.long)


def z_loss(logits: torch.Tensor, *, loss_mask: torch.Tensor | None = None, tp_group=None,
           **options) -> torch.Tensor:
    """Z-loss alone (Fast-LLM's ``z_loss``): Σ_t mask_t·lse_t² / D (docs/math.md).

    Args:
        logits: (..., V) float32/bfloat16/float16/float64, unit stride in the last dim.
        loss_mask: (...) bool or int, the tokens the loss covers (default: every token).
        logits_scale_factor: s > 0; every softmax is over s·logits (a sampling temperature T is s = 1/T); the
            gradient carries the factor s.
        divisor: D, a number or 0-dim tensor (default: Σ loss_mask).
        tp_group: vocabulary-parallel process group: ``logits`` is then this rank's contiguous slice of the
            vocabulary (even shards; uneven ones through rl_losses.distributed), ``target`` holds global ids,
            and the loss is the same on every rank (docs/distributed.md). None: one device.
    Returns: the scalar loss, float32 (float64 for float64 logits), differentiable w.r.t. ``logits``.
    """
    options = _options("z_loss", options, _Z_LOSS)
    target = _mask_as_target(logits, loss_mask)
    if tp_group is not None:
        return distributed.cross_entropy(logits, target, tp_group=tp_group, z_loss_factor=1.0, label_weight=0.0,
                                         **options)
    op = _direct(_ops.cross_entropy)
    return op(logits, target, z_loss_factor=1.0, label_weight=0.0, **options)[0]


_Z_LOSS = _wrapper(z_loss, "cross_entropy", only=("logits_scale_factor", "divisor"), extra={"loss_mask": None, "tp_group": None})
# (the z-loss's "target" only carries the mask)
z_loss.__signature__ = z_loss.__signature__.replace(
    parameters=[p for p in z_loss.__signature__.parameters.values() if p.name != "target"])


_POLICY_DOC = """
    The policy family (docs/policy_losses.md has every formula):
        old_log_probs: None for on-policy training (old = sg(lp): r = 1 in value, gradient A·∇lp).
        advantages: per token, or per sequence: (B,) for (B, T) labels, broadcast over each row.
        loss_type: "ppo_clip" (default), "cispo" (−sg(min(r, ε_h))·A·lp: the cap is epsilon_high itself, as
            TRL's and Liger's), "sapo" (−(4/τ)·σ(τ(r−1))·A, τ = sapo_temperature_pos if A > 0 else
            sapo_temperature_neg) or "vespo" (−sg(φ)·A·lp, TRL's and Liger's: φ = exp(λ + k·log w − λ·w) of the
            sequence's w = exp(Σ clamp(lp − old, ±20)) (times its rollout weights), clamped to [1e-8, e^20];
            (k, λ) = (vespo_k_pos, vespo_lambda_pos) where A >= 0, else (vespo_k_neg, vespo_lambda_neg); the
            sequences as for a sequence-level correction; its weight needs every token's log-prob first, so it
            reads the logits twice unless on-policy without a correction). TRL's grpo/bnpo/dapo/dr_grpo/luspo are
            "ppo_clip" with an aggregation preset (rl_losses.aggregation). delta is for "ppo_clip" only.
            verl's per-token losses (GRPO and policy_token_loss only; GSPO's ratio is the sequence's): "gpg"
            (−A·lp), "dro" (−(A·lp − dro_beta/2·(lp − old)²), dro_beta > 0 required, verl's
            policy_loss.dro_beta), "dppo_tv" / "dppo_kl" (−A·sg(min(r, clip_ratio_c))·lp on the tokens inside
            DPPO's trust region on the probabilities, whose bounds are epsilon_low / epsilon_high, verl's
            clip_ratio_low / clip_ratio_high; 0 outside), "clip_cov" (ppo_clip's surrogate, 0 on a random subset
            of at most max(⌊clip_cov_ratio·N⌋, 1) tokens with clip_cov_lb < cov < clip_cov_ub that the clip leaves
            alone) and "kl_cov" (−A·r + ppo_kl_coef·|lp − old| on the max(⌊kl_cov_ratio·N⌋, 1) tokens of largest
            cov), cov = (A − mean A)·(lp − mean lp) over the call's labelled tokens: their statistics need every
            log-prob first (the logits read twice); clip_cov draws its subset from the default generator of
            the logits' device (no host synchronisation; not verl's torch.randperm draw).
        rollout_log_probs: (...) the inference engine's log-probs; ρ = exp(old − rollout).
        rollout_correction: None, "token_truncate", "token_mask", "sequence_truncate" or "sequence_mask" (TRL's
            vllm_importance_sampling_mode): the surrogate of each token (not its KL or entropy term) is
            multiplied by sg(min(ρ, rollout_cap)) ("truncate") or sg(ρ·[lo ≤ ρ ≤ hi]) ("mask",
            rollout_mask_bounds = (lo, hi), default (0, rollout_cap)). Sequence level: ρ is the product of the
            token ratios over the sequence's labelled tokens, TRL's definition (document_index, else the rows of
            (B, T) labels). vespo folds the weights into φ instead.
        rollout_rs, rollout_rs_threshold: verl's rollout rejection (fused ops only), verl's names and threshold
            specification: modes "token_k1/k2/k3", "seq_sum_k1/k2/k3", "seq_mean_k1/k2/k3", "seq_max_k2/k3",
            comma-separated (all must pass); thresholds "lo_hi" or "hi" (k1: ratio bounds, lo = 1/hi by default),
            "hi" (k2, k3), one for all modes or one per mode. Judges k1 = −δ, k2 = δ²/2, k3 = e^δ − 1 − δ of
            δ = clamp(old − rollout, ±20) per token, or their sum / mean / max per sequence (document_index, else the
            rows); needs old_log_probs (or bypass_mode) and rollout_log_probs. A rejected token counts as
            unlabelled everywhere (weights, counts, divisor, metrics, label_counts); computed from the inputs
            before the pass.
        bypass_mode: verl's (grpo, gspo and their linear forms): old_log_probs default to rollout_log_probs and
            rollout_rs judges the current log-probs, δ = clamp(sg(lp) − rollout, ±20); no rollout_correction.
        kl_estimator: "k1" (lp − q), "k2" (½(lp − q)²) or "k3" (default) towards ref_log_probs, times beta;
            kl_importance_weighted: r·KL, differentiated through r too (TRL's and Liger's
            use_bias_correction_kl; GSPO: R_s·KL, differentiated through R_s).
        entropy_coefficient: c, adds −c·Σ_t w_t·H_t / D (differentiated, same pass).
        top_k, top_p, min_p: the sampler's distribution (docs/consistency.md): every softmax renormalised over the
            tokens an engine's min_p, then top_k, then top_p keep (numbers, or per token shaped like ``target``);
            the gradient flows through the kept tokens only. Not with tp_group or strategy="lean".
"""


def grpo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
              old_log_probs: torch.Tensor | None, *, tp_group=None, **options) -> PolicyLossOutput:
    """GRPO: per-token clipped importance ratio (docs/math.md), fused with its metrics.

    Args:
        logits: (..., V) float32/bfloat16/float16/float64, unit stride in the last dim.
        target: (...) int64/int32 next-token labels (``target[t] = input_ids[t + 1]``), negative = no label.
        advantages: (...) float per token, or (B,) per sequence for (B, T) labels (broadcast).
        old_log_probs: (...) float, the log-prob of each token's label under the policy that sampled it;
            None for on-policy training.
        epsilon_low: ε_l in [0, 1); the ratio is clipped below at 1 - ε_l.
        epsilon_high: ε_h >= 0; the ratio is clipped above at 1 + ε_h (DAPO's clip-higher: ε_h > ε_l).
        delta: optional two-sided clip, TRL's: −min(min(r, δ)·A, clip(r)·A), any finite δ > 0 (usually
            δ > 1 + ε_h, where it caps the ratio of negative advantages only; docs/math.md).
        ref_log_probs: (...) float, log-probs under the reference policy; needed when ``beta`` > 0.
        beta: β >= 0, weight of the k3 estimate of KL(new || ref).
        loss_weights: (...) float per-token weights w_t (default: the label mask), e.g. mask / |o_i| for the
            sequence mean of token means; forced to 0 where there is no label (docs/conventions.md).
        divisor: D, a number or 0-dim tensor (default: the number of labelled tokens).
        logits_scale_factor: s > 0; every softmax is over s·logits (a sampling temperature T is s = 1/T); the
            gradient carries the factor s.
        label_counts: (...) the labelled-token count of each token's document; used only by the
            ``new_logprobs`` metric (mean over documents of each document's mean log-prob).
        compute_entropy: also compute the mean entropy over labelled tokens (fused into the same pass).
        compute_metrics: False leaves out every metric but new_logprobs and the entropy asked for (None): the
            clipped fractions, kl_old, ratio_mean and the options' metrics, each an output fewer for the host to
            make (the loss and its gradient are the same).
        inplace_backward: write the gradient into ``logits``' own storage during the forward (zero extra
            memory); ``logits`` then holds the gradient, so nothing else may use it afterwards. Refused for a leaf
            that requires grad (or a view of one) and for logits whose rows overlap in memory.
        tp_group: vocabulary-parallel process group: ``logits`` is then this rank's contiguous slice of the
            vocabulary (even shards; uneven ones through rl_losses.distributed), ``target`` holds global ids,
            and the loss is the same on every rank (docs/distributed.md). None: one device.
        document_index: (...) int, the sequence of each token for a sequence-level rollout correction or
            loss_type "vespo" (negative = padding; default: the rows of (B, T) labels).
        num_documents: the count of ``document_index``'s ids (default: max(document_index) + 1, read on the host:
            a synchronisation on a GPU, which giving it avoids; CUDA checks the ids against it on the device).
        aggregation: None, or a preset of rl_losses.aggregation ("token_mean", "sequence_mean_token_mean",
            "sequence_sum_constant", "luspo") computed by the op over the labels rollout_rs keeps: loss_weights then
            multiply its weights and divisor replaces its count; the sequences are document_index's or the rows
            (sequence_sum_constant's constant: the row length T, or give divisor). Its sequence means divide by
            the sequences that keep a labelled token, as verl's loss_agg_mode does, where
            rl_losses.aggregation.aggregation_weights divides by every sequence of the batch (TRL's mean).
        The policy-family options (loss_type ... entropy_coefficient) are described below.
    Returns: PolicyLossOutput: ``loss`` (differentiable scalar), then the detached metrics new_logprobs,
        clipped_fraction_low/high, kl_old, entropy (None unless ``compute_entropy`` or an entropy bonus), log_probs (per
        token), ratio_mean, then kl, rollout ratio/weight/corrected fraction, vespo_phi_seq_mean where those
        options are on (without ``compute_metrics`` only loss, new_logprobs, log_probs and the entropy asked for);
        ``trl_metrics()`` gives them under TRL's logged names.
    """
    options = _options("grpo_loss", options, _GRPO)
    if tp_group is not None:
        return distributed.grpo_loss(logits, target, advantages, old_log_probs, tp_group=tp_group, **options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("grpo", target, logits, -1)
        if options.get("document_index") is not None:
            _check_document_ids("grpo", options["document_index"], options.get("num_documents"))
    op = _direct(_ops.grpo)
    return policy_output("grpo", op(logits, target, advantages, old_log_probs, **options), options)


_GRPO = _wrapper(grpo_loss, "grpo", drop=_TP_HOOKS, extra={"tp_group": None}, returns=PolicyLossOutput)
grpo_loss.__doc__ += _POLICY_DOC


def gspo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
              old_log_probs: torch.Tensor | None, document_index: torch.Tensor, *, tp_group=None, sdp_group=None,
              **options) -> PolicyLossOutput:
    """GSPO: sequence-level geometric-mean ratio over packed documents (docs/math.md), with its metrics.

    Args:
        logits: (..., V) float32/bfloat16/float16/float64, unit stride in the last dim.
        target: (...) int64/int32 next-token labels (``target[t] = input_ids[t + 1]``), negative = no label.
        advantages: (...) float per token (averaged over each document's labelled tokens unless
            ``token_advantages``), (B,) per sequence for (B, T) labels, or (num_documents,) per document.
        old_log_probs: (...) float, the log-prob of each token's label under the policy that sampled it;
            None for on-policy training.
        document_index: (...) int64/int32, the 0-based document of each token; negative = padding (ignored).
        num_documents: size of the per-document buffers (default: max(document_index) + 1, which
            synchronises with the host).
        label_counts: (...) the labelled-token count of each token's whole document (default: counted from
            ``document_index`` and the labels; give it when a document is split over calls or ranks).
        epsilon_low: ε_l in [0, 1); the sequence ratio is clipped below at 1 - ε_l.
        epsilon_high: ε_h >= 0; clipped above at 1 + ε_h.
        delta: optional two-sided clip ("ppo_clip" only): f_s = −min(min(R_s, δ)·Ā_s, clip(R_s)·Ā_s), any finite
            δ > 0, TRL's ``delta`` at importance_sampling_level="sequence" (docs/math.md).
        weighting: "document" (each document weighs 1) or "token" (each weighs its labelled-token count).
        token_advantages: GSPO-token: each token's own advantage inside the sequence ratio.
        divisor: D, a number or 0-dim tensor (default: the documents holding at least one labelled token).
        logits_scale_factor: s > 0; every softmax is over s·logits (a sampling temperature T is s = 1/T); the
            gradient carries the factor s.
        compute_entropy: also compute the mean entropy over labelled tokens (fused into the first pass).
        compute_metrics: False leaves out every metric but new_logprobs and the entropy asked for (None), as
            grpo_loss's.
        inplace_backward: write the gradient into ``logits``' own storage during the forward (zero extra
            memory); ``logits`` then holds the gradient, so nothing else may use it afterwards. Refused for a leaf
            that requires grad (or a view of one) and for logits whose rows overlap in memory.
        tp_group: vocabulary-parallel process group: ``logits`` is then this rank's contiguous slice of the
            vocabulary (even shards; uneven ones through rl_losses.distributed), ``target`` holds global ids,
            and the loss is the same on every rank (docs/distributed.md). None: one device.
        sdp_group: sequence-data-parallel group: documents may be split over its ranks (global document ids);
            the per-document sums are all-reduced, and the ranks' losses add up to the whole batch's.
        ref_log_probs: (...) float, log-probs under the reference policy; needed when ``beta`` > 0.
        beta: β >= 0, weight of the per-token KL estimate towards ``ref_log_probs``.
        The policy-family options (loss_type ... entropy_coefficient) apply at the sequence ratio R_s (the
        rollout correction, KL and entropy bonus per token); they are described below.
        loss_type "geo_mean" (GSPO only: GMPO, verl's geo_mean): each token's lp − old clipped to [−ε_l, ε_h] on
            its advantage's side inside R_s = exp(mean), f = −Ā_s·R_s (docs/policy_losses.md).
    Returns: PolicyLossOutput with ``document_ratios`` (num_documents,) set: ``loss`` (differentiable
        scalar), then the detached metrics new_logprobs, clipped_fraction_low/high (fractions of documents),
        kl_old, entropy (None unless ``compute_entropy``), log_probs, ratio_mean, document_ratios.
    """
    options = _options("gspo_loss", options, _GSPO)
    if tp_group is not None or sdp_group is not None:
        return distributed.gspo_loss(logits, target, advantages, old_log_probs, document_index, tp_group=tp_group,
                                     sdp_group=sdp_group, **options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("gspo", target, logits, -1)
        _check_document_ids("gspo", document_index, options.get("num_documents"))
    op = _direct(_ops.gspo)
    return policy_output("gspo", op(logits, target, advantages, old_log_probs, document_index, **options), options)


_GSPO = _wrapper(gspo_loss, "gspo", drop=_TP_HOOKS + ("document_sums",), extra={"tp_group": None, "sdp_group": None},
         returns=PolicyLossOutput)
gspo_loss.__doc__ += _POLICY_DOC

# The wrappers that the loss modules call around where nothing needs them (rl_losses._calls._Bound: no opt-in check,
# no tp_group, no torch.compile trace): wrapper -> (its op, its name and keywords for _options). What such a call skips
# is the wrapper's frames and its named result: its loss is the op's first result.
DIRECT_FORMS = {cross_entropy: ("cross_entropy", "cross_entropy", _CROSS_ENTROPY),
                grpo_loss: ("grpo", "grpo_loss", _GRPO),
                gspo_loss: ("gspo", "gspo_loss", _GSPO)}


# ---- fused lm_head -------------------------------------------------------------------------------------------
_LINEAR_ARGS_DOC = """
    Args (beyond those of the logits op):
        hidden: (..., H) float32/bfloat16/float16/float64 hidden states (the lm_head's input); its leading
            dims are the tokens, as the logits' would be.
        weight: (V, H) the lm_head weight, same dtype and device.
        bias: optional (V,) lm_head bias.
        chunk_size: rows of logits computed at a time (default: from the strategy's memory budget).
        strategy: "fast" (default): chunks of rows from a 2.5 GiB logits budget; across chunks the weight gradient is
            summed in a (V, H) float32 accumulator (none when one chunk holds every row). "lean": at most
            256 MiB beyond the gradients and no accumulator: grad_hidden in chunks of rows, then grad_weight
            and grad_bias in blocks of the vocabulary over all rows, each written once (one more GEMM).
            docs/performance.md gives the rule, the measured times and the grad_weight errors.
        weight_main_grad: optional (V, H) float32 (float64 for float64 weights) contiguous buffer, e.g.
            Megatron's ``weight.main_grad``: the weight's gradient is added into it (no accumulator of ours) and
            autograd gets none for the weight (``weight.grad`` is left as it was). The losses add it during the
            forward, for an upstream gradient of 1: call ``loss.backward()`` on the returned loss (scale it
            through ``divisor``); any other upstream gradient is refused.
        skip_unlabelled: whether rows with a negative label take no GEMM work. Leaving them out needs their
            count on the host: on a GPU a few launches and one synchronisation per call (per forward and backward
            for linear_token_log_probs), which costs a small call more than the GEMM work it saves. None
            (default): they are left out where that pays: on the CPU always; on a GPU where
            N·V·H >= 2**32 (N rows, V the vocabulary, H the hidden size; about 40 us of GEMMs on an H100),
            never inside a CUDA graph capture. True: always (refused under a capture). False: never; every row is
            computed and nothing synchronises. With None or True an unlabelled row's per-row outputs are 0 (lse
            too), whether it was left out or not; with False its lse is its logits' own.
        head_dtype: the logits' precision. "weight" (default): rounded to the weight's dtype, as an unfused bf16
            head and vLLM's default head. "float32": GEMM 1's fp32 sums kept (bias added in fp32), as vLLM's
            ``head_dtype="float32"`` (``hf_overrides``) and SGLang's ``--enable-fp32-lm-head``; the gradient is
            then rounded once to the weight's dtype for grad_hidden and grad_weight, and the chunks hold half as
            many rows. Nothing changes for float32/float64 weights. docs/consistency.md ("Logits precision").
    The logits are ``hidden @ weight.T + bias``; they and their gradient are never materialised whole.
    Differentiable w.r.t. hidden, weight and bias (the gradients are computed in the forward, chunk by chunk).
    No ``inplace_backward``, ``tp_group`` or ``sdp_group``.
    An FSDP2 / DTensor weight (sharded or replicated) is gathered whole for the call (``full_tensor()``; its
    gradient goes back to the weight's own placements); hidden must be a plain tensor.
"""


# The types that are no DTensor, told apart without importing torch.distributed.tensor.
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))


def _plain_lm_head(name: str, hidden: torch.Tensor, weight: torch.Tensor, options: dict) -> torch.Tensor:
    """The lm_head as plain tensors. An FSDP2 / DTensor weight (sharded or replicated) is gathered whole with
    ``full_tensor()``, which autograd differentiates back to the weight's own placements (its backward
    reduce-scatters a sharded weight's gradient), as TRL's fused head does; the hidden states must be a
    plain tensor (this rank's tokens). Returns the weight; a DTensor bias is replaced in `options`."""
    if type(hidden) in _PLAIN and type(weight) in _PLAIN and type(options.get("bias")) in _PLAIN:
        return weight
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):
        raise ValueError(f"{name}: hidden is a DTensor ({hidden.placements}); pass this rank's tokens as a plain "
                         f"tensor (hidden.to_local() for sequence-sharded hidden states, or hidden.full_tensor())")
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    if isinstance(options.get("bias"), DTensor):
        options["bias"] = options["bias"].full_tensor()
    return weight


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits. ``target`` and the
    options are those of ``cross_entropy``; ``reduction="none"`` is available without gradients only (the
    weight gradient is summed over tokens). Returns the loss, as ``cross_entropy``."""
    options = _options("linear_cross_entropy", options, _LINEAR_CROSS_ENTROPY)
    weight = _plain_lm_head("linear_cross_entropy", hidden, weight, options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("linear_cross_entropy", target, weight, 0)
    op = _direct(_ops.linear_cross_entropy)
    return op(hidden, weight, target, **options)[0]


_LINEAR_CROSS_ENTROPY = _wrapper(linear_cross_entropy, "linear_cross_entropy", drop=("label_weight",))


def linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor | None, **options) -> PolicyLossOutput:
    """GRPO of ``hidden @ weight.T (+ bias)`` without materialising the logits. ``target``, ``advantages``,
    ``old_log_probs`` and the options (the policy family's included) are those of ``grpo_loss``; returns its PolicyLossOutput."""
    options = _options("linear_grpo_loss", options, _LINEAR_GRPO)
    weight = _plain_lm_head("linear_grpo", hidden, weight, options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("linear_grpo", target, weight, 0)
        if options.get("document_index") is not None:
            _check_document_ids("linear_grpo", options["document_index"], options.get("num_documents"))
    op = _direct(_ops.linear_grpo)
    return policy_output("linear_grpo", op(hidden, weight, target, advantages, old_log_probs, **options), options)


_LINEAR_GRPO = _wrapper(linear_grpo_loss, "linear_grpo", returns=PolicyLossOutput)


def linear_gspo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor | None, document_index: torch.Tensor, **options) -> PolicyLossOutput:
    """GSPO of ``hidden @ weight.T (+ bias)`` without materialising the logits. ``target``, ``advantages``,
    ``old_log_probs``, ``document_index`` and the options (the policy family's included) are those of ``gspo_loss``; returns its
    PolicyLossOutput. The logits are computed twice, chunk by chunk: once for the per-document ratios, once
    for the gradient."""
    options = _options("linear_gspo_loss", options, _LINEAR_GSPO)
    weight = _plain_lm_head("linear_gspo", hidden, weight, options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("linear_gspo", target, weight, 0)
        _check_document_ids("linear_gspo", document_index, options.get("num_documents"))
    op = _direct(_ops.linear_gspo)
    out = op(hidden, weight, target, advantages, old_log_probs, document_index, **options)
    return policy_output("linear_gspo", out, options)


_LINEAR_GSPO = _wrapper(linear_gspo_loss, "linear_gspo", returns=PolicyLossOutput)


for _f in (linear_cross_entropy, linear_grpo_loss, linear_gspo_loss):
    _f.__doc__ += _LINEAR_ARGS_DOC


# ---- per-token log-probs and entropies -------------------------------------------------------------------------
def _scale_of_temperature(name: str, temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    return 1.0 / float(temperature)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, tp_group=None,
                    **options) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        top_k, top_p, min_p: the sampler's distribution (docs/consistency.md): log-probs and entropies over the
            tokens min_p, then top_k (integer, 0 = off), then top_p ((0, 1], 1 = off) keep; numbers or per token.
        tp_group: vocabulary-parallel process group (rl_losses.distributed).
    Returns: (log_probs, entropy or None), each shaped like ``labels``, float32 (float64 for float64 logits).
    """
    options = _options("token_log_probs", options, _TOKEN_LOG_PROBS)
    if temperature != _TOKEN_TEMPERATURE:  # the default's scale is the op's default: one keyword less to the op
        options["logits_scale_factor"] = _scale_of_temperature("token_log_probs", temperature)
    if tp_group is not None:
        return distributed.token_log_probs(logits, labels, tp_group=tp_group, **options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("token_log_probs", labels, logits, -1)
    op = _direct(_ops.token_log_probs)
    log_probs, entropy = op(logits, labels, **options)
    return log_probs, entropy if options.get("compute_entropy") else None


# temperature = 1 / logits_scale_factor, at the scale's default.
_TOKEN_TEMPERATURE = 1.0 / _schema.default("token_log_probs", "logits_scale_factor")
_TOKEN_LOG_PROBS = _wrapper(token_log_probs, "token_log_probs", drop=_TP_HOOKS + ("logits_scale_factor",), rename={"target": "labels"},
         extra={"temperature": _TOKEN_TEMPERATURE, "tp_group": None})


def linear_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                           temperature: float = 1.0, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_log_probs of ``hidden @ weight.T (+ bias)`` without materialising the logits. The backward
    computes each chunk's logits again (it needs the upstream gradients), so it costs one more GEMM per
    chunk than the forward-computed gradients of the linear losses; it is also where ``weight_main_grad`` is
    added into, with the real upstream gradients. Unlabelled rows are skipped only without the entropy."""
    options = _options("linear_token_log_probs", options, _LINEAR_TOKEN_LOG_PROBS)
    if temperature != _LINEAR_TOKEN_TEMPERATURE:  # as token_log_probs
        options["logits_scale_factor"] = _scale_of_temperature("linear_token_log_probs", temperature)
    weight = _plain_lm_head("linear_token_log_probs", hidden, weight, options)
    if _CHECK_INPUTS in _ENVIRON:
        _check_labels_in("linear_token_log_probs", labels, weight, 0)
    op = _direct(_ops.linear_token_log_probs)
    log_probs, entropy = op(hidden, weight, labels, **options)
    return log_probs, entropy if options.get("compute_entropy") else None


_LINEAR_TOKEN_TEMPERATURE = 1.0 / _schema.default("linear_token_log_probs", "logits_scale_factor")
_LINEAR_TOKEN_LOG_PROBS = _wrapper(linear_token_log_probs, "linear_token_log_probs", drop=("logits_scale_factor",), rename={"target": "labels"},
         extra={"temperature": _LINEAR_TOKEN_TEMPERATURE})
linear_token_log_probs.__doc__ += _LINEAR_ARGS_DOC.replace(
    "    Differentiable w.r.t. hidden, weight and bias (the gradients are computed in the forward, chunk by chunk).\n",
    "    Differentiable w.r.t. hidden, weight and bias.\n")
