"""Several losses in one pass over the logits: the functional wrapper of ``torch.ops.rl_losses.fused_head``
(``fused_head_loss``) and the loss module of the ``fused_head`` config (rl_losses.config); docs/distillation_dpo.md."""
from __future__ import annotations

import dataclasses
import typing

import torch

from rl_losses import _schema, distributed
from rl_losses._inputs import _check_document_ids, _direct, _options
from rl_losses.losses import Batch, LanguageModelLoss, LanguageModelLossKwargs, _reference_logits, _require
from rl_losses.outputs import FusedHeadOutput

if typing.TYPE_CHECKING:  # the configs import this module (configs depend on losses, not both ways)
    from rl_losses.config import LanguageModelFusedHeadLossConfig

_ops = torch.ops.rl_losses


def fused_head_loss(logits: torch.Tensor, target: torch.Tensor, *, tp_group=None, vocab_start: int | None = None,
                    vocab_size: int | None = None, **options) -> FusedHeadOutput:
    """Label cross-entropy, z-loss, GRPO or GSPO, and distillation in one pass over the logits, with one summed
    gradient.

    ``loss = label_weight·CE + z_loss_weight·Z + grpo_weight·GRPO + gspo_weight·GSPO + distillation_weight·KD``,
    each term as the separate
    op computes it (rl_losses.cross_entropy with ``label_smoothing``; rl_losses.z_loss over ``z_loss_mask``, every
    token without one; rl_losses.grpo_loss and rl_losses.gspo_loss with their options) and divided by its own
    divisor (default: the term's tokens; GSPO's: the documents holding a labelled token). A term of weight 0 is
    skipped. The statistics of each row are computed once, the logits read once (where the row kernel fuses) and
    the gradient written once. GSPO needs every document's ratio before any gradient: with a GSPO term the logits
    are read twice, a statistics pass then the head's pass, as rl_losses.gspo_loss alone reads them.

    Args:
        logits: (..., V) float32/bfloat16/float16/float64; target: (...) int labels, negative = no label.
        advantages, old_log_probs (and ref_log_probs with beta > 0, optional loss_weights): (...) float, for GRPO.
        The policy terms take rl_losses.grpo_loss's per-token options by the same names (epsilon_low / epsilon_high,
            beta, ``loss_type``, its parameters, ``kl_estimator``, ``kl_importance_weighted``, the rollout-engine
            correction ``rollout_correction`` with ``rollout_log_probs``, ``rollout_cap``, ``rollout_mask_bounds``:
            verl's rollout rejection ``rollout_rs`` / ``rollout_rs_threshold``: docs/policy_losses.md), each term
            equal to its op with them (the sequences of the GRPO term's seq_* rejection modes: ``document_index``,
            else the rows of (B, T) labels). Not fused (refused; grpo_loss and gspo_loss have them): loss_type
            "vespo" and the entropy bonus; in the GRPO term, loss_type "clip_cov" / "kl_cov" and the "sequence_*"
            corrections, which need every token's log-prob first.
        gspo_weight: the GSPO term's weight; GRPO and GSPO are exclusive (at most one weight > 0). The GSPO term is
            rl_losses.gspo_loss with the options above at the sequence ratio (loss_type "ppo_clip", "cispo", "sapo"
            or "geo_mean"; the rollout correction per token or per document), ``weighting`` "document" or
            "token", the documents of ``document_index`` ((...) int, negative = padding; ``num_documents`` its
            size, default max + 1, which synchronises with the host), optional ``label_counts``, ``gspo_divisor``;
            ``advantages`` per token (averaged per document), ``old_log_probs`` None for on-policy. ``delta`` and
            ``loss_weights`` are the GRPO term's and are refused with GSPO.
        distillation_weight: the distillation term's weight, rl_losses.distillation_loss against ``teacher_logits``
            (the logits' shape) with its options ``kind``, ``temperature``, its β as ``distillation_beta`` (``beta``
            is the policy terms' KL weight), its ``loss_mask`` as ``distillation_mask`` (every token without one)
            and ``distillation_divisor``. The head then runs on distillation's passes, which read the student's
            and the teacher's rows together, the other terms' gradients added to its own (docs/distillation_dpo.md);
            refused with the GSPO term and with tp_group (use rl_losses.distillation_loss beside the head there).
        tp_group: vocabulary-parallel process group: ``logits`` hold this rank's columns, labels are global ids;
            the row statistics are all-reduced over the group first, then the op reads its shard once, for the
            terms and the gradient. Every output is identical on every rank; the gradient is this rank's column
            block. vocab_start, vocab_size: this shard's first global column and the global V, for uneven shards.
    Returns: FusedHeadOutput(loss, label_loss, z_loss, grpo_loss, log_probs, gspo_loss, distillation_loss): the
        differentiable weighted total, and each term unweighted and detached (None for a term of weight 0).
    """
    options = _options("fused_head_loss", options, _KEYWORDS)

    def option(name):
        return _schema.option("fused_head", options, name)

    if options.get("document_index") is not None:  # read by GSPO's term and by the GRPO term's sequence rejection
        _check_document_ids("fused_head_loss", options["document_index"], options.get("num_documents"))
    if tp_group is not None or vocab_start is not None or vocab_size is not None:  # else the op's defaults
        options["row_stats"], options["vocab_start"], options["vocab_size"] = distributed._tp_setup(
            "fused_head_loss", logits, target, tp_group, option("logits_scale_factor"), vocab_start, vocab_size,
            smoothing=option("label_smoothing") != 0 and option("label_weight") != 0)
    out = _direct(_ops.fused_head)(logits, target, **options)
    return FusedHeadOutput._make(_RESULTS(out))


