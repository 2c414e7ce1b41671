"""Aggregation presets of the policy losses: the per-token ``loss_weights`` w_t and the ``divisor`` D of
L = Σ_t w_t·ℓ_t / D that reproduce TRL's and verl's loss normalisations (docs/policy_losses.md).

    weights, divisor = aggregation_weights("sequence_mean_token_mean", completion_mask=mask)
    out = rl_losses.grpo_loss(logits, labels, advantages, old, loss_weights=weights, divisor=divisor)

Presets (m_t = 1 on a completion token, B = number of sequences, |o_i| = completion tokens of sequence i):

| preset                     | w_t       | D                         | TRL loss_type     | verl loss_agg_mode      |
|----------------------------|-----------|---------------------------|-------------------|-------------------------|
| token_mean                 | m_t       | Σm (or num_items_in_batch)| dapo, bnpo, cispo | token-mean              |
| sequence_mean_token_mean   | m_t/|o_i| | B                         | grpo, sapo        | seq-mean-token-mean     |
| sequence_sum_constant      | m_t       | B·max_completion_length   | dr_grpo           | seq-mean-token-sum-norm |
| luspo                      | m_t       | B                         | luspo             | seq-mean-token-sum      |

Inputs are either a padded batch (``completion_mask`` (B, T): B sequences of T positions) or a packed one
(``labels`` and ``document_index``, any equal shapes: a token counts where its label is >= 0 and its document
id >= 0; B is the number of documents). ``divisor`` is returned as a float where it is known without reading
the data, and as None where it is the op's own default (the number of labelled tokens), so that no preset makes
the host wait for the device unless a packed batch is given without ``num_documents``.
"""
from __future__ import annotations

import torch

PRESETS = ("token_mean", "sequence_mean_token_mean", "sequence_sum_constant", "luspo")

# TRL GRPOTrainer's loss_type -> (our loss_type, aggregation preset). TRL's vespo, cispo and dapo divide by
# num_items_in_batch: pass it to the token_mean preset.
TRL_LOSS_TYPES = {
    "grpo": ("ppo_clip", "sequence_mean_token_mean"),
    "bnpo": ("ppo_clip", "token_mean"),
    "dapo": ("ppo_clip", "token_mean"),
    "dr_grpo": ("ppo_clip", "sequence_sum_constant"),
    "luspo": ("ppo_clip", "luspo"),
    "cispo": ("cispo", "token_mean"),
    "sapo": ("sapo", "sequence_mean_token_mean"),
    "vespo": ("vespo", "token_mean"),
}

# verl's actor.loss_agg_mode -> preset.
VERL_LOSS_AGG_MODES = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "sequence_mean_token_mean",
    "seq-mean-token-sum": "luspo",
    "seq-mean-token-sum-norm": "sequence_sum_constant",
}


def trl_loss_type(name: str) -> tuple[str, str]:
    """(loss_type, preset) of a TRL ``loss_type`` name; a ValueError naming the known ones otherwise."""
    if name not in TRL_LOSS_TYPES:
        raise ValueError(f"TRL loss_type must be one of {sorted(TRL_LOSS_TYPES)}, got {name!r}")
    return TRL_LOSS_TYPES[name]


def _sequences(completion_mask, labels, document_index, num_documents, dtype):
    """(mask (float), sequence id per token, number of sequences) of a padded or a packed batch."""
    if completion_mask is not None:
        if labels is not None or document_index is not None:
            raise ValueError("aggregation_weights: give completion_mask (padded batch) or labels and "
                             "document_index (packed batch), not both")
        if completion_mask.dim() != 2:
            raise ValueError(f"aggregation_weights: completion_mask must be (B, T), got shape "
                             f"{tuple(completion_mask.shape)}")
        b, t = completion_mask.shape
        seq = torch.arange(b, device=completion_mask.device).unsqueeze(1).expand(b, t)
        return completion_mask.to(dtype), seq, b
    if labels is None or document_index is None:
        raise ValueError("aggregation_weights: needs completion_mask (B, T), or labels and document_index")
    if labels.shape != document_index.shape:
        raise ValueError(f"aggregation_weights: labels has shape {tuple(labels.shape)} but document_index has "
                         f"{tuple(document_index.shape)}")
    if document_index.is_floating_point():
        raise ValueError(f"aggregation_weights: document_index must be an integer tensor, got "
                         f"{document_index.dtype}")
    mask = ((labels >= 0) & (document_index >= 0)).to(dtype)
    if num_documents is None:
        num_documents = int(document_index.max()) + 1 if document_index.numel() else 0
    return mask, document_index.long(), int(num_documents)


def aggregation_weights(preset: str, *, completion_mask: torch.Tensor | None = None,
                        labels: torch.Tensor | None = None, document_index: torch.Tensor | None = None,
                        num_documents: int | None = None, max_completion_length: int | None = None,
                        num_items_in_batch: float | None = None,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float | None]:
    """(loss_weights, divisor) of an aggregation preset (see the module's table).

    Args:
        preset: one of PRESETS (rl_losses.aggregation.TRL_LOSS_TYPES maps TRL's names to them).
        completion_mask: (B, T) bool/int/float, 1 on completion tokens (padded batch); or
        labels, document_index: the packed batch's labels (negative = no label) and document ids (negative =
            padding); num_documents: B for the packed batch (default: max(document_index) + 1, read on the host).
        max_completion_length: the constant of "sequence_sum_constant" (Dr. GRPO), required there.
        num_items_in_batch: "token_mean" only: the token count to divide by in place of this batch's (TRL's dapo
            and cispo divide by the generation batch's count over all processes).
        dtype: of the weights: the op's working precision (float32; float64 for float64 logits), since
            1/|o_i| is not exact in float32.
    Returns: loss_weights (``dtype``, shaped like the mask) and the divisor (a float, or None for the op's default:
        the number of labelled tokens).
    """
    if preset not in PRESETS:
        raise ValueError(f"aggregation_weights: preset must be one of {PRESETS}, got {preset!r}")
    if num_items_in_batch is not None and preset != "token_mean":
        raise ValueError(f"aggregation_weights: num_items_in_batch applies to 'token_mean' only, got preset "
                         f"{preset!r}")
    mask, seq, b = _sequences(completion_mask, labels, document_index, num_documents, dtype)
    if preset == "token_mean":
        if num_items_in_batch is not None and not num_items_in_batch > 0:
            raise ValueError(f"aggregation_weights: num_items_in_batch must be > 0, got {num_items_in_batch}")
        return mask, None if num_items_in_batch is None else float(num_items_in_batch)
    divisor = float(max(b, 1))
    if preset == "sequence_mean_token_mean":
        flat = torch.where(seq >= 0, seq, 0).reshape(-1)
        counts = torch.zeros(max(b, 1), dtype=mask.dtype, device=mask.device).index_add_(0, flat, mask.reshape(-1))
        return mask / counts.clamp_min(1)[flat].reshape(mask.shape), divisor
    if preset == "sequence_sum_constant":
        if max_completion_length is None or int(max_completion_length) <= 0:
            raise ValueError(f"aggregation_weights: 'sequence_sum_constant' needs max_completion_length > 0, got "
                             f"{max_completion_length}")
        return mask, divisor * int(max_completion_length)
    return mask, divisor  # luspo
