"""The checks of the distillation, DPO, fused-head, token_log_probs, policy_token_loss and _scatter_rows ops
(csrc/distillation, csrc/dpo, csrc/fused_head, csrc/token_log_probs, csrc/policy_token, csrc/kept_set), as
``_checks.py`` holds the others': the same conditions in the same order, the same messages, over the call's arguments
by name."""
from __future__ import annotations

import math

import torch

from rl_losses import _checks_rejection
from rl_losses._checks import (SEQUENCE_LOSS_TYPES, _geo_mean, acc_dtype, check_beta, check_clip, check_divisor,
                                check_epsilons, check_label_counts, check_loss_mask, check_num_documents,
                                check_per_token, check_per_token_int, check_row_stats, check_scale,
                                check_sequence_ratio_loss_type, check_token_ratio_loss_type, check_weighting,
                                per_sequence, policy_options, sampler, sequence_ids, sequence_level_rollout)
from rl_losses._messages import _check, _dt, _integral, _num, _shape
from rl_losses._schema import DISTILL_STATS

# ---- distillation/distillation.cpp ---------------------------------------------------------------------------------
DISTILL_KINDS = ("forward_kl", "reverse_kl", "cross_entropy", "jsd")


def _distill_rows(name, t, op="distillation"):
    """rows_of: returns whether the (N, V) rows are a view (else the op copies them)."""
    _check(t.dtype.is_floating_point, op, name,
           " must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", _dt(t.dtype))
    _check(t.dim() >= 1, op, name, " must have at least 1 dimension (…, vocab), got a 0-dim tensor")
    _check(t.shape[-1] >= 1, op, name, " has an empty vocabulary dimension (shape ", _shape(t.shape), ")")
    _check(t.stride(-1) == 1 or t.shape[-1] == 1, op, name,
           " must have a unit stride in the vocabulary (last) dimension, got stride ", t.stride(-1))
    v = t.shape[-1]
    n = t.numel() // v
    if n == 0:
        return False
    try:
        t.view(n, v)
        return True
    except (RuntimeError, ValueError):  # ValueError: fake tensors' view
        return False


def _distill_pair(logits, teacher, op="distillation"):
    _check(teacher.device == logits.device, op, "teacher_logits is on ", teacher.device, " but logits is on ",
           logits.device)
    vocab_differs = teacher.dim() == logits.dim() and teacher.dim() > 0 and teacher.shape[-1] != logits.shape[-1]
    _check(list(teacher.shape) == list(logits.shape), op, "teacher_logits has shape ", _shape(teacher.shape),
           " but logits has shape ", _shape(logits.shape), " (the vocabularies differ)" if vocab_differs else "")


def _distill_beta(beta, op="distillation", name="beta"):
    _check(math.isfinite(beta) and 0 <= beta <= 1, op, name, " must be in [0, 1], got ", _num(beta))


def _distill_softmax(temperature, s, op="distillation"):
    _check(math.isfinite(temperature) and temperature > 0, op, "temperature must be finite and > 0, got ",
           _num(temperature))
    check_scale(op, s)


def _distill_acc_input(name, t, n, cols, logits):
    op = "distillation"
    acc = acc_dtype(logits.dtype)
    _check(t.numel() == n * cols and t.dim() >= 1 and t.shape[-1] == cols, op, name, " must hold (", n, ", ", cols,
           ") values, got shape ", _shape(t.shape))
    _check(t.dtype == acc, op, name, " must be ", _dt(acc), " (the accumulation dtype of ", _dt(logits.dtype),
           " logits), got ", _dt(t.dtype))
    _check(t.device == logits.device, op, name, " is on ", t.device, " but logits is on ", logits.device)


def distillation(a, inplace=False):
    """distillation_forward, in its order."""
    op = "distillation"
    logits, teacher_logits, kind, beta = a["logits"], a["teacher_logits"], a["kind"], a["beta"]
    loss_mask, row_stats, jsd_sums = a["loss_mask"], a["row_stats"], a["jsd_sums"]
    is_view = _distill_term(op, logits, teacher_logits, kind, beta, a["temperature"], a["logits_scale_factor"],
                            loss_mask, a["divisor"], "beta", "loss_mask")
    n = logits.numel() // logits.shape[-1]
    if row_stats is not None:
        _distill_acc_input("row_stats", row_stats, n, len(DISTILL_STATS), logits)
    if kind == "jsd" and 0 < beta < 1 and jsd_sums is not None:  # β = 0 or 1 is a KL, which reads no sums
        _check(row_stats is not None, op, "jsd_sums needs row_stats (both come from the tensor-parallel all-reduce)")
        _distill_acc_input("jsd_sums", jsd_sums, n, 2, logits)
    if inplace:
        _check(is_view, op, "inplace_backward needs logits whose batch dimensions flatten to one row stride (got "
               "shape ", _shape(logits.shape), ", strides ", _shape(logits.stride()), ")")


