"""``policy_token_loss``: the policy losses' per-token math on per-token log-probs (docs/policy_losses.md).

For trainers that compute the log-probs of the labels themselves (verl's policy-loss registry,
``rl_losses.integrations.verl``) and aggregate the per-token losses their own way: the op evaluates, per token,
the same loss ℓ_t = ω_t·s_t + β·KL_t and derivative ∂ℓ_t/∂lp_t that the fused GRPO ops evaluate per row of
logits (one C++ definition for both, on the CPU and in one CUDA kernel), and the loss is differentiable w.r.t.
``log_probs`` through that derivative.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from rl_losses import _schema
from rl_losses._inputs import _direct, _options

_ops = torch.ops.rl_losses


class PolicyTokenOutput(NamedTuple):
    """Per-token outputs, shaped like ``log_probs`` (float32; float64 for float64 log-probs).

    loss: ℓ_t (the surrogate times the rollout weight, plus β·KL_t), differentiable w.r.t. ``log_probs``; every
    other field is detached. ratio: r_t = exp(lp_t − old_t). clipped_low / clipped_high: 1.0 where the ratio is
    clipped below / above (ppo_clip, TRL's flags on min(r, δ)), capped (cispo, as "high") or outside DPPO's trust
    region (dppo_tv / dppo_kl: "high" where A > 0, "low" elsewhere) or in clip_cov's subset ("high"), else 0. kl: KL_t
    (importance weighted with ``kl_importance_weighted``), 0 without ``ref_log_probs``. rollout_weight: ω_t, 1
    without a rollout correction. Every field is 0 outside ``loss_mask``.
    """
    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    kl: torch.Tensor
    rollout_weight: torch.Tensor


def policy_token_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor | None, advantages: torch.Tensor,
                      **options) -> PolicyTokenOutput:
    """Per-token policy loss from per-token log-probs (no aggregation: weigh and sum ``loss`` as you need).

    Args:
        log_probs: (...) float, the current policy's log-prob of each label (differentiable).
        old_log_probs: (...) float, the sampling policy's; None for on-policy (r ≡ 1, with ∂r/∂lp = 1).
        advantages: (...) float per token, or (B,) per sequence for (B, T) log-probs.
        The options are ``rl_losses.grpo_loss``'s (``loss_type`` ppo_clip / cispo / sapo and verl's gpg / dro /
        dppo_tv / dppo_kl / clip_cov / kl_cov with ``dro_beta`` / ``clip_ratio_c`` / ``clip_cov_*`` /
        ``kl_cov_ratio`` / ``ppo_kl_coef``, their statistics over the tokens of ``loss_mask``, ``delta``,
        ``ref_log_probs``/``beta``/``kl_estimator``/``kl_importance_weighted``), and its token-level rollout
        correction (``rollout_correction`` 'token_truncate' / 'token_mask' with ``rollout_log_probs``); the
        sequence-level modes and the entropy bonus need the fused ops.
        loss_mask: (...) bool or integer, optional: where it is 0 no input is read (padding may hold NaN or inf)
            and every output, the gradient included, is 0.
    """
    options = _options("policy_token_loss", options, _KEYWORDS)
    op = _direct(_ops.policy_token_loss)
    out = op(log_probs, old_log_probs, advantages, **options)
    return PolicyTokenOutput._make(_RESULTS(out))


_RESULTS = _schema.getter("policy_token_loss", PolicyTokenOutput._fields)
# ref_log_probs and rollout_log_probs are positional in the schema (as callers of the op pass them) but
# options here, as in the fused ops.
_KEYWORDS = _schema.arguments("policy_token_loss") - {"log_probs", "old_log_probs", "advantages"}
policy_token_loss.__signature__ = _schema.signature("policy_token_loss", keyword_only=_KEYWORDS,
                                                    returns=PolicyTokenOutput)
