"""Loss modules built from ``rl_losses.config``: ``forward(logits, batch) -> (weighted loss, metrics)``.

The batch is a dict with Fast-LLM's keys (``LanguageModelLossKwargs``); ``rl_losses.packing.pack_documents``
builds one. Each module picks its implementation per call from ``config.use_cuda_kernel`` and the logits'
device (``LanguageModelLoss.uses_kernel``): the extension's op (``rl_losses.functional``) or the pure-PyTorch
reference (``rl_losses.reference``); both take the same options and return the same ``PolicyLossOutput``.

Metrics are detached 0-dim tensors (never ``.item()``: logging decides when to synchronise), named like
Fast-LLM's: ``<name>`` (the unweighted loss), ``<name>_new_logprobs``, and with ``metrics="basic"`` or
``"with_entropy"``: ``_old_logprobs``, ``_ratio_new_old``, ``_kl_new_old``, ``_clipped_ratio_fraction``
(``_low`` / ``_high``), ``_advantage``, ``_max_advantage``, ``_min_advantage``, ``_num_tokens``, GSPO's
``_num_segments``, and ``_entropy``.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable

import torch

from rl_losses import _schema, distillation, dpo, functional, reference, reference_topk, topk_distillation
from rl_losses._calls import DirectCallModule, _Bound, _call_op, _given, _require
from rl_losses._inputs import _CHECK_INPUTS, _ENVIRON, _tracing

if typing.TYPE_CHECKING:  # the configs build these modules (config.py imports this file, not the reverse)
    from rl_losses.config import (
        LanguageModelDistillationLossConfig,
        LanguageModelTopkDistillationLossConfig,
        LanguageModelDPOLossConfig,
        LanguageModelGRPOLossConfig,
        LanguageModelGSPOLossConfig,
        LanguageModelLabelEntropyLossConfig,
        LanguageModelLossConfig,
        LanguageModelPolicyGradientLossConfig,
        LanguageModelZLossConfig,
    )

Batch = dict[str, Any]


class LanguageModelLossKwargs:
    """The batch keys the modules read (Fast-LLM's names, plus ``ref_log_probs``, ``loss_mask``, ``num_documents``).

    Per-token tensors have the logits' batch shape (...,); counts may be ints or 0-dim tensors.
    """

    labels = "labels"  # int64/int32 next-token targets, negative = no label
    advantages = "advantages"  # float, per token
    old_log_probabilities = "old_log_probabilities"  # float, log-prob of the label under the sampling policy
    ref_log_probs = "ref_log_probs"  # float, under the reference policy (GRPO with beta > 0)
    rollout_log_probs = "rollout_log_probs"  # float, under the inference engine (GRPO's rollout_correction)
    label_counts = "label_counts"  # int/float, labelled-token count of each token's document
    document_index = "document_index"  # int, 0-based document of each token, negative = padding (GSPO)
    num_documents = "num_documents"  # int, the count of document_index's ids (default max(index) + 1, a sync)
    num_labels_in_batch = "num_labels_in_batch"  # token-mean divisor (global under data parallelism)
    num_documents_in_batch = "num_documents_in_batch"  # document-mean divisor (global under data parallelism)
    loss_mask = "loss_mask"  # bool, tokens the z-loss covers


class LanguageModelLoss(DirectCallModule):
    """Base of the loss modules: the implementation switch, the weight and the metric naming.

    Args:
        config: the (validated) config this module was built from.
        name: prefix of the metric names.
        tp_group: vocabulary-parallel process group, forwarded to the extension's op (not the reference).
    """

    _direct_ok = False  # whether _direct_inputs and _forward come from one class (found per class: __init_subclass__)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass's own _forward, which the direct call would skip, keeps its calls off it.
        cls._direct_ok = "_direct_inputs" in cls.__dict__ or (cls._direct_ok and "_forward" not in cls.__dict__)

    def __init__(self, config: LanguageModelLossConfig, *, name: str, tp_group=None):
        super().__init__()
        self.config = config
        self.name = name
        self.tp_group = tp_group
        if tp_group is not None and config.use_cuda_kernel is False:
            raise ValueError(f"{type(self).__name__} {name!r}: tp_group needs the extension's op, but "
                             f"use_cuda_kernel=False selects the pure-PyTorch reference, which has no tp_group")

    def extra_repr(self) -> str:
        return f"name={self.name!r}, config={self.config}"

    def uses_kernel(self, logits: torch.Tensor) -> bool:
        """Whether this call runs the extension's op (True) or the pure-PyTorch reference (False)."""
        choice = self.config.use_cuda_kernel
        if choice is None:  # the default: the extension runs on the CPU always, on "meta" through its fake kernels,
            # on CUDA when built so (the device's flags are read faster than its torch.device is made)
            if logits.is_cuda:
                return functional.cuda_kernels_available()
            return logits.is_cpu or logits.is_meta
        if choice is True:
            problems = []
            if logits.device.type != "cuda":
                problems.append(f"the logits are on {logits.device}, not a CUDA device")
            if not functional.cuda_kernels_available():
                problems.append("rl_losses was built without its CUDA kernels (a CPU-only build; rebuild with "
                                "RL_LOSSES_CUDA=1 on a machine with nvcc)")
            if problems:
                raise RuntimeError(f"{type(self).__name__} {self.name!r}: use_cuda_kernel=True requires the CUDA "
                                   f"kernel, but {' and '.join(problems)}. Set use_cuda_kernel=None to use the "
                                   f"extension wherever it runs, or False for the pure-PyTorch reference.")
            return True
        return False

    def forward(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Args:
            logits: (..., V) float32/bfloat16/float16/float64 (this rank's vocabulary shard under tp_group).
            batch: per-token tensors of shape (...,) and counts, keyed as in LanguageModelLossKwargs.
        Returns: (config.weight · loss) as a differentiable float32 (float64 for float64 logits) scalar, and the
            metrics dict of detached 0-dim tensors, ``{name: loss, ...}`` (the loss there is unweighted).
        """
        bound = self._bound_of.get(logits.is_cuda)
        if bound is None or not (logits.is_cpu or logits.is_cuda):
            bound = self._bind(logits)
        # The direct call (_Bound.op, _call_op) where the wrapper would do nothing more and the config nothing per
        # call; where the batch lacks a tensor the op needs, _forward tells which.
        if bound.op is not None and _CHECK_INPUTS not in _ENVIRON and not _tracing():
            out = _call_op(bound, logits, batch)
            if out is not None:
                return out
        loss, metrics = self._forward(logits, batch, bound)
        # The metric is `loss.data`: detached as loss.detach() is, without the dispatcher's call and the view's autograd
        # record that detach() makes (~1.5 µs of host time per call on a CPU host); torch.compile traces it too.
        return (loss if bound.weight == 1.0 else loss * bound.weight), {bound.name: loss.data, **metrics}

    def _forward(self, logits, batch, bound: _Bound) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def _options(self, kernel: bool) -> dict[str, Any]:
        # Options only the extension's op takes (the caller must not change the dict).
        return self._kernel_options if kernel else _NO_OPTIONS

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "tp_group":  # the extension's own options (none for the reference), passed on when set
            self._kernel_options = {"tp_group": value} if value is not None else {}
        if name in ("config", "name", "tp_group"):  # what was found from them once is found again (configs are frozen)
            self._config_options_of: dict[str, dict[str, Any]] = {}
            self._bound_of: dict[bool, _Bound] = {}  # by logits.is_cuda, for CPU and CUDA logits

    def _config_options(self, op: str) -> dict[str, Any]:
        """The config's fields that are options of `op`, less those at the op's defaults: the config gives them the
        op's names (and the reference takes the same, with the same defaults), so they pass through by name. Found
        once per op (the config is frozen); the caller must not change the dict."""
        options = self._config_options_of.get(op)
        if options is None:
            names, defaults = _schema.arguments(op), _schema.defaults(op)
            options = {name: value for name, value in ((f.name, getattr(self.config, f.name))
                                                       for f in dataclasses.fields(self.config) if f.name in names)
                       if not (name in defaults and value == defaults[name])}
            self._config_options_of[op] = options
        return options

    def _bind(self, logits: torch.Tensor) -> _Bound:
        """The call's _Bound for logits of that device: kept for CPU and CUDA logits, where uses_kernel's answer
        depends only on the device (or raises each time)."""
        bound = _Bound(self, self.uses_kernel(logits))
        if logits.is_cpu or logits.is_cuda:
            self._bound_of[logits.is_cuda] = bound
        return bound

    def _function(self, kernel: bool) -> Callable | None:
        """The function of the modules that bind their op's arguments (None for the others)."""
        return None

    def _fixed_options(self) -> dict[str, Any]:
        """The options from the config that every call passes (the modules that bind their op's arguments)."""
        return {}

    def _batch_options(self) -> tuple[tuple[str, str], ...]:
        """(option, batch key) of the batch's optional entries passed on as options where present."""
        return ()

    def _required(self) -> tuple[tuple[str, str, str], ...]:
        """(option, batch key, what needs it) of each batch tensor the config needs."""
        return ()

    def _direct_inputs(self) -> tuple[tuple[str, ...], tuple[int, ...], str | None] | None:
        """Where forward may call the op directly (the config leaves nothing to do per call but to pass the batch's
        entries on): the batch keys of the op's tensors after the logits, in its order, the positions of those
        _forward requires, and the op's result that is the second metric (None: the loss alone). Else None."""
        return None


_NO_OPTIONS: dict[str, Any] = {}


class LanguageModelLabelEntropyLoss(LanguageModelLoss):
    """Cross-entropy from ``labels``, divided by ``num_labels_in_batch`` (default: the labelled tokens here)."""

    config: LanguageModelLabelEntropyLossConfig

    def _forward(self, logits, batch, bound):
        labels = _require(batch, LanguageModelLossKwargs.labels, bound.name)
        return bound.function(logits, labels, **_given(bound, batch)), {}

    def _function(self, kernel):
        return functional.cross_entropy if kernel else reference.cross_entropy

    def _fixed_options(self):
        return self._config_options("cross_entropy")

    def _batch_options(self):
        return _DIVISOR_KEYS

    def _direct_inputs(self):
        return (LanguageModelLossKwargs.labels,), (0,), None


class LanguageModelZLoss(LanguageModelLoss):
    """Z-loss Σ_t mask_t·lse_t² / Σ_t mask_t over the batch's ``loss_mask`` (every token when absent)."""

    config: LanguageModelZLossConfig

    def _forward(self, logits, batch, bound):
        fn = functional.z_loss if bound.kernel else reference.z_loss
        loss = fn(logits, loss_mask=batch.get(LanguageModelLossKwargs.loss_mask),
                  logits_scale_factor=self.config.logits_scale_factor, **bound.options)
        return loss, {}


class LanguageModelPolicyGradientLoss(LanguageModelLoss):
    """Shared inputs and metrics of GRPO and GSPO."""

    config: LanguageModelPolicyGradientLossConfig

    def _fixed_options(self):
        # The config's options of the op (the clip, beta, the policy family's: docs/policy_losses.md), the entropy
        # where the metrics want it, and none of the op's metrics but new_logprobs at "none".
        options = dict(self._config_options(self.config.type_name))
        if self.config.metrics == "with_entropy":
            options["compute_entropy"] = True
        if self.config.metrics == "none":
            options["compute_metrics"] = False
        return options

    def _required(self):
        # The KL (term and metric) only with beta > 0, as TRL logs it.
        cfg = self.config
        return ((("ref_log_probs", LanguageModelLossKwargs.ref_log_probs, "beta > 0"),) if cfg.beta > 0 else ()) + (
            (("rollout_log_probs", LanguageModelLossKwargs.rollout_log_probs,
              f"rollout_correction={cfg.rollout_correction!r}"),) if cfg.rollout_correction is not None else ())

    def _metrics(self, out: functional.PolicyLossOutput, batch: Batch, mask: torch.Tensor,
                 num_segments: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        # The metrics of metrics="basic" and "with_entropy" (at "none", new_logprobs alone: the losses give it); mask:
        # the tokens that count.
        n = self.name
        metrics = {f"{n}_new_logprobs": out.new_logprobs}
        metrics.update({
            f"{n}_ratio_new_old": out.ratio_mean,
            f"{n}_kl_new_old": out.kl_old,
            f"{n}_clipped_ratio_fraction": out.clipped_fraction_low + out.clipped_fraction_high,
            f"{n}_clipped_ratio_fraction_low": out.clipped_fraction_low,
            f"{n}_clipped_ratio_fraction_high": out.clipped_fraction_high,
        })
        # Per-token statistics of the inputs, weighted like new_logprobs (each document weighs 1 when the
        # label counts are known); O(N) work, no pass over the vocabulary.
        with torch.no_grad():
            dtype = out.new_logprobs.dtype
            advantages = batch[LanguageModelLossKwargs.advantages].to(dtype)
            if advantages.shape != mask.shape:
                if advantages.dim() < mask.dim() and advantages.shape == mask.shape[:advantages.dim()]:
                    # per sequence: broadcast over its tokens
                    advantages = advantages.reshape(advantages.shape + (1,) * (mask.dim() - advantages.dim()))
                    advantages = advantages.expand(mask.shape)
                else:  # per document (GSPO)
                    advantages = advantages[batch[LanguageModelLossKwargs.document_index].clamp_min(0).long()]
            old = batch.get(LanguageModelLossKwargs.old_log_probabilities)
            old = out.log_probs.to(dtype) if old is None else old.to(dtype)  # on-policy: old = lp
            counts = batch.get(LanguageModelLossKwargs.label_counts)
            weight = mask.to(dtype) if counts is None else mask / counts.to(dtype).clamp_min(1)
            total = weight.sum().clamp_min(1e-30)
            metrics[f"{n}_old_logprobs"] = (weight * old).sum() / total
            metrics[f"{n}_advantage"] = (weight * advantages).sum() / total
            if mask.numel() > 0:  # where(), not advantages[mask]: boolean indexing synchronises on CUDA
                metrics[f"{n}_max_advantage"] = torch.where(mask, advantages, -torch.inf).amax()
                metrics[f"{n}_min_advantage"] = torch.where(mask, advantages, torch.inf).amin()
            metrics[f"{n}_num_tokens"] = mask.sum()
            if num_segments is not None:
                metrics[f"{n}_num_segments"] = num_segments
        if out.entropy is not None:
            metrics[f"{n}_entropy"] = out.entropy
        if out.kl is not None:
            metrics[f"{n}_kl"] = out.kl
        if out.rollout_ratio_mean is not None:
            metrics[f"{n}_rollout_ratio"] = out.rollout_ratio_mean
            metrics[f"{n}_rollout_weight"] = out.rollout_weight_mean
            metrics[f"{n}_rollout_corrected_fraction"] = out.rollout_corrected_fraction
        if out.vespo_phi_seq_mean is not None:
            metrics[f"{n}_vespo_phi"] = out.vespo_phi_seq_mean
        return metrics


def _policy_inputs(batch: Batch, name: str):
    """labels, advantages and old log-probs (None: on-policy)."""
    labels = batch.get(LanguageModelLossKwargs.labels)
    advantages = batch.get(LanguageModelLossKwargs.advantages)
    if labels is None or advantages is None:
        labels = _require(batch, LanguageModelLossKwargs.labels, name)
        advantages = _require(batch, LanguageModelLossKwargs.advantages, name)
    return labels, advantages, batch.get(LanguageModelLossKwargs.old_log_probabilities)


# The policy ops' tensors after the logits (the direct call of LanguageModelLoss.forward; _policy_inputs's).
_POLICY_KEYS = (LanguageModelLossKwargs.labels, LanguageModelLossKwargs.advantages,
                LanguageModelLossKwargs.old_log_probabilities)
# The batch's optional entries that the label loss, GRPO and GSPO pass on as options: (option, batch key).
_DIVISOR_KEYS = (("divisor", LanguageModelLossKwargs.num_labels_in_batch),)
_LABEL_COUNTS_KEYS = (("label_counts", LanguageModelLossKwargs.label_counts),)
_TOKEN_MEAN_KEYS = (*_DIVISOR_KEYS, *_LABEL_COUNTS_KEYS)
_GSPO_KEYS = (("num_documents", LanguageModelLossKwargs.num_documents), *_LABEL_COUNTS_KEYS,
              ("divisor", LanguageModelLossKwargs.num_documents_in_batch))


class LanguageModelGRPOLoss(LanguageModelPolicyGradientLoss):
    """GRPO (docs/math.md); ``config.loss_normalization`` chooses the token weights and the divisor."""

    config: LanguageModelGRPOLossConfig

    def _num_documents(self, batch: Batch, mask: torch.Tensor):
        # The document-mean divisor: given, or counted from the label counts / document index of this batch.
        if batch.get(LanguageModelLossKwargs.num_documents_in_batch) is not None:
            return batch[LanguageModelLossKwargs.num_documents_in_batch]
        if batch.get(LanguageModelLossKwargs.label_counts) is not None:
            # Each labelled document's tokens carry 1/N each: the sum is the number of labelled documents.
            return (mask / batch[LanguageModelLossKwargs.label_counts].clamp_min(1)).sum().round().clamp_min(1)
        if batch.get(LanguageModelLossKwargs.document_index) is not None:
            index = batch[LanguageModelLossKwargs.document_index]
            return index[mask & (index >= 0)].unique().numel() or 1
        raise ValueError(f"{self.name}: loss_normalization={self.config.loss_normalization!r} divides by the number "
                         f"of documents: give 'num_documents_in_batch', 'label_counts' or 'document_index' in the "
                         f"batch (keys given: {sorted(batch)})")

    def _forward(self, logits, batch, bound):
        labels, advantages, old_log_probs = _policy_inputs(batch, bound.name)
        cfg = bound.config
        # The labelled tokens, for the document count and the metrics: not computed where neither is wanted.
        mask = labels >= 0 if cfg.loss_normalization != "token" or cfg.metrics != "none" else None
        options = _given(bound, batch)
        sequences = cfg.loss_type == "vespo" or (cfg.rollout_correction is not None
                                                 and cfg.rollout_correction.startswith("sequence"))
        if cfg.loss_normalization != "token" or sequences:
            options = dict(options)  # (the bound dict itself where the batch adds nothing)
        if cfg.loss_normalization != "token":
            divisor = self._num_documents(batch, mask)
            loss_weights = None
            if cfg.loss_normalization == "sequence":
                counts = _require(batch, LanguageModelLossKwargs.label_counts, self.name)
                # In the op's working precision (fp32, fp64 for fp64 logits): 1/|o_i| is not exact in fp32.
                loss_weights = mask / counts.to(torch.promote_types(logits.dtype, torch.float32)).clamp_min(1)
            elif cfg.loss_normalization == "dr_grpo":
                divisor = divisor * cfg.max_completion_length
            options["divisor"] = divisor
            if loss_weights is not None:
                options["loss_weights"] = loss_weights
        # The sequences of a sequence-level rollout correction and of vespo: the packed documents when given.
        if sequences:
            document_index = batch.get(LanguageModelLossKwargs.document_index)
            if document_index is not None:
                options["document_index"] = document_index
                if batch.get(LanguageModelLossKwargs.num_documents) is not None:
                    options["num_documents"] = batch[LanguageModelLossKwargs.num_documents]
        out = bound.function(logits, labels, advantages, old_log_probs, **options)
        if cfg.metrics == "none":
            return out.loss, {bound.new_logprobs_name: out.new_logprobs}
        return out.loss, self._metrics(out, batch, mask)

    def _function(self, kernel):
        return functional.grpo_loss if kernel else reference.grpo_loss

    def _batch_options(self):
        return _TOKEN_MEAN_KEYS if self.config.loss_normalization == "token" else _LABEL_COUNTS_KEYS

    def _direct_inputs(self):
        # Not where the divisor, the token weights or the sequences come from the batch per call, or the metrics.
        cfg = self.config
        if (cfg.metrics != "none" or cfg.loss_normalization != "token" or cfg.loss_type == "vespo"
                or (cfg.rollout_correction is not None and cfg.rollout_correction.startswith("sequence"))):
            return None
        return _POLICY_KEYS, (0, 1), "new_logprobs"


class LanguageModelGSPOLoss(LanguageModelPolicyGradientLoss):
    """GSPO (docs/math.md) over the packed documents of ``document_index``, divided by ``num_documents_in_batch``
    (default: the documents holding at least one labelled token)."""

    config: LanguageModelGSPOLossConfig

    def _forward(self, logits, batch, bound):
        labels, advantages, old_log_probs = _policy_inputs(batch, bound.name)
        document_index = _require(batch, LanguageModelLossKwargs.document_index, bound.name)
        cfg = bound.config
        out = bound.function(logits, labels, advantages, old_log_probs, document_index, **_given(bound, batch))
        if cfg.metrics == "none":
            return out.loss, {bound.new_logprobs_name: out.new_logprobs}
        mask = (labels >= 0) & (document_index >= 0)
        with torch.no_grad():  # documents holding a labelled token (scatter, no boolean indexing: no sync)
            ratios = out.document_ratios
            index = torch.where(mask, document_index, 0).reshape(-1).long()
            hits = torch.zeros_like(ratios).index_add_(0, index, mask.reshape(-1).to(ratios.dtype))
            num_segments = (hits > 0).sum()
        return out.loss, self._metrics(out, batch, mask, num_segments)

    def _function(self, kernel):
        return functional.gspo_loss if kernel else reference.gspo_loss

    def _batch_options(self):
        return _GSPO_KEYS

    def _direct_inputs(self):
        if self.config.metrics != "none":
            return None
        return (*_POLICY_KEYS, LanguageModelLossKwargs.document_index), (0, 1, 3), "new_logprobs"


def _of_reference_model(batch: Batch, key: str, name: str, owner: str) -> torch.Tensor:
    """batch[key][name]: a reference model's tensor (its logits, its top-K ids or log-probs)."""
    by_model = _require(batch, key, owner)
    if name not in by_model:
        raise ValueError(f"{owner}: batch[{key!r}] has no {name!r} (models given: {sorted(by_model)})")
    return by_model[name]


def _reference_logits(batch: Batch, name: str, owner: str) -> torch.Tensor:
    return _of_reference_model(batch, "reference_logits", name, owner)


class LanguageModelDistillationLoss(LanguageModelLoss):
    """Distillation against ``batch["reference_logits"][config.reference_model]``, over ``loss_mask``."""

    config: LanguageModelDistillationLossConfig

    def _forward(self, logits, batch, bound):
        cfg = self.config
        teacher = _reference_logits(batch, cfg.reference_model, self.name)
        fn = distillation.distillation_loss if bound.kernel else reference.distillation_loss
        out = fn(logits, teacher, kind=cfg.loss_type, loss_mask=batch.get(LanguageModelLossKwargs.loss_mask),
                 divisor=batch.get(LanguageModelLossKwargs.num_labels_in_batch),
                 **self._config_options("distillation"), **bound.options)
        return out.loss, {}


class LanguageModelTopkDistillationLoss(LanguageModelLoss):
    """Distillation from the teacher's top-K ids and log-probs over the labelled tokens; metrics
    ``<name>_student_mass`` and ``<name>_teacher_mass`` (their means over those tokens, verl's)."""

    config: LanguageModelTopkDistillationLossConfig

    def _forward(self, logits, batch, bound):
        cfg = self.config
        labels = _require(batch, LanguageModelLossKwargs.labels, self.name)
        ids, log_probs = (_of_reference_model(batch, key, cfg.reference_model, self.name)
                          for key in ("reference_topk_ids", "reference_topk_log_probs"))
        fn = topk_distillation.topk_distillation_loss if bound.kernel else reference_topk.topk_distillation_loss
        out = fn(logits, labels, ids, log_probs, divisor=batch.get(LanguageModelLossKwargs.num_labels_in_batch),
                 **self._config_options("topk_distillation"), **bound.options)
        count = (labels >= 0).sum().clamp_min(1)
        n = self.name
        return out.loss, {f"{n}_student_mass": out.student_mass.sum() / count,
                          f"{n}_teacher_mass": out.teacher_mass.sum() / count}


class LanguageModelDPOLoss(LanguageModelLoss):
    """DPO over the batch's preference pairs; metrics ``<name>_rewards_chosen``, ``_rewards_rejected``,
    ``_accuracy``, ``_margin``."""

    config: LanguageModelDPOLossConfig

    def _forward(self, logits, batch, bound):
        labels = _require(batch, LanguageModelLossKwargs.labels, self.name)
        if batch.get("document_index") is not None and batch.get("dpo_pairs") is not None:
            document_index, pairs = batch["document_index"], batch["dpo_pairs"]
        else:
            document_index, pairs = dpo.documents_from_spans(
                _require(batch, "chosen_spans", self.name), _require(batch, "rejected_spans", self.name),
                labels.shape, labels.device)
        cfg = self.config
        fn = dpo.dpo_loss if bound.kernel else reference.dpo_loss
        if batch.get("reference_chosen_log_probs") is not None:
            ref_c, ref_r = batch["reference_chosen_log_probs"], batch["reference_rejected_log_probs"]
        else:
            with torch.no_grad():  # the reference policy's π of each document, from its logits
                ref_logits = _reference_logits(batch, cfg.reference_model, self.name)
                zeros = torch.zeros(pairs.shape[0], device=labels.device)
                sums = fn(ref_logits, labels, document_index, pairs, zeros, zeros,
                          logits_scale_factor=cfg.logits_scale_factor, **bound.options).document_log_probs
                ref_c, ref_r = sums[pairs[:, 0]], sums[pairs[:, 1]]
        out = fn(logits, labels, document_index, pairs, ref_c, ref_r, **self._config_options("dpo"), **bound.options)
        n = self.name
        return out.loss, {f"{n}_rewards_chosen": out.rewards_chosen, f"{n}_rewards_rejected": out.rewards_rejected,
                          f"{n}_accuracy": out.accuracy, f"{n}_margin": out.margin}