_RESULTS = _schema.getter("fused_head", FusedHeadOutput._fields)
_KEYWORDS = distributed._shard_signature(fused_head_loss, "fused_head", extra={"tp_group": None}, returns=FusedHeadOutput)


class LanguageModelFusedHeadLoss(LanguageModelLoss):
    """Several losses over the same logits: the fusable ones (label CE without its own z-loss, z-loss, one policy
    term: GRPO with token normalisation or plain GSPO, each with metrics="none"; one distillation term, not beside
    GSPO nor under tensor parallelism; one logits_scale_factor) in one pass, the others one by one."""

    config: LanguageModelFusedHeadLossConfig

    def __init__(self, config, *, name, tp_group=None):
        super().__init__(config, name=name, tp_group=tp_group)
        self.losses = torch.nn.ModuleDict({k: c.get_loss(name=k, tp_group=tp_group) for k, c in config.losses.items()})

    def _fusable(self, name: str, logits: torch.Tensor, batch: Batch) -> bool:
        cfg = self.config.losses[name]
        module = self.losses[name]
        if not module.uses_kernel(logits) or logits.device.type == "meta":
            return False
        if cfg.type_name == "label":
            return cfg.z_loss_factor == 0
        if cfg.type_name == "z_loss":
            return True
        if cfg.type_name == "grpo":
            return cfg.loss_normalization == "token" and cfg.metrics == "none" and _head_takes(cfg)
        if cfg.type_name == "distillation":  # not under tensor parallelism (fused_head_loss refuses it)
            return self.tp_group is None
        if cfg.type_name == "gspo":  # the form the head fuses (rl_losses.fused_head_loss), per-token advantages
            advantages = batch.get(LanguageModelLossKwargs.advantages)
            labels = batch.get(LanguageModelLossKwargs.labels)
            return (cfg.metrics == "none" and _head_takes(cfg) and cfg.delta is None and advantages is not None
                    and labels is not None and advantages.shape == labels.shape)
        return False

    def _forward(self, logits, batch, bound):
        fused = [k for k in self.losses if self._fusable(k, logits, batch)]
        # One policy term per pass (GRPO or GSPO) and one teacher, not beside GSPO: any other runs on its own.
        policy = [k for k in fused if self.config.losses[k].type_name in ("grpo", "gspo")]
        fused = [k for k in fused if k not in policy[1:]]
        teachers = [k for k in fused if self.config.losses[k].type_name == "distillation"]
        gspo = any(self.config.losses[k].type_name == "gspo" for k in fused)
        fused = [k for k in fused if k not in (teachers if gspo else teachers[1:])]
        scales = {self.config.losses[k].logits_scale_factor for k in fused}
        if len(fused) < 2 or len(scales) != 1:
            fused = []  # nothing to share: every loss on its own
        total, metrics = 0.0, {}
        if fused:
            total, metrics = self._fused(fused, logits, batch, scales.pop())
        for name, module in self.losses.items():
            if name not in fused:
                loss, m = module(logits, batch)
                total = total + loss
                metrics.update(m)
        return total, metrics

    def _fused(self, names, logits, batch, scale):
        kwargs = dict(logits_scale_factor=scale, tp_group=self.tp_group)
        labels = _require(batch, LanguageModelLossKwargs.labels, self.name)
        divisor = batch.get(LanguageModelLossKwargs.num_labels_in_batch)
        for name in names:
            cfg = self.config.losses[name]
            if cfg.type_name == "label":
                kwargs.update(label_weight=cfg.weight, label_smoothing=cfg.label_smoothing, label_divisor=divisor)
            elif cfg.type_name == "z_loss":
                kwargs.update(z_loss_weight=cfg.weight, z_loss_mask=batch.get(LanguageModelLossKwargs.loss_mask))
            elif cfg.type_name == "distillation":  # as LanguageModelDistillationLoss passes it
                kwargs.update(distillation_weight=cfg.weight, kind=cfg.loss_type, distillation_beta=cfg.beta,
                              temperature=cfg.temperature,
                              teacher_logits=_reference_logits(batch, cfg.reference_model, name),
                              distillation_mask=batch.get(LanguageModelLossKwargs.loss_mask),
                              distillation_divisor=divisor)
            elif cfg.type_name == "gspo":  # as LanguageModelGSPOLoss passes it to rl_losses.gspo_loss
                kwargs.update(_policy_options(cfg, batch, name))
                kwargs.update(gspo_weight=cfg.weight,
                              document_index=_require(batch, LanguageModelLossKwargs.document_index, name),
                              num_documents=batch.get(LanguageModelLossKwargs.num_documents),
                              label_counts=batch.get(LanguageModelLossKwargs.label_counts),
                              gspo_divisor=batch.get(LanguageModelLossKwargs.num_documents_in_batch),
                              advantages=_require(batch, LanguageModelLossKwargs.advantages, name),
                              old_log_probs=batch.get(LanguageModelLossKwargs.old_log_probabilities))
            else:
                kwargs.update(_policy_options(cfg, batch, name))
                kwargs.update(grpo_weight=cfg.weight, grpo_divisor=divisor,
                              advantages=_require(batch, LanguageModelLossKwargs.advantages, name),
                              old_log_probs=_require(batch, LanguageModelLossKwargs.old_log_probabilities, name))
        out = fused_head_loss(logits, labels, **kwargs)
        metrics = {}
        for name in names:
            cfg = self.config.losses[name]
            term = {"label": out.label_loss, "z_loss": out.z_loss, "grpo": out.grpo_loss,
                    "gspo": out.gspo_loss, "distillation": out.distillation_loss}[cfg.type_name]
            metrics[name] = term if term is not None else out.loss.detach().new_zeros(())  # a term of weight 0
            if cfg.type_name == "gspo":
                metrics[f"{name}_new_logprobs"] = _gspo_new_logprobs(out.log_probs, labels, kwargs)
            if cfg.type_name == "grpo":  # GRPO's own metric at metrics="none"
                with torch.no_grad():  # the mean over documents of their mean log-prob (token mean without counts)
                    weight = (labels >= 0).to(out.log_probs.dtype)
                    counts = batch.get(LanguageModelLossKwargs.label_counts)
                    if counts is not None:
                        weight = weight / counts.to(weight.dtype).clamp_min(1)
                    metrics[f"{name}_new_logprobs"] = (weight * out.log_probs).sum() / weight.sum().clamp_min(1e-30)
        return out.loss, metrics


