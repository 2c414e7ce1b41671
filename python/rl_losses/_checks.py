"""The argument checks of the C++ ops (csrc/common/checks.cpp and each op's forward), for the fake kernels.

The fake (meta) kernels in ``_fake.py`` run these before they describe their outputs, so that meta tensors and
torch.compile's fake tensors are refused exactly where the real kernels refuse them, with the same message:
dtypes, shapes, devices and options, in the C++ order. Checks that need the data (label ids against the
vocabulary, max(document_index) + 1) stay with the real kernels. They are Python because a fake kernel sees
symbolic shapes and must create the data-dependent size of GSPO's per-document outputs, which C++ meta kernels
cannot; tests/test_safety.py feeds the same bad inputs to both and compares the messages.
"""
from __future__ import annotations

import math

import torch

# c10's names of the dtypes, as its messages print them.
_DTYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}

# csrc/common/checks.h: kMaxDocuments.
MAX_DOCUMENTS = 1 << 31


def _dt(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _num(x: float) -> str:
    # A double as a C++ ostream prints it (6 significant digits).
    return f"{x:g}"


def _shape(sizes) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def _check(cond, op: str, *parts) -> None:
    if not cond:
        raise RuntimeError(f"{op}: " + "".join(str(p) for p in parts))


def _integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- checks.cpp ------------------------------------------------------------------------------------------------
def check_target(op, target, inp, input_name):
    _check(_integral(target.dtype), op, "target must be an integer tensor of label ids (int32 or int64), got ",
           _dt(target.dtype))
    _check(target.dtype in (torch.int32, torch.int64), op, "target must be int32 or int64, got ", _dt(target.dtype))
    _check(target.device == inp.device, op, "target is on ", target.device, " but ", input_name, " is on ",
           inp.device)
    batch = list(inp.shape[:-1])
    _check(list(target.shape) == batch, op, "target has shape ", _shape(target.shape), " but ", input_name,
           " has batch shape ", _shape(batch), " (", input_name, " shape ", _shape(inp.shape), ")")


def check_and_flatten(op, logits, target, vocab_start, vocab_size):
    """check_and_flatten: returns the (N, V) row view of the logits, or None where their batch dims need a copy."""
    _check(logits.dtype.is_floating_point, op,
           "logits must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", _dt(logits.dtype))
    _check(logits.dim() >= 1, op, "logits must have at least 1 dimension (…, vocab), got a 0-dim tensor")
    _check(logits.shape[-1] <= 1 or logits.stride(-1) == 1, op,
           "logits must have a unit stride in the vocabulary (last) dimension, got stride ", logits.stride(-1))
    check_target(op, target, logits, "logits")
    v = logits.shape[-1]
    _check(v >= 1 or target.numel() == 0, op, "logits has an empty vocabulary dimension (shape ",
           _shape(logits.shape), ")")
    _check(vocab_start >= 0, op, "vocab_start must be >= 0, got ", vocab_start)
    total = vocab_start + v if vocab_size < 0 else vocab_size
    _check(total >= vocab_start + v, op, "vocab_size ", vocab_size, " is smaller than vocab_start + the logits' ",
           "vocabulary shard (", vocab_start, " + ", v, ")")
    try:
        return logits.view(target.numel(), v)
    except RuntimeError:
        return None


def check_inplace(op, logits, rows):
    """LogitsSource with inplace_backward: `rows` is check_and_flatten's view."""
    _check(rows is not None, op, "inplace_backward needs logits whose batch dimensions flatten to one row ",
           "stride (got shape ", _shape(logits.shape), ", strides ", _shape(logits.stride()), ")")
    n, v = rows.shape
    stride = rows.stride(0)
    _check(n <= 1 or v == 0 or stride >= v, op, "inplace_backward needs logits whose rows do not overlap in memory, ",
           "got shape ", _shape(logits.shape), " with strides ", _shape(logits.stride()), " (rows ", stride,
           " elements apart, ", v, " long); pass a tensor that owns its rows, e.g. logits.contiguous()")


def check_per_token(op, name, t, target):
    _check(t.dtype.is_floating_point, op, name, " must be a floating-point tensor, got ", _dt(t.dtype))
    _check(t.device == target.device, op, name, " is on ", t.device, " but logits is on ", target.device)
    _check(list(t.shape) == list(target.shape), op, name, " has shape ", _shape(t.shape), " but target has shape ",
           _shape(target.shape))


def check_per_token_int(op, name, t, target):
    _check(_integral(t.dtype), op, name, " must be an integer tensor, got ", _dt(t.dtype))
    _check(t.device == target.device, op, name, " is on ", t.device, " but logits is on ", target.device)
    _check(list(t.shape) == list(target.shape), op, name, " has shape ", _shape(t.shape), " but target has shape ",
           _shape(target.shape))


def check_label_counts(op, t, target):
    _check(t.device == target.device and list(t.shape) == list(target.shape), op,
           "label_counts must have the target's shape ", _shape(target.shape), " and device ", target.device,
           ", got ", _shape(t.shape), " on ", t.device)


def check_scale(op, s):
    _check(math.isfinite(s) and s > 0, op, "logits_scale_factor must be finite and > 0, got ", _num(s))


def check_divisor(op, divisor):
    _check(divisor is None or (math.isfinite(divisor) and divisor > 0), op, "divisor must be finite and > 0, got ",
           _num(divisor if divisor is not None else 0.0))


def check_epsilons(op, epsilon_low, epsilon_high):
    _check(math.isfinite(epsilon_low) and 0 <= epsilon_low < 1, op, "epsilon_low must be in [0, 1), got ",
           _num(epsilon_low))
    _check(math.isfinite(epsilon_high) and epsilon_high >= 0, op, "epsilon_high must be finite and >= 0, got ",
           _num(epsilon_high))


def check_num_documents(op, n):
    _check(0 <= n <= MAX_DOCUMENTS, op, "num_documents must be in [0, ", MAX_DOCUMENTS, "], got ", n)


def check_row_stats(op, row_stats, logits, n_rows):
    if row_stats is None:
        return
    s = row_stats
    _check(s.dim() == 2 and s.shape[0] == n_rows and s.shape[1] == 5, op, "row_stats must have shape (", n_rows,
           ", 5), got ", _shape(s.shape))
    _check(s.dtype == acc_dtype(logits.dtype), op, "row_stats must be float32 (float64 for float64 logits), got ",
           _dt(s.dtype))
    _check(s.device == logits.device, op, "row_stats is on ", s.device, " but logits is on ", logits.device)
    _check(s.is_contiguous(), op, "row_stats must be contiguous")


# ---- the ops' own option checks (cross_entropy.cpp, grpo.cpp, gspo.cpp) -------------------------------------------
def cross_entropy_options(op, logits, n_rows, s, eps, z, lw, reduction, divisor, row_stats):
    check_scale(op, s)
    _check(math.isfinite(eps) and 0 <= eps < 1, op, "label_smoothing must be in [0, 1), got ", _num(eps))
    _check(math.isfinite(z) and z >= 0, op, "z_loss_factor must be >= 0, got ", _num(z))
    _check(math.isfinite(lw) and lw >= 0, op, "label_weight must be finite and >= 0, got ", _num(lw))
    _check(reduction in ("mean", "sum", "none"), op, "reduction must be 'mean', 'sum' or 'none', got '", reduction,
           "'")
    check_divisor(op, divisor)
    check_row_stats(op, row_stats, logits, n_rows)
    _check(reduction != "none" or divisor is None, op, "divisor has no meaning with reduction='none'")


POLICY_DEFAULTS = dict(loss_type="ppo_clip", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, rollout_log_probs=None,
                       rollout_correction=None, rollout_cap=3.0, rollout_mask_bounds=None, kl_estimator="k3",
                       kl_importance_weighted=False, entropy_coefficient=0.0, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                       vespo_k_neg=3.0, vespo_lambda_neg=2.0)
POLICY_LOSS_TYPES = ("ppo_clip", "cispo", "sapo", "vespo")
_ROLLOUT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def policy_options(op, target, epsilon_high, delta, loss_type, sapo_temperature_pos, sapo_temperature_neg,
                   rollout_log_probs, rollout_correction, rollout_cap, rollout_mask_bounds, kl_estimator,
                   kl_importance_weighted, entropy_coefficient, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                   vespo_k_neg=3.0, vespo_lambda_neg=2.0):
    # csrc/common/policy.cpp: make_policy_options, in the same order with the same messages.
    _check(loss_type in POLICY_LOSS_TYPES, op, "loss_type must be 'ppo_clip', 'cispo', 'sapo' or 'vespo', got '",
           loss_type, "' (TRL's grpo, bnpo, dr_grpo, dapo and luspo are ppo_clip with an aggregation preset: "
           "rl_losses.aggregation.TRL_LOSS_TYPES)")
    _check(loss_type == "ppo_clip" or delta is None, op, "delta (the two-sided clip) applies to loss_type "
           "'ppo_clip' only, got loss_type '", loss_type, "' with delta = ", _num(delta if delta is not None else 0.0))
    _check(loss_type != "cispo" or epsilon_high > 0, op, "loss_type 'cispo' caps the ratio at epsilon_high, which "
           "must be > 0, got ", _num(epsilon_high))
    for name, tau in (("sapo_temperature_pos", sapo_temperature_pos), ("sapo_temperature_neg", sapo_temperature_neg)):
        _check(math.isfinite(tau) and tau > 0, op, name, " must be a finite value > 0, got ", _num(tau))
    for name, k in (("vespo_k_pos", vespo_k_pos), ("vespo_k_neg", vespo_k_neg)):
        _check(math.isfinite(k), op, name, " must be finite, got ", _num(k))
    for name, lam in (("vespo_lambda_pos", vespo_lambda_pos), ("vespo_lambda_neg", vespo_lambda_neg)):
        _check(math.isfinite(lam) and lam >= 0, op, name, " must be a finite value >= 0 (TRL raises it to 1e-4), got ",
               _num(lam))
    _check(kl_estimator in ("k1", "k2", "k3"), op, "kl_estimator must be 'k1', 'k2' or 'k3', got '", kl_estimator, "'")
    has_rollout = rollout_log_probs is not None
    if rollout_correction is not None:
        m = rollout_correction
        _check(m in _ROLLOUT_MODES, op, "rollout_correction must be None, 'token_truncate', 'token_mask', "
               "'sequence_truncate' or 'sequence_mask', got '", m, "'")
        _check(has_rollout, op, "rollout_correction = '", m, "' needs rollout_log_probs")
        if "truncate" in m or rollout_mask_bounds is None:
            _check(math.isfinite(rollout_cap) and rollout_cap > 0, op, "rollout_cap must be a finite value > 0, got ",
                   _num(rollout_cap))
        if "truncate" in m:
            _check(rollout_mask_bounds is None, op, "rollout_mask_bounds apply to the '*_mask' modes, got "
                   "rollout_correction = '", m, "'")
        elif rollout_mask_bounds is not None:
            b = list(rollout_mask_bounds)
            _check(len(b) == 2, op, "rollout_mask_bounds must be (lo, hi), got ", len(b), " values")
            _check(not math.isnan(b[0]) and not math.isnan(b[1]) and b[0] < b[1], op,
                   "rollout_mask_bounds must satisfy lo < hi, got (", _num(b[0]), ", ", _num(b[1]), ")")
    else:
        _check(not has_rollout, op, "rollout_log_probs given without rollout_correction (one of 'token_truncate', "
               "'token_mask', 'sequence_truncate', 'sequence_mask')")
        _check(rollout_mask_bounds is None, op, "rollout_mask_bounds given without a '*_mask' rollout_correction")
    _check(math.isfinite(entropy_coefficient), op, "entropy_coefficient must be finite, got ", _num(entropy_coefficient))
    if has_rollout:
        check_per_token(op, "rollout_log_probs", rollout_log_probs, target)


def per_sequence(t, target):
    """A (B,) per-sequence tensor for (B, T) labels, seen per token (csrc/common/policy.cpp: broadcast_per_sequence)."""
    if 1 <= t.dim() < target.dim() and list(t.shape) == list(target.shape[:t.dim()]):
        return t.reshape(list(t.shape) + [1] * (target.dim() - t.dim())).expand(target.shape)
    return t


def check_delta(op, epsilon_high, delta):
    """The two-sided clip `delta` of ppo_clip (common/checks.cpp: check_delta)."""
    _check(delta is None or math.isfinite(delta), op, "delta must be finite (leave it unset for no cap), got ",
           _num(delta if delta is not None else 0.0))
    _check(delta is None or delta > 0, op, "delta must be > 0 (it caps the ratio r = exp(lp - old) > 0; the usual "
           "two-sided clip takes delta > 1 + epsilon_high = ", _num(1 + epsilon_high), "), got ",
           _num(delta if delta is not None else 0.0))


def check_beta(op, beta, ref_log_probs):
    """The KL weight beta: finite, >= 0, and with ref_log_probs wherever it is > 0."""
    _check(math.isfinite(beta) and beta >= 0, op, "beta must be >= 0, got ", _num(beta))
    _check(beta == 0 or ref_log_probs is not None, op, "beta = ", _num(beta), " > 0 needs ref_log_probs")


def _check_delta_beta(op, epsilon_high, delta, beta, ref_log_probs):
    """The two-sided clip `delta` and the KL weight `beta` (grpo and policy_token_loss check them alike)."""
    check_delta(op, epsilon_high, delta)
    check_beta(op, beta, ref_log_probs)


def sequence_count(op, document_index, num_documents):
    # grpo's num_documents (the sequence-level options' count of document ids); the ids' range is the data's.
    _check(num_documents is None or document_index is not None, op, "num_documents = ", num_documents,
           " counts the ids of document_index, which is not given")
    if num_documents is not None:
        check_num_documents(op, num_documents)


def grpo_options(op, logits, target, n_rows, advantages, old_log_probs, ref_log_probs, loss_weights, label_counts,
                 epsilon_low, epsilon_high, delta, beta, divisor, s, row_stats):
    check_scale(op, s)
    check_epsilons(op, epsilon_low, epsilon_high)
    _check_delta_beta(op, epsilon_high, delta, beta, ref_log_probs)
    check_divisor(op, divisor)
    check_row_stats(op, row_stats, logits, n_rows)
    check_per_token(op, "advantages", per_sequence(advantages, target), target)
    if old_log_probs is not None:  # None: on-policy
        check_per_token(op, "old_log_probs", old_log_probs, target)
    if beta != 0:
        check_per_token(op, "ref_log_probs", ref_log_probs, target)
    if loss_weights is not None:
        check_per_token(op, "loss_weights", loss_weights, target)
    if label_counts is not None:
        check_label_counts(op, label_counts, target)


def gspo_options(op, logits, target, n_rows, advantages, old_log_probs, document_index, num_documents, label_counts,
                 epsilon_low, epsilon_high, delta, weighting, divisor, s, row_stats, document_sums):
    check_scale(op, s)
    check_epsilons(op, epsilon_low, epsilon_high)
    check_delta(op, epsilon_high, delta)
    check_divisor(op, divisor)
    check_row_stats(op, row_stats, logits, n_rows)
    _check(weighting in ("document", "token"), op, "weighting must be 'document' or 'token', got '", weighting, "'")
    if not (advantages.dim() == 1 and target.dim() == 1 and advantages.shape != target.shape):  # else per document
        check_per_token(op, "advantages", per_sequence(advantages, target), target)
    if old_log_probs is not None:  # None: on-policy
        check_per_token(op, "old_log_probs", old_log_probs, target)
    check_per_token_int(op, "document_index", document_index, target)
    if label_counts is not None:
        check_label_counts(op, label_counts, target)
    if num_documents is not None:
        n_docs = num_documents
    elif document_sums is not None:
        n_docs = document_sums.shape[0]
    else:
        return  # max(document_index) + 1: the data's, checked by the real kernel
    check_num_documents(op, n_docs)


# gspo/gspo.h: kGspoSums, kGspoBasicSums.
GSPO_SUMS, GSPO_BASIC_SUMS = 6, 3


def gspo_document_sums_shape(op, logits, document_sums, num_documents, basic):
    # gspo.cpp: (S, 6), or (S, 3) where the policy family's columns are unused (`basic`).
    if document_sums is None:
        return
    n_docs = num_documents if num_documents is not None else document_sums.shape[0]
    acc = acc_dtype(logits.dtype)
    d = document_sums
    cols = d.shape[1] if d.dim() == 2 else -1
    _check(d.dim() == 2 and d.shape[0] == n_docs and (cols == GSPO_SUMS or (basic and cols == GSPO_BASIC_SUMS))
           and d.dtype == acc and d.device == logits.device, op, "document_sums must be (", n_docs, ", ", GSPO_SUMS,
           ") ", _dt(acc), " on ", logits.device, " (or with its first 3 columns only)" if basic else "", ", got ",
           _shape(d.shape), " ", _dt(d.dtype), " on ", d.device)


def gspo_document_sums(log_probs, target, advantages, old_log_probs, document_index, label_counts, num_documents,
                       weighting="document", beta=0.0, policy=None):
    op = "gspo_document_sums"
    check_num_documents(op, num_documents)
    _check(weighting in ("document", "token"), op, "weighting must be 'document' or 'token', got '", weighting, "'")
    _check(math.isfinite(beta) and beta >= 0, op, "beta must be >= 0, got ", _num(beta))
    values = {**POLICY_DEFAULTS, **(policy or {})}
    policy_options(op, target, 0.2, None, *(values[k] for k in POLICY_DEFAULTS))
    check_per_token(op, "log_probs", log_probs, target)
    check_per_token_int(op, "target", target, target)
    if not (advantages.dim() == 1 and target.dim() == 1 and advantages.shape != target.shape):  # else per document
        check_per_token(op, "advantages", per_sequence(advantages, target), target)
    if old_log_probs is not None:  # None: on-policy
        check_per_token(op, "old_log_probs", old_log_probs, target)
    check_per_token_int(op, "document_index", document_index, target)
    check_label_counts(op, label_counts, target)


# ---- linear/linear_source.cpp --------------------------------------------------------------------------------------
LINEAR_STRATEGIES = ("fast", "lean")  # the linear ops' modes (csrc/linear/linear_source.cpp)


def check_linear(op, hidden, weight, bias, target, chunk_size, strategy="fast", weight_main_grad=None):
    # csrc/linear/linear_source.cpp: flatten_linear, then check_linear_options.
    _check(hidden.dtype.is_floating_point, op,
           "hidden must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", _dt(hidden.dtype))
    _check(hidden.dim() >= 1, op, "hidden must have at least 1 dimension (..., hidden_size), got a 0-dim tensor")
    _check(weight.dim() == 2, op, "weight must be a 2-D (vocab_size, hidden_size) tensor, got ", _shape(weight.shape))
    _check(weight.shape[1] == hidden.shape[-1], op, "weight has hidden size ", weight.shape[1], " but hidden has ",
           hidden.shape[-1], " (weight shape ", _shape(weight.shape), ", hidden shape ", _shape(hidden.shape), ")")
    _check(weight.dtype == hidden.dtype, op, "weight is ", _dt(weight.dtype), " but hidden is ", _dt(hidden.dtype))
    _check(weight.device == hidden.device, op, "weight is on ", weight.device, " but hidden is on ", hidden.device)
    _check(weight.shape[0] >= 1, op, "weight has an empty vocabulary dimension (shape ", _shape(weight.shape), ")")
    if bias is not None:
        _check(bias.dim() == 1 and bias.shape[0] == weight.shape[0], op, "bias must have shape (", weight.shape[0],
               ",), got ", _shape(bias.shape))
        _check(bias.dtype == hidden.dtype and bias.device == hidden.device, op, "bias must be ", _dt(hidden.dtype),
               " on ", hidden.device, ", got ", _dt(bias.dtype), " on ", bias.device)
    check_target(op, target, hidden, "hidden")
    _check(chunk_size is None or chunk_size >= 1, op, "chunk_size must be >= 1, got ",
           chunk_size if chunk_size is not None else 0)
    _check(strategy in LINEAR_STRATEGIES, op, "strategy must be 'fast' or 'lean', got '", strategy, "'")
    if weight_main_grad is not None:
        g, acc = weight_main_grad, acc_dtype(weight.dtype)
        _check(g.dtype == acc, op, "weight_main_grad must be ", _dt(acc), " (the accumulation dtype of a ",
               _dt(weight.dtype), " weight), got ", _dt(g.dtype))
        _check(g.shape == weight.shape, op, "weight_main_grad must have the weight's shape ", _shape(weight.shape),
               ", got ", _shape(g.shape))
        _check(g.device == weight.device, op, "weight_main_grad is on ", g.device, " but weight is on ",
               weight.device)
        _check(g.is_contiguous(), op, "weight_main_grad must be contiguous, got strides ", _shape(g.stride()))


def policy_token_options(log_probs, old_log_probs, advantages, epsilon_low, epsilon_high, delta, ref_log_probs, beta,
                         loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_log_probs, rollout_correction,
                         rollout_cap, rollout_mask_bounds, kl_estimator, kl_importance_weighted, loss_mask):
    # csrc/policy_token/policy_token.cpp: policy_token_loss, in the same order with the same messages.
    op = "policy_token_loss"
    _check(log_probs.dtype.is_floating_point, op, "log_probs must be a floating-point tensor, got ",
           _dt(log_probs.dtype))
    check_epsilons(op, epsilon_low, epsilon_high)
    _check_delta_beta(op, epsilon_high, delta, beta, ref_log_probs)
    _check(loss_type in ("ppo_clip", "cispo", "sapo"), op, "loss_type must be 'ppo_clip', 'cispo' or 'sapo' "
           "(sequence-level loss types are the fused ops'), got '", loss_type, "'")
    _check(rollout_correction is None or not rollout_correction.startswith("sequence_"), op,
           "rollout_correction must be None, 'token_truncate' or 'token_mask' (the sequence-level modes are the "
           "fused ops'), got '", rollout_correction, "'")
    policy_options(op, log_probs, epsilon_high, delta, loss_type, sapo_temperature_pos, sapo_temperature_neg,
                   rollout_log_probs, rollout_correction, rollout_cap, rollout_mask_bounds, kl_estimator,
                   kl_importance_weighted, 0.0)
    if old_log_probs is not None:
        check_per_token(op, "old_log_probs", old_log_probs, log_probs)
    check_per_token(op, "advantages", per_sequence(advantages, log_probs), log_probs)
    if ref_log_probs is not None:
        check_per_token(op, "ref_log_probs", ref_log_probs, log_probs)
    if loss_mask is not None:
        _check(loss_mask.dtype == torch.bool or _integral(loss_mask.dtype), op,
               "loss_mask must be a bool or integer tensor, got ", _dt(loss_mask.dtype))
        _check(loss_mask.device == log_probs.device, op, "loss_mask is on ", loss_mask.device, " but log_probs is on ",
               log_probs.device)
        _check(list(loss_mask.shape) == list(log_probs.shape), op, "loss_mask has shape ", _shape(loss_mask.shape),
               " but log_probs has shape ", _shape(log_probs.shape))
