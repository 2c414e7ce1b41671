"""The fake kernels' checks of verl's rollout rejection (``rollout_rs``, ``rollout_rs_threshold``) and of GRPO's
``aggregation`` (csrc/common/policy_rejection.cpp, csrc/grpo/grpo.cpp): the same conditions in the same order, with
the same messages."""
from __future__ import annotations

import math

from rl_losses._messages import _check, _num
from rl_losses.aggregation import PRESETS as AGGREGATIONS  # the presets grpo computes itself

# verl's SUPPORTED_ROLLOUT_RS_OPTIONS, in the op's order.
ROLLOUT_RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                    "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


_DECIMAL = frozenset("0123456789.eE+-")


def _parts(s: str) -> list[str]:
    return [p.strip() for p in s.split(",") if p.strip()]


def _number(op, text, spec, mode):
    # policy_rejection.cpp's number(): a decimal number or "inf", all of it (not Python's wider float() grammar).
    try:
        v = float(text) if (text and set(text) <= _DECIMAL) or text in ("inf", "+inf") else math.nan
    except ValueError:
        v = math.nan
    _check(not math.isnan(v), op, "rollout_rs_threshold '", spec, "' for rollout_rs mode '", mode,
           "' is not a number")
    return v


def rollout_rejection_modes(op, a, bypass_mode: bool = False) -> list[str]:
    """rollout_rejection_rules: the distinct modes of rollout_rs ([] without it), their thresholds checked
    (`bypass_mode`: the rules judge the current log-probs, no old_log_probs needed)."""
    given, threshold = a["rollout_rs"], a["rollout_rs_threshold"]
    if given is None:
        _check(threshold is None, op, "rollout_rs_threshold = '", threshold, "' given without rollout_rs")
        return []
    modes = []
    for m in _parts(given):
        _check(m in ROLLOUT_RS_MODES, op, "rollout_rs mode '", m, "' is not one of token_k1/k2/k3, seq_sum_k1/k2/k3, "
               "seq_mean_k1/k2/k3, seq_max_k2/k3 (verl's), got rollout_rs = '", given, "'")
        if m not in modes:
            modes.append(m)
    _check(modes, op, "rollout_rs must name at least one mode, got '", given, "'")
    _check(threshold is not None, op, "rollout_rs = '", given, "' needs rollout_rs_threshold (verl's specification: "
           "one per mode or one for all, 'lo_hi' or 'hi' for the k1 modes)")
    _check(a["rollout_log_probs"] is not None, op, "rollout_rs = '", given, "' needs rollout_log_probs")
    _check(a["old_log_probs"] is not None or bypass_mode, op, "rollout_rs = '", given, "' needs old_log_probs (it "
           "judges old against rollout), or bypass_mode = True (verl's: it judges the current log-probs against "
           "rollout)")
    specs = _parts(threshold)
    _check(len(specs) in (1, len(modes)), op, "rollout_rs_threshold = '", threshold, "' must hold one threshold for "
           "all modes or one per mode (", len(modes), " in rollout_rs = '", given, "')")
    for m, spec in zip(modes, specs * len(modes) if len(specs) == 1 else specs):
        if m.endswith("k1"):
            lo_text, sep, hi_text = spec.partition("_")
            hi = _number(op, hi_text if sep else spec, spec, m)
            # (C++'s 1 / 0.0 is inf)
            lo = _number(op, lo_text, spec, m) if sep else (1.0 / hi if hi else math.copysign(math.inf, hi))
            _check(lo > 0 and hi > 0, op, "rollout_rs_threshold '", spec, "' for mode '", m, "' must be positive ratio "
                   "bounds, got lower ", _num(lo), " and upper ", _num(hi))
            _check(lo <= hi, op, "rollout_rs_threshold '", spec, "' for mode '", m, "' must be ordered, lower <= upper, "
                   "got lower ", _num(lo), " and upper ", _num(hi))
        else:
            _check("_" not in spec, op, "rollout_rs_threshold '", spec, "' for mode '", m, "' takes one upper bound "
                   "(no '_': lower and upper bounds are for the k1 modes)")
            hi = _number(op, spec, spec, m)
            _check(hi > 0, op, "rollout_rs_threshold '", spec, "' for mode '", m, "' must be positive, got ", _num(hi))
    return modes


def grpo_sequence_options(op, a, sequence_rollout: bool, vespo: bool) -> bool:
    """grpo_forward's checks of rollout_rs, aggregation and document_index; returns whether the call needs the
    sequences (sequence_ids)."""
    modes = rollout_rejection_modes(op, a, a["bypass_mode"])
    _check(not modes or not vespo, op, "rollout_rs does not apply to loss_type 'vespo' (its sequence weight would "
           "count the rejected tokens), got rollout_rs = '", a["rollout_rs"] or "", "'")
    aggregation = a["aggregation"]
    if aggregation is not None:
        _check(aggregation in AGGREGATIONS, op, "aggregation must be None, 'token_mean', 'sequence_mean_token_mean', "
               "'sequence_sum_constant' or 'luspo', got '", aggregation, "'")
    _check(aggregation != "sequence_sum_constant" or a["divisor"] is not None or a["document_index"] is None, op,
           "aggregation 'sequence_sum_constant' over document_index needs divisor (B·max_completion_length): its "
           "constant is the row length of (B, T) labels only")
    sequence_aggregation = aggregation is not None and aggregation != "token_mean"
    recount = bool(modes) and a["label_counts"] is not None
    sequence_rule = any(not m.startswith("token_") for m in modes)
    _check(a["document_index"] is None or sequence_rollout or vespo or sequence_rule or sequence_aggregation or recount,
           op, "document_index groups the tokens of a sequence-level rollout_correction, of loss_type 'vespo', of a "
           "sequence rollout_rs mode or of a sequence aggregation; got it with rollout_correction = '",
           a["rollout_correction"] or "None", "', loss_type '", a["loss_type"], "', rollout_rs = '",
           a["rollout_rs"] or "None", "' and aggregation '", aggregation or "None", "'")
    return sequence_rollout or vespo or sequence_rule or sequence_aggregation or recount


def sequences_why(a, sequence_rollout: bool, vespo: bool) -> str:
    if vespo:
        return "loss_type 'vespo'"
    if sequence_rollout:
        return "a sequence-level rollout_correction"
    if a["rollout_rs"] is not None:
        return "rollout_rs (its sequence modes, or label_counts recounted)"
    return "a sequence aggregation"