def _head_takes(cfg) -> bool:
    """The policy config's options that the fused head does not take (the entropy bonus, VESPO's, …) are
    at their op's defaults, and its loss type and rollout correction are those the head's term fuses."""
    op = cfg.type_name
    names = _schema.arguments(op) - _schema.arguments("fused_head")
    if not all(getattr(cfg, f.name) == _schema.default(op, f.name) for f in dataclasses.fields(cfg) if f.name in names):
        return False
    if cfg.loss_type == "vespo":
        return False
    sequence_rollout = cfg.rollout_correction is not None and cfg.rollout_correction.startswith("sequence")
    return op == "gspo" or not (sequence_rollout or cfg.loss_type in ("clip_cov", "kl_cov"))


def _policy_options(cfg, batch, name) -> dict:
    """The policy config's options the head shares with the config's op, by name (the clip, beta, the per-token
    policy options), with the batch's tensors they need."""
    shared = _schema.arguments(cfg.type_name) & _schema.arguments("fused_head")
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in shared}
    if cfg.beta > 0:
        options["ref_log_probs"] = _require(batch, LanguageModelLossKwargs.ref_log_probs, name)
    if cfg.rollout_correction is not None or options.get("rollout_rs") is not None:
        options["rollout_log_probs"] = _require(batch, LanguageModelLossKwargs.rollout_log_probs, name)
    return options


@torch.no_grad()
def _gspo_new_logprobs(log_probs, labels, kwargs):
    """GSPO's metric at metrics="none": each labelled document's mean log-prob, averaged over those documents."""
    document_index, counts = kwargs["document_index"], kwargs["label_counts"]
    on = ((labels >= 0) & (document_index >= 0)).reshape(-1)
    doc = torch.where(on, document_index.reshape(-1), 0).long()
    n = kwargs["num_documents"]
    if n is None:  # the op itself took max + 1 (a host synchronisation) already
        n = int(doc.max()) + 1 if doc.numel() else 0
    onf = on.to(log_probs.dtype)
    per_document = torch.zeros(n, dtype=onf.dtype, device=onf.device).index_add_(0, doc, onf)
    counts = per_document[doc] if counts is None else counts.reshape(-1).to(onf.dtype)
    labelled_documents = (per_document > 0).sum().clamp_min(1)
    return (onf * log_probs.reshape(-1) / counts.clamp_min(1)).sum() / labelled_documents