def _distill_term(op, logits, teacher_logits, kind, beta, temperature, s, mask, divisor, beta_name, mask_name):
    """distillation.cpp: distill_term_state, in its order; returns whether the logits' rows are a view."""
    is_view = _distill_rows("logits", logits, op)
    _distill_pair(logits, teacher_logits, op)
    _distill_rows("teacher_logits", teacher_logits, op)
    _distill_beta(beta, op, beta_name)
    _distill_softmax(temperature, s, op)
    check_divisor(op, divisor)
    _check(kind in DISTILL_KINDS, op, "kind must be 'forward_kl', 'reverse_kl', 'cross_entropy' or 'jsd', got '",
           kind, "'")
    if mask is not None:
        check_loss_mask(op, mask, logits, "logits", list(logits.shape[:-1]), "batch shape", mask_name)
    return is_view


def _distill_inputs(a):
    _distill_rows("logits", a["logits"])
    _distill_pair(a["logits"], a["teacher_logits"])
    _distill_rows("teacher_logits", a["teacher_logits"])


def distillation_stats(a):
    _distill_inputs(a)
    _distill_softmax(a["temperature"], a["logits_scale_factor"])


def distillation_jsd_sums(a):
    _distill_inputs(a)
    beta, logits = a["beta"], a["logits"]
    _distill_beta(beta)
    _distill_softmax(a["temperature"], a["logits_scale_factor"])
    _check(0 < beta < 1, "distillation", "the JSD sums need 0 < beta < 1, got ", _num(beta))
    _distill_acc_input("row_stats", a["row_stats"], logits.numel() // logits.shape[-1], len(DISTILL_STATS), logits)


# ---- dpo/dpo.cpp ---------------------------------------------------------------------------------------------------
def _dpo_per_pair(name, t, n_pairs, logits):
    op = "dpo"
    _check(t.dtype.is_floating_point, op, name, " must be a floating-point tensor")
    _check(t.dim() == 1 and t.shape[0] == n_pairs, op, name, " must have shape (", n_pairs,
           ",) (one value per pair), got ", _shape(t.shape))
    _check(t.device == logits.device, op, name, " is on ", t.device, " but logits is on ", logits.device)


def dpo(a):
    """dpo_forward, in its order (after its source, _checks.source). The pairing itself (every document in exactly
    one pair) and max(document_index) are the data's, checked by the real kernel."""
    op = "dpo"
    logits, target, pairs, beta = a["logits"], a["target"], a["pairs"], a["beta"]
    check_scale(op, a["logits_scale_factor"])
    check_divisor(op, a["divisor"])
    check_row_stats(op, a["row_stats"], logits, target.numel())
    _check(math.isfinite(beta) and beta > 0, op, "beta must be finite and > 0, got ", _num(beta))
    _check(_integral(pairs.dtype), op, "pairs must be an integer tensor of (chosen, rejected) document ids, got ",
           _dt(pairs.dtype))
    _check(pairs.dim() == 2 and pairs.shape[1] == 2, op, "pairs must have shape (num_pairs, 2), got ",
           _shape(pairs.shape))
    _check(pairs.device == logits.device or pairs.device.type == "cpu", op, "pairs is on ", pairs.device,
           " but logits is on ", logits.device, " (pairs may be on the logits' device or on the CPU)")
    n_pairs = pairs.shape[0]
    _check(n_pairs > 0, op, "pairs is empty; DPO needs at least one (chosen, rejected) pair")
    _dpo_per_pair("reference_chosen_log_probs", a["reference_chosen_log_probs"], n_pairs, logits)
    _dpo_per_pair("reference_rejected_log_probs", a["reference_rejected_log_probs"], n_pairs, logits)
    check_per_token_int(op, "document_index", a["document_index"], target)
    return n_pairs


# ---- fused_head/fused_head.cpp -----------------------------------------------------------------------------------
def fused_head(a):
    """fused_head_forward, in its order (after its source, _checks.source)."""
    op = "fused_head"
    logits, target = a["logits"], a["target"]
    grpo_weight, gspo_weight = a["grpo_weight"], a["gspo_weight"]
    check_scale(op, a["logits_scale_factor"])
    distillation_weight = a["distillation_weight"]
    for name in ("label_weight", "z_loss_weight", "grpo_weight", "gspo_weight", "distillation_weight"):
        _check(math.isfinite(a[name]) and a[name] >= 0, op, name, " must be finite and >= 0, got ", _num(a[name]))
    _check(grpo_weight == 0 or gspo_weight == 0, op, "grpo_weight = ", _num(grpo_weight), " and gspo_weight = ",
           _num(gspo_weight), " are both > 0; the head fuses one policy term, GRPO or GSPO")
    _check(distillation_weight == 0 or gspo_weight == 0, op, "distillation_weight = ", _num(distillation_weight),
           " and gspo_weight = ", _num(gspo_weight), " are both > 0; the head fuses distillation with CE, z-loss "
           "and GRPO, not GSPO: use gspo_loss beside it")
    _check(distillation_weight == 0 or a["row_stats"] is None, op, "distillation_weight = ",
           _num(distillation_weight), " > 0 runs without tensor parallelism (row_stats given): use "
           "distillation_loss beside the head")
    eps = a["label_smoothing"]
    _check(math.isfinite(eps) and 0 <= eps < 1, op, "label_smoothing must be in [0, 1), got ", _num(eps))
    for name in ("label_divisor", "z_loss_divisor", "grpo_divisor", "gspo_divisor", "distillation_divisor"):
        check_divisor(op, a[name])
    check_row_stats(op, a["row_stats"], logits, target.numel())
    if grpo_weight != 0:
        check_clip(op, a)
        _head_policy_options(op, a)
        loss_type = a["loss_type"]
        check_token_ratio_loss_type(op, loss_type)
        _check(not sequence_level_rollout(a) and loss_type not in ("clip_cov", "kl_cov"), op, "the GRPO term takes "
               "the per-token options; rollout_correction '", a["rollout_correction"] or "None", "' with loss_type '",
               loss_type, "' needs a sequence's or the batch's log-probs first: use grpo_loss for 'sequence_*' "
               "corrections, 'clip_cov' and 'kl_cov'")
        _check(a["advantages"] is not None and a["old_log_probs"] is not None, op, "grpo_weight = ",
               _num(grpo_weight), " > 0 needs advantages and old_log_probs")
        check_per_token(op, "advantages", a["advantages"], target)
        check_per_token(op, "old_log_probs", a["old_log_probs"], target)
        if a["beta"] != 0:
            check_per_token(op, "ref_log_probs", a["ref_log_probs"], target)
        if a["rollout_correction"] is not None:
            check_per_token(op, "rollout_log_probs", a["rollout_log_probs"], target)
        if a["loss_weights"] is not None:
            check_per_token(op, "loss_weights", a["loss_weights"], target)
        modes = _checks_rejection.rollout_rejection_modes(op, a)
        if modes and a["rollout_correction"] is None:
            check_per_token(op, "rollout_log_probs", a["rollout_log_probs"], target)
        if any(m.startswith("seq_") for m in modes):
            sequence_ids(op, a["document_index"], a["num_documents"], target, "rollout_rs (its sequence modes)")
    if gspo_weight != 0:
        _fused_head_gspo(op, a)
    if distillation_weight != 0:  # fused_head_distill.cpp: fused_head_distill_state
        _check(a["teacher_logits"] is not None, op, "distillation_weight = ", _num(distillation_weight),
               " > 0 needs teacher_logits")
        _distill_term(op, logits, a["teacher_logits"], a["kind"], a["distillation_beta"], a["temperature"],
                      a["logits_scale_factor"], a["distillation_mask"], a["distillation_divisor"],
                      "distillation_beta", "distillation_mask")
    if a["z_loss_weight"] != 0 and a["z_loss_mask"] is not None:
        m = a["z_loss_mask"]
        _check(m.dtype == torch.bool or _integral(m.dtype), op, "z_loss_mask must be a bool or integer tensor, got ",
               _dt(m.dtype))
        _check(m.device == logits.device and list(m.shape) == list(target.shape), op,
               "z_loss_mask must have the target's shape ", _shape(target.shape), " and device ", logits.device,
               ", got ", _shape(m.shape), " on ", m.device)


def _head_policy_options(op, a):
    """fused_head.cpp: head_policy_options."""
    _check(not a["bypass_mode"], op, "bypass_mode (verl's: rollout_rs judging the current log-probs) is grpo_loss's "
           "and gspo_loss's, not the fused head's: use those ops")
    policy_options(op, a, fused=False, clip=True)
    _check(a["loss_type"] != "vespo", op, "loss_type 'vespo' weighs a sequence with vespo_k_* and vespo_lambda_*, "
           "options of grpo_loss and gspo_loss, not of the fused head: use those ops")


def _fused_head_gspo(op, a):
    """fused_head.cpp: gspo_term_state, in its order. max(document_index) is the data's, checked by the kernel."""
    target, delta = a["target"], a["delta"]
    check_epsilons(op, a["epsilon_low"], a["epsilon_high"])
    _check(delta is None, op, "delta is the GRPO term's two-sided clip; the GSPO term has none, got delta = ",
           _num(delta if delta is not None else 0.0))
    _check(a["loss_weights"] is None, op, "loss_weights weigh the GRPO term's tokens; the GSPO term weighs them by "
           "`weighting` (pass loss_weights=None)")
    check_beta(op, a["beta"], a["ref_log_probs"])
    check_weighting(op, a["weighting"])
    _head_policy_options(op, a)
    check_sequence_ratio_loss_type(op, a["loss_type"])
    _geo_mean(op, {**a, "token_advantages": False})
    modes = _checks_rejection.rollout_rejection_modes(op, a)
    _check(a["advantages"] is not None and a["document_index"] is not None, op, "gspo_weight = ",
           _num(a["gspo_weight"]), " > 0 needs advantages and document_index")
    check_per_token(op, "advantages", a["advantages"], target)
    if a["old_log_probs"] is not None:  # None: on-policy
        check_per_token(op, "old_log_probs", a["old_log_probs"], target)
    if a["rollout_correction"] is not None:  # set_policy_inputs
        check_per_token(op, "rollout_log_probs", a["rollout_log_probs"], target)
    if a["beta"] != 0:
        check_per_token(op, "ref_log_probs", a["ref_log_probs"], target)
    check_per_token_int(op, "document_index", a["document_index"], target)
    if a["label_counts"] is not None:
        check_label_counts(op, a["label_counts"], target)
    if a["num_documents"] is not None:
        check_num_documents(op, a["num_documents"])
    if modes and a["rollout_correction"] is None:  # the rejection's pre-pass
        check_per_token(op, "rollout_log_probs", a["rollout_log_probs"], target)


# ---- token_log_probs/token_log_probs.cpp -------------------------------------------------------------------------
def token_log_probs(op, a, x):
    check_scale(op, a["logits_scale_factor"])
    check_row_stats(op, a.get("row_stats"), x, a["target"].numel())
    sampler(op, a, x)


def token_log_probs_backward(op, a, x):
    target = a["target"]
    check_scale(op, a["logits_scale_factor"])
    check_row_stats(op, a["stats"], x, target.numel())
    for name in ("grad_log_probs", "grad_entropy"):
        if a[name] is not None:
            check_per_token(op, name, a[name], target)
    sampler(op, a, x)


# ---- topk_distillation/topk_distillation.cpp -------------------------------------------------------------------------
TOPK_TAILS = ("none", "renormalize", "tail")
TOPK_KINDS = ("forward_kl", "reverse_kl", "jsd")


def topk_distillation(op, a, x):
    """topk_distillation_forward, in its order (the checks of the teacher's values need the data: real op only)."""
    if "hidden" in a:
        start, total = 0, a["weight"].shape[0]
    else:
        v = a["logits"].shape[-1]
        start = a["vocab_start"]
        total = a["vocab_size"] if a["vocab_size"] >= 0 else start + v
        _check((a["row_stats"] is None) == (a["student_at_ids"] is None), op,
               "row_stats and student_at_ids are a vocabulary shard's hooks: give both or neither")
        _check((start == 0 and v == total) or a["row_stats"] is not None, op, "a vocabulary shard (vocab_start=",
               start, ", vocab_size=", total, ") needs row_stats and student_at_ids (the whole vocabulary's; "
               "rl_losses.topk_distillation_loss(..., tp_group=) makes them)")
    _check(a["tail"] in TOPK_TAILS, op, "tail must be 'none', 'renormalize' or 'tail', got '", a["tail"], "'")
    _distill_beta(a["beta"], op)
    _check(a["kind"] in TOPK_KINDS, op, "kind must be 'forward_kl', 'reverse_kl' or 'jsd', got '", a["kind"], "'")
    check_scale(op, a["logits_scale_factor"])
    check_divisor(op, a["divisor"])
    ids, lp, target = a["teacher_ids"], a["teacher_log_probs"], a["target"]
    _check(ids.dtype == torch.int64, op, "teacher_ids must be int64, got ", _dt(ids.dtype))
    _check(lp.dtype.is_floating_point, op, "teacher_log_probs must be a floating-point tensor, got ", _dt(lp.dtype))
    _check(ids.device == target.device, op, "teacher_ids is on ", ids.device, " but target is on ", target.device)
    _check(lp.device == target.device, op, "teacher_log_probs is on ", lp.device, " but target is on ",
           target.device)
    _check(ids.dim() == target.dim() + 1 and ids.shape[:target.dim()] == target.shape, op,
           "teacher_ids must have shape (batch..., K) with batch shape ", _shape(target.shape), ", got ",
           _shape(ids.shape))
    _check(lp.shape == ids.shape, op, "teacher_log_probs has shape ", _shape(lp.shape), " but teacher_ids has ",
           _shape(ids.shape))
    k = ids.shape[-1]
    _check(1 <= k <= total, op, "teacher_ids must hold 1 <= K <= vocab_size ids per row, got K = ", k,
           " with vocab_size ", total)
    if "hidden" in a:
        return
    check_row_stats(op, a["row_stats"], x, target.numel())
    at_ids = a["student_at_ids"]
    if at_ids is not None:
        _check(at_ids.shape == ids.shape, op, "student_at_ids has shape ", _shape(at_ids.shape),
               " but teacher_ids has ", _shape(ids.shape))
        _check(at_ids.dtype == acc_dtype(x.dtype), op,
               "student_at_ids must be float32 (float64 for float64 logits), got ", _dt(at_ids.dtype))
        _check(at_ids.device == x.device, op, "student_at_ids is on ", at_ids.device, " but logits is on ", x.device)


# ---- policy_token/policy_token.cpp -------------------------------------------------------------------------------
def policy_token(a):
    op = "policy_token_loss"
    log_probs = a["log_probs"]
    _check(log_probs.dtype.is_floating_point, op, "log_probs must be a floating-point tensor, got ",
           _dt(log_probs.dtype))
    check_clip(op, a)
    _check(not sequence_level_rollout(a), op, "rollout_correction must be None, 'token_truncate' or 'token_mask' (the "
           "sequence-level modes are the fused ops'), got '", a["rollout_correction"] or "", "'")
    policy_options(op, a, fused=False, clip=True)
    _check(a["loss_type"] not in SEQUENCE_LOSS_TYPES, op, "loss_type '", a["loss_type"], "' weighs a token by the "
           "rest of its sequence, which only the fused ops (grpo, gspo) read")
    if a["old_log_probs"] is not None:
        check_per_token(op, "old_log_probs", a["old_log_probs"], log_probs)
    check_per_token(op, "advantages", per_sequence(a["advantages"], log_probs), log_probs)
    for name in ("ref_log_probs", "rollout_log_probs"):
        if a[name] is not None:
            check_per_token(op, name, a[name], log_probs)
    if a["loss_mask"] is not None:
        check_loss_mask(op, a["loss_mask"], log_probs, "log_probs", log_probs.shape, "shape")


# ---- kept_set/kept_set.cpp ------------------------------------------------------------------------------------------
SCATTER_ROWS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def scatter_rows(a):
    """scatter_rows' checks but the ids' range (the data's: real op only)."""
    op, ids, values = "_scatter_rows", a["ids"], a["values"]
    _check(ids.dtype == torch.int64, op, "ids must be an int64 tensor, got ", _dt(ids.dtype))
    _check(values.dtype in SCATTER_ROWS_DTYPES, op, "values must be float32, float64, bfloat16 or float16, got ",
           _dt(values.dtype))
    _check(ids.dim() >= 1 and ids.shape == values.shape, op, "ids and values must have one shape (..., K), got ids ",
           _shape(ids.shape), " and values ", _shape(values.shape))
    _check(a["vocab_size"] >= 0, op, "vocab_size must be >= 0, got ", a["vocab_size"])
