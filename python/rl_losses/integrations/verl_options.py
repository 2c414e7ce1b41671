"""verl's rollout correction as the fused policy ops' options (docs/policy_losses.md: verl's rollout rejection).

``fused_policy_options(config.algorithm.rollout_correction, config.actor_rollout_ref.actor.loss_agg_mode)`` gives
the keyword options of ``rl_losses.grpo_loss`` / ``linear_grpo_loss`` (and, without ``aggregation``, gspo's) that
apply verl's importance weights (``rollout_is``, ``rollout_is_threshold``) and rejection (``rollout_rs``,
``rollout_rs_threshold``) inside the op, from the old and rollout log-probs the caller passes
(``old_log_probs``, ``rollout_log_probs``; in ``bypass_mode`` the current log-probs against the rollout's), with
verl's loss aggregation counted over the kept tokens.
"""
from __future__ import annotations

from rl_losses import aggregation


def _given(config, name, default=None):
    """The config's value of `name` as set (None included), `default` where the config has no such field."""
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def _value(config, name, default=None):
    value = _given(config, name, default)
    return default if value is None else value


def _bounds(threshold) -> tuple[float, float] | None:
    # verl's _parse_rollout_is_threshold: "lower_upper" is IcePop's mask, a single value TIS's cap.
    if isinstance(threshold, str) and "_" in threshold:
        lo, hi = threshold.split("_", 1)
        return float(lo), float(hi)
    return None


def _bypass_loss(rollout_correction, level) -> dict:
    """verl's bypass_mode loss (compute_policy_loss_bypass_mode) as the ops' loss options: "ppo_clip" (the ops'
    default; verl computes the weights for its metrics only), or "reinforce": −A·lp ("gpg") or, with token weights
    min(r, C), −sg(min(r, C))·A·lp ("cispo" with epsilon_high = C, r = π/π_rollout)."""
    loss_type = _value(rollout_correction, "loss_type", "ppo_clip")
    if loss_type == "ppo_clip":
        return {}
    if loss_type != "reinforce":
        raise ValueError(f"fused_policy_options: bypass_mode's loss_type must be 'ppo_clip' or 'reinforce', got "
                         f"{loss_type!r}")
    threshold = _given(rollout_correction, "rollout_is_threshold", 2.0)
    if level is None or threshold is None:
        return {"loss_type": "gpg"}
    if level != "token" or _bounds(threshold) is not None:
        raise ValueError(f"fused_policy_options: bypass_mode with loss_type 'reinforce' takes rollout_is='token' with "
                         f"an upper threshold (the fused ops' cispo), got rollout_is={level!r}, "
                         f"rollout_is_threshold={threshold!r}")
    return {"loss_type": "cispo", "epsilon_high": float(threshold)}


def fused_policy_options(rollout_correction, loss_agg_mode: str | None = None) -> dict:
    """The ops' options of verl's ``algorithm.rollout_correction`` (a RolloutCorrectionConfig or a dict; None: no
    options) and, when given, of its ``actor.loss_agg_mode`` (``aggregation``, or ``divisor=1.0`` for token-sum).

    rollout_is "token" / "sequence" become rollout_correction "token_*" / "sequence_*": "*_truncate" with
    rollout_cap = the threshold (TIS), "*_mask" with rollout_mask_bounds = (lower, upper) for a "lower_upper"
    threshold (IcePop); rollout_rs and rollout_rs_threshold pass as verl's specification. bypass_mode becomes the
    ops' bypass_mode (old_log_probs := rollout_log_probs, the rejection judging the current log-probs; pass the
    rollout's log-probs as rollout_log_probs): with its loss_type "ppo_clip" the weights are verl's metrics only
    (none here), with "reinforce" loss_type "gpg", or "cispo" with epsilon_high = the cap for rollout_is="token"
    (_bypass_loss). Refused: rollout_is_batch_normalize (a batch mean of the weights)."""
    options: dict = {}
    if rollout_correction is not None:
        if _value(rollout_correction, "rollout_is_batch_normalize", False):
            raise ValueError("fused_policy_options: rollout_is_batch_normalize (a batch mean of the weights) has no "
                             "option in the fused ops")
        level = _value(rollout_correction, "rollout_is")
        if _value(rollout_correction, "bypass_mode", False):
            options.update(bypass_mode=True, **_bypass_loss(rollout_correction, level))
            level = None  # the weights, where verl applies them, are the loss type's
        # verl weighs only where both are set: a threshold set to None turns the weights off.
        if level is not None and _given(rollout_correction, "rollout_is_threshold", 2.0) is not None:
            if level not in ("token", "sequence"):
                raise ValueError(f"fused_policy_options: rollout_is must be 'token' or 'sequence', got {level!r}")
            threshold = _value(rollout_correction, "rollout_is_threshold", 2.0)
            bounds = _bounds(threshold)
            if bounds is None:
                options.update(rollout_correction=f"{level}_truncate", rollout_cap=float(threshold))
            else:
                options.update(rollout_correction=f"{level}_mask", rollout_mask_bounds=bounds)
        rules = _value(rollout_correction, "rollout_rs")
        if rules is not None:
            threshold = _value(rollout_correction, "rollout_rs_threshold")
            options.update(rollout_rs=rules, rollout_rs_threshold=None if threshold is None else str(threshold))
    if loss_agg_mode == "token-sum":
        options["divisor"] = 1.0
    elif loss_agg_mode is not None:
        if loss_agg_mode not in aggregation.VERL_LOSS_AGG_MODES:
            raise ValueError(f"fused_policy_options: loss_agg_mode must be one of "
                             f"{sorted(aggregation.VERL_LOSS_AGG_MODES) + ['token-sum']}, got {loss_agg_mode!r}")
        options["aggregation"] = aggregation.VERL_LOSS_AGG_MODES[loss_agg_mode]
    return options
