"""The named results of the loss ops (shared by the ops' wrappers and the pure-PyTorch reference)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class PolicyLossOutput(NamedTuple):
    """What the policy losses return. ``loss`` is the differentiable scalar; the rest are detached metrics.

    new_logprobs: mean over documents of each document's mean log-prob of the label (token mean without
        documents). clipped_fraction_low/high: fraction of labelled tokens (GRPO) or documents (GSPO) whose
        ratio is clipped below (r < 1-ε_l, A < 0) / above (r > 1+ε_h, A > 0), TRL's flags on the ratio under
        the two-sided clip, min(r, δ). kl_old: mean k3 estimate of
        KL(new || old) per labelled token (GRPO) or per document on the sequence ratio (GSPO). entropy: mean
        entropy over labelled tokens, or None when not requested. log_probs: per-token log-prob of the label
        (0 where unlabelled). ratio_mean: mean ratio over labelled tokens / documents. document_ratios: R_s
        per document (GSPO), else None. Then the policy family's, None where their option is off: kl (mean KL
        estimate towards the reference), rollout_ratio_mean / rollout_weight_mean / rollout_corrected_fraction,
        vespo_phi_seq_mean (loss_type "vespo": the mean of φ over the labelled sequences). With
        ``compute_metrics=False`` every metric but new_logprobs and the entropy asked for is None.
    """

    loss: torch.Tensor
    new_logprobs: torch.Tensor
    clipped_fraction_low: torch.Tensor | None
    clipped_fraction_high: torch.Tensor | None
    kl_old: torch.Tensor | None
    entropy: torch.Tensor | None
    log_probs: torch.Tensor
    ratio_mean: torch.Tensor | None
    document_ratios: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    rollout_ratio_mean: torch.Tensor | None = None
    rollout_weight_mean: torch.Tensor | None = None
    rollout_corrected_fraction: torch.Tensor | None = None
    vespo_phi_seq_mean: torch.Tensor | None = None
    loss_type: str = "ppo_clip"

    def trl_metrics(self) -> dict[str, torch.Tensor]:
        """The metrics under the names TRL's GRPOTrainer logs (the values stay 0-dim tensors: no host sync).

        ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (ppo_clip) or
        ``cispo_clip_ratio`` (cispo); ``entropy`` when computed; ``kl`` with a reference;
        ``sampling/importance_sampling_ratio/mean`` (the mean correction weight, as TRL logs it after
        truncation or masking) with a rollout correction; ``vespo/phi_seq_mean`` (vespo). Ours are means over
        labelled tokens (GRPO) or documents (GSPO's clip fractions) of this call; TRL averages over its whole batch.
        """
        out: dict[str, torch.Tensor] = {}
        clipped = self.clipped_fraction_low is not None  # None: compute_metrics=False
        if clipped and self.loss_type == "ppo_clip":
            out["clip_ratio/low_mean"] = self.clipped_fraction_low
            out["clip_ratio/high_mean"] = self.clipped_fraction_high
            # The two events exclude each other (A < 0 vs A > 0), so the region fraction is their sum.
            out["clip_ratio/region_mean"] = self.clipped_fraction_low + self.clipped_fraction_high
        elif clipped and self.loss_type == "cispo":
            out["cispo_clip_ratio"] = self.clipped_fraction_high
        if self.entropy is not None:
            out["entropy"] = self.entropy
        if self.kl is not None:
            out["kl"] = self.kl
        if self.rollout_weight_mean is not None:
            out["sampling/importance_sampling_ratio/mean"] = self.rollout_weight_mean
        if self.vespo_phi_seq_mean is not None:
            out["vespo/phi_seq_mean"] = self.vespo_phi_seq_mean
        return out


class DistillationOutput(NamedTuple):
    """What the distillation loss returns: ``loss`` (differentiable w.r.t. the student's logits) and the
    detached per-token ``divergence`` ℓ_t (0 where the loss mask is off)."""

    loss: torch.Tensor
    divergence: torch.Tensor


class TopkDistillationOutput(NamedTuple):
    """What the top-K distillation loss returns: ``loss`` (differentiable w.r.t. the student's logits) and, detached,
    per token: ``divergence`` ℓ_t, ``student_mass`` Q and ``teacher_mass`` P (the probability of the teacher's K
    ids under each side; verl's distillation metrics), each 0 where the token is unlabelled."""

    loss: torch.Tensor
    divergence: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor


class SampledKlOutput(NamedTuple):
    """What the sampled-token KL loss returns: ``loss`` (differentiable), the detached per-token estimate ``kl``
    and ``advantages`` = −(log q(y) − log p_teacher(y)), detached, for the policy losses (0 where unlabelled)."""

    loss: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor


class DpoOutput(NamedTuple):
    """What the DPO loss returns: ``loss`` (differentiable) and detached metrics (TRL's names): the mean rewards
    β·(π − ref) of the chosen and the rejected sides, the accuracy (fraction of pairs whose chosen reward is the
    larger) and the mean margin; per token ``log_probs`` (0 where unlabelled) and per document
    ``document_log_probs`` π_s (the sums of its labelled tokens' log-probs)."""

    loss: torch.Tensor
    rewards_chosen: torch.Tensor
    rewards_rejected: torch.Tensor
    accuracy: torch.Tensor
    margin: torch.Tensor
    log_probs: torch.Tensor
    document_log_probs: torch.Tensor


class FusedHeadOutput(NamedTuple):
    """What the fused head returns: ``loss`` = Σ weight·term (differentiable) and each term unweighted
    (detached): ``label_loss``, ``z_loss``, ``grpo_loss``; per token ``log_probs`` (0 where unlabelled); then
    ``gspo_loss`` and ``distillation_loss`` (last, so that the fields before them keep their positions). A term whose
    weight is 0 is not computed: its field is None."""

    loss: torch.Tensor
    label_loss: torch.Tensor
    z_loss: torch.Tensor
    grpo_loss: torch.Tensor
    log_probs: torch.Tensor
    gspo_loss: torch.Tensor
    distillation_loss: torch.Tensor
