"""verl's rollout correction as the fused policy ops' options (docs/policy_losses.md: verl's rollout rejection).

``fused_policy_options(config.algorithm.rollout_correction, config.actor_rollout_ref.actor.loss_agg_mode)`` gives
the keyword options of ``rl_losses.grpo_loss`` / ``linear_grpo_loss`` (and, without ``aggregation``, gspo's) that
apply verl's importance weights (``rollout_is``, ``rollout_is_threshold``) and rejection (``rollout_rs``,
``rollout_rs_threshold``) inside the op, from the old and rollout log-probs the caller passes
(``old_log_probs``, ``rollout_log_probs``), with verl's loss aggregation counted over the kept tokens.
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


def fused_policy_options(rollout_correction, loss_agg_mode: str | None = None) -> dict:
    """The ops' options of verl's ``algorithm.rollout_correction`` (a RolloutCorrectionConfig or a dict; None: no
    options) and, when given, of its ``actor.loss_agg_mode`` (``aggregation``, or ``divisor=1.0`` for token-sum).

    rollout_is "token" / "sequence" become rollout_correction "token_*" / "sequence_*": "*_truncate" with
    rollout_cap = the threshold (TIS), "*_mask" with rollout_mask_bounds = (lower, upper) for a "lower_upper"
    threshold (IcePop); rollout_rs and rollout_rs_threshold pass as verl's specification. Refused: bypass_mode
    (its rejection judges the current log-probs: rl_losses_bypass_mode in verl's registry) and
    rollout_is_batch_normalize (a batch mean of the weights)."""
    options: dict = {}
    if rollout_correction is not None:
        if _value(rollout_correction, "bypass_mode", False):
            raise ValueError("fused_policy_options: verl's bypass_mode judges the current log-probs against the "
                             "rollout's, which the fused ops do not: use rl_losses_bypass_mode (verl's policy-loss "
                             "registry)")
        if _value(rollout_correction, "rollout_is_batch_normalize", False):
            raise ValueError("fused_policy_options: rollout_is_batch_normalize (a batch mean of the weights) has no "
                             "option in the fused ops")
        level = _value(rollout_correction, "rollout_is")
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
