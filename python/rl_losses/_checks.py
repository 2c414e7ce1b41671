"""The argument checks of the C++ ops (csrc/common/checks.cpp, the row sources and each op's forward), for the fake
(meta) kernels of ``_fake.py``: the same conditions in the same order, with the same messages.

Each op's check reads the call's arguments by name (``a``: rl_losses._schema.bind). Checks that need the data (label
ids against the vocabulary, max(document_index) + 1, DPO's pairing) stay with the real kernels. They are Python
because a fake kernel sees symbolic shapes and must create the data-dependent size of GSPO's per-document results,
which a C++ meta kernel cannot (docs/design.md); tests/test_fake_checks.py runs a bad input for every TORCH_CHECK
message of csrc/ on the real op, on meta tensors and under FakeTensorMode, and compares the messages.
The distillation, DPO, fused-head, token_log_probs and policy_token_loss checks are in ``_checks_heads.py``.
"""
from __future__ import annotations

import math

import torch

from rl_losses import _checks_rejection
from rl_losses._messages import _check, _dt, _integral, _num, _shape
from rl_losses._schema import GSPO_BASIC_SUMS, GSPO_SUMS, ROW_STATS

# csrc/common/checks.h: kMaxDocuments.
MAX_DOCUMENTS = 1 << 31
# The values the C++ checks accept (common/policy.cpp, common/checks.cpp).
POLICY_LOSS_TYPES = ("ppo_clip", "cispo", "sapo", "vespo", "gpg", "dro", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov",
                     "kl_cov")
SEQUENCE_LOSS_TYPES = ("vespo", "geo_mean")  # a token's loss reads its sequence: the fused ops' alone
TOKEN_LOG_PROB_LOSS_TYPES = ("gpg", "dro", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")  # not GSPO's
ROLLOUT_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
KL_ESTIMATORS = ("k1", "k2", "k3")
GSPO_WEIGHTINGS = ("document", "token")
REDUCTIONS = ("mean", "sum", "none")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- common/checks.cpp ------------------------------------------------------------------------------------------
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
    """Returns the (N, V) row view of the logits, or None where their batch dims need a copy."""
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
    except (RuntimeError, ValueError):  # ValueError: fake tensors' view
        return None


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


def check_loss_mask(op, mask, like, like_name, sizes, shape_name, mask_name="loss_mask"):
    _check(mask.dtype == torch.bool or _integral(mask.dtype), op, mask_name, " must be a bool or integer tensor, got ",
           _dt(mask.dtype))
    _check(mask.device == like.device, op, mask_name, " is on ", mask.device, " but ", like_name, " is on ",
           like.device)
    _check(list(mask.shape) == list(sizes), op, mask_name, " has shape ", _shape(mask.shape), " but ", like_name,
           " has ", shape_name, " ", _shape(sizes))


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


def check_delta(op, delta, epsilon_high):
    _check(delta is None or math.isfinite(delta), op, "delta must be finite (leave it unset for no cap), got ",
           _num(delta if delta is not None else 0.0))
    _check(delta is None or delta > 0, op, "delta must be > 0 (it caps the ratio r = exp(lp - old) > 0; the usual "
           "two-sided clip takes delta > 1 + epsilon_high = ", _num(1 + epsilon_high), "), got ",
           _num(delta if delta is not None else 0.0))


def check_beta(op, beta, ref_log_probs):
    _check(math.isfinite(beta) and beta >= 0, op, "beta must be >= 0, got ", _num(beta))
    _check(beta == 0 or ref_log_probs is not None, op, "beta = ", _num(beta), " > 0 needs ref_log_probs")


def check_weighting(op, weighting):
    _check(weighting in GSPO_WEIGHTINGS, op, "weighting must be 'document' or 'token', got '", weighting, "'")


def check_num_documents(op, n):
    _check(0 <= n <= MAX_DOCUMENTS, op, "num_documents must be in [0, ", MAX_DOCUMENTS, "], got ", n)


def check_row_stats(op, row_stats, logits, n_rows):
    if row_stats is None:
        return
    s = row_stats
    n = len(ROW_STATS)
    _check(s.dim() == 2 and s.shape[0] == n_rows and s.shape[1] == n, op, "row_stats must have shape (", n_rows,
           ", ", n, "), got ", _shape(s.shape))
    _check(s.dtype == acc_dtype(logits.dtype), op, "row_stats must be float32 (float64 for float64 logits), got ",
           _dt(s.dtype))
    _check(s.device == logits.device, op, "row_stats is on ", s.device, " but logits is on ", logits.device)
    _check(s.is_contiguous(), op, "row_stats must be contiguous")


# ---- the row sources: common/row_source.cpp (LogitsSource), linear/linear_source.cpp (LinearSource) --------------
def logits_source(op, a, inplace=False):
    """LogitsSource: the logits flattened to rows; with inplace_backward, rows that the gradient may overwrite."""
    logits = a["logits"]
    rows = check_and_flatten(op, logits, a["target"], a["vocab_start"], a["vocab_size"])
    if not inplace:
        return
    _check(rows is not None, op, "inplace_backward needs logits whose batch dimensions flatten to one row ",
           "stride (got shape ", _shape(logits.shape), ", strides ", _shape(logits.stride()), ")")
    n, v = rows.shape
    stride = rows.stride(0)
    _check(n <= 1 or v == 0 or stride >= v, op, "inplace_backward needs logits whose rows do not overlap in memory, ",
           "got shape ", _shape(logits.shape), " with strides ", _shape(logits.stride()), " (rows ", stride,
           " elements apart, ", v, " long); pass a tensor that owns its rows, e.g. logits.contiguous()")


LINEAR_STRATEGIES = ("fast", "lean")  # the linear ops' modes (csrc/linear/linear_source.cpp)
LINEAR_HEAD_DTYPES = ("weight", "float32")  # the logits' dtype (csrc/linear/linear_source.h)


def linear_source(op, a):
    hidden, weight, bias = a["hidden"], a["weight"], a["bias"]
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
    check_target(op, a["target"], hidden, "hidden")
    # check_linear_options
    chunk_size, strategy, weight_main_grad = a["chunk_size"], a["strategy"], a["weight_main_grad"]
    _check(chunk_size is None or chunk_size >= 1, op, "chunk_size must be >= 1, got ",
           chunk_size if chunk_size is not None else 0)
    _check(strategy in LINEAR_STRATEGIES, op, "strategy must be 'fast' or 'lean', got '", strategy, "'")
    _check(a["head_dtype"] in LINEAR_HEAD_DTYPES, op, "head_dtype must be 'weight' or 'float32', got '",
           a["head_dtype"], "'")
    if weight_main_grad is not None:
        g, acc = weight_main_grad, acc_dtype(weight.dtype)
        _check(g.dtype == acc, op, "weight_main_grad must be ", _dt(acc), " (the accumulation dtype of a ",
               _dt(weight.dtype), " weight), got ", _dt(g.dtype))
        _check(g.shape == weight.shape, op, "weight_main_grad must have the weight's shape ", _shape(weight.shape),
               ", got ", _shape(g.shape))
        _check(g.device == weight.device, op, "weight_main_grad is on ", g.device, " but weight is on ",
               weight.device)
        _check(g.is_contiguous(), op, "weight_main_grad must be contiguous, got strides ", _shape(g.stride()))


def linear_wants_grad(a) -> bool:
    mask = a.get("output_mask") or (False, False, False)
    return bool(mask[0] or mask[1] or (mask[2] and a["bias"] is not None))


def source(op, a, inplace=False):
    """The row source of a call: the fused lm_head's (hidden, weight) or the logits; returns the tensor whose dtype
    and device the op's results take."""
    if "hidden" in a:
        linear_source(op, a)
        return a["hidden"]
    logits_source(op, a, inplace)
    return a["logits"]


# ---- cross_entropy/cross_entropy.{h,cpp} -------------------------------------------------------------------------
def cross_entropy(op, a, x):
    if "hidden" in a:
        _check(a["reduction"] != "none" or not linear_wants_grad(a), op,
               "reduction='none' cannot be differentiated (the weight gradient is summed over tokens in the ",
               "forward); use 'sum' or 'mean', or call it without gradients")
    check_scale(op, a["logits_scale_factor"])
    eps, z, lw, reduction = a["label_smoothing"], a["z_loss_factor"], a["label_weight"], a["reduction"]
    _check(math.isfinite(eps) and 0 <= eps < 1, op, "label_smoothing must be in [0, 1), got ", _num(eps))
    _check(math.isfinite(z) and z >= 0, op, "z_loss_factor must be >= 0, got ", _num(z))
    _check(math.isfinite(lw) and lw >= 0, op, "label_weight must be finite and >= 0, got ", _num(lw))
    _check(reduction in REDUCTIONS, op, "reduction must be 'mean', 'sum' or 'none', got '", reduction, "'")
    check_divisor(op, a["divisor"])
    check_row_stats(op, a.get("row_stats"), x, a["target"].numel())
    _check(reduction != "none" or a["divisor"] is None, op, "divisor has no meaning with reduction='none'")


# ---- common/policy.{h,cpp} ---------------------------------------------------------------------------------------
def per_sequence(t, target):
    """A (B,) per-sequence tensor for (B, T) labels, seen per token (common/policy.cpp: broadcast_per_sequence)."""
    if 1 <= t.dim() < target.dim() and list(t.shape) == list(target.shape[:t.dim()]):
        return t.reshape(list(t.shape) + [1] * (target.dim() - t.dim())).expand(target.shape)
    return t


def sequence_level_rollout(a) -> bool:
    mode = a["rollout_correction"]
    return mode is not None and mode.startswith("sequence_")


def check_clip(op, a):
    check_epsilons(op, a["epsilon_low"], a["epsilon_high"])
    check_delta(op, a["delta"], a["epsilon_high"])
    check_beta(op, a["beta"], a["ref_log_probs"])


def policy_options(op, a, *, fused: bool, clip: bool, sequence_ratio: bool = False):
    """make_policy_options: `fused` the fused ops' options (entropy bonus, VESPO) are arguments, `clip` the clipped
    objective's; `sequence_ratio` (GSPO's) then check_sequence_ratio_loss_type."""
    loss_type, delta = a["loss_type"], a["delta"] if clip else None
    _check(loss_type in POLICY_LOSS_TYPES, op, "loss_type must be 'ppo_clip', 'cispo', 'sapo', 'vespo', 'gpg', 'dro', "
           "'dppo_tv', 'dppo_kl', 'geo_mean', 'clip_cov' or 'kl_cov', got '", loss_type, "' (TRL's grpo, bnpo, "
           "dr_grpo, dapo and luspo are ppo_clip with an aggregation preset: rl_losses.aggregation.TRL_LOSS_TYPES)")
    _check(loss_type == "ppo_clip" or delta is None, op, "delta (the two-sided clip) applies to loss_type "
           "'ppo_clip' only, got loss_type '", loss_type, "' with delta = ", _num(delta if delta is not None else 0.0))
    epsilon_high = a["epsilon_high"] if clip else 0.0
    _check(loss_type != "cispo" or not clip or epsilon_high > 0, op, "loss_type 'cispo' caps the ratio at "
           "epsilon_high, which must be > 0, got ", _num(epsilon_high))
    beta, c = a["dro_beta"], a["clip_ratio_c"]
    _check(loss_type != "dro" or beta is not None, op, "loss_type 'dro' needs dro_beta (verl's policy_loss.dro_beta), "
           "got None")
    if beta is not None:
        _check(loss_type == "dro", op, "dro_beta applies to loss_type 'dro' only, got loss_type '", loss_type,
               "' with dro_beta = ", _num(beta))
        _check(math.isfinite(beta) and beta > 0, op, "dro_beta must be a finite value > 0, got ", _num(beta))
    _check(math.isfinite(c) and c > 0, op, "clip_ratio_c (dppo_tv's and dppo_kl's cap of the ratio) must be a finite "
           "value > 0, got ", _num(c))
    cov_checks(op, a)
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        tau = a[name]
        _check(math.isfinite(tau) and tau > 0, op, name, " must be a finite value > 0, got ", _num(tau))
    if fused:
        for name in ("vespo_k_pos", "vespo_k_neg"):
            _check(math.isfinite(a[name]), op, name, " must be finite, got ", _num(a[name]))
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            lam = a[name]
            _check(math.isfinite(lam) and lam >= 0, op, name, " must be a finite value >= 0 (TRL raises it to 1e-4), "
                   "got ", _num(lam))
    _check(a["kl_estimator"] in KL_ESTIMATORS, op, "kl_estimator must be 'k1', 'k2' or 'k3', got '", a["kl_estimator"],
           "'")
    has_rollout = a["rollout_log_probs"] is not None
    mode, cap, bounds = a["rollout_correction"], a["rollout_cap"], a["rollout_mask_bounds"]
    bypass = fused and a["bypass_mode"]
    _check(not bypass or has_rollout, op, "bypass_mode needs rollout_log_probs (the old side of the ratio and what "
           "rollout_rs judges the current log-probs against)")
    _check(not bypass or mode is None, op, "bypass_mode takes no rollout_correction (old is the rollout, so its weight "
           "would be 1; verl's reinforce with rollout_is='token' is loss_type 'cispo'), got '", mode or "", "'")
    if mode is not None:
        _check(mode in ROLLOUT_MODES, op, "rollout_correction must be None, 'token_truncate', 'token_mask', "
               "'sequence_truncate' or 'sequence_mask', got '", mode, "'")
        _check(has_rollout, op, "rollout_correction = '", mode, "' needs rollout_log_probs")
        if "truncate" in mode:
            _check(math.isfinite(cap) and cap > 0, op, "rollout_cap must be a finite value > 0, got ", _num(cap))
            _check(bounds is None, op, "rollout_mask_bounds apply to the '*_mask' modes, got rollout_correction = '",
                   mode, "'")
        elif bounds is not None:
            b = list(bounds)
            _check(len(b) == 2, op, "rollout_mask_bounds must be (lo, hi), got ", len(b), " values")
            _check(not math.isnan(b[0]) and not math.isnan(b[1]) and b[0] < b[1], op,
                   "rollout_mask_bounds must satisfy lo < hi, got (", _num(b[0]), ", ", _num(b[1]), ")")
        else:
            _check(math.isfinite(cap) and cap > 0, op, "rollout_cap must be a finite value > 0, got ", _num(cap))
    else:
        _check(not has_rollout or a.get("rollout_rs") is not None or bypass, op, "rollout_log_probs given without "
               "rollout_correction (one of 'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'), "
               "rollout_rs or bypass_mode")
        _check(bounds is None, op, "rollout_mask_bounds given without a '*_mask' rollout_correction")
    if fused:
        e = a["entropy_coefficient"]
        _check(math.isfinite(e), op, "entropy_coefficient must be finite, got ", _num(e))
    if sequence_ratio:
        check_sequence_ratio_loss_type(op, loss_type)
    elif fused:  # grpo's (per-token ratio); policy_token_loss refuses it after this
        check_token_ratio_loss_type(op, loss_type)


def check_sequence_ratio_loss_type(op, loss_type):
    """policy.cpp: check_sequence_ratio_loss_type."""
    _check(loss_type not in TOKEN_LOG_PROB_LOSS_TYPES, op, "loss_type '", loss_type, "' weighs each token's own "
           "log-prob ratio, not a sequence's: use grpo (or policy_token_loss); gspo takes 'ppo_clip', 'cispo', "
           "'sapo', 'vespo' or 'geo_mean'")


def check_token_ratio_loss_type(op, loss_type):
    """policy.cpp: check_token_ratio_loss_type."""
    _check(loss_type != "geo_mean", op, "loss_type '", loss_type, "' takes the geometric mean of a sequence's "
           "clipped ratios: use gspo")


def cov_checks(op, a):
    ratio, lb, ub, kl_ratio, coef = (a[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                                                    "ppo_kl_coef"))
    _check(math.isfinite(ratio) and ratio > 0, op, "clip_cov_ratio (clip_cov's share of the tokens) must be a finite "
           "value > 0, got ", _num(ratio))
    _check(not math.isnan(lb) and not math.isnan(ub) and lb < ub, op, "clip_cov_lb < clip_cov_ub must hold "
           "(clip_cov's band of the covariance), got ", _num(lb), " and ", _num(ub))
    _check(0 < kl_ratio <= 1, op, "kl_cov_ratio (kl_cov's share of the tokens) must be in (0, 1], got ", _num(kl_ratio))
    _check(math.isfinite(coef), op, "ppo_kl_coef (kl_cov's penalty) must be finite, got ", _num(coef))


def sequence_ids(op, document_index, num_documents, target, why):
    """sequence_ids: the sequences of GRPO's sequence-level options; their count's range where it is known."""
    if document_index is not None:
        d = document_index
        _check(_integral(d.dtype) and list(d.shape) == list(target.shape) and d.device == target.device, op,
               "document_index must be an integer tensor shaped like target ", _shape(target.shape), " on ",
               target.device, ", got ", _dt(d.dtype), " ", _shape(d.shape), " on ", d.device)
        if num_documents is not None:
            check_num_documents(op, num_documents)
        return
    _check(target.dim() >= 2, op, why, " needs the sequences: pass document_index, or labels shaped (B, T), got "
           "labels of shape ", _shape(target.shape))


# ---- grpo/grpo.cpp ----------------------------------------------------------------------------------------------
def grpo(op, a, x):
    target = a["target"]
    check_scale(op, a["logits_scale_factor"])
    check_clip(op, a)
    check_divisor(op, a["divisor"])
    check_row_stats(op, a.get("row_stats"), x, target.numel())
    policy_options(op, a, fused=True, clip=True)
    sequence_rollout, vespo = sequence_level_rollout(a), a["loss_type"] == "vespo"
    document_index, num_documents = a["document_index"], a["num_documents"]
    needs_sequences = _checks_rejection.grpo_sequence_options(op, a, sequence_rollout, vespo)
    _check(num_documents is None or document_index is not None, op, "num_documents = ", num_documents,
           " counts the ids of document_index, which is not given")
    check_per_token(op, "advantages", per_sequence(a["advantages"], target), target)
    for name in ("old_log_probs", "ref_log_probs", "loss_weights", "rollout_log_probs"):
        if a[name] is not None:
            check_per_token(op, name, a[name], target)
    if a["label_counts"] is not None:
        check_label_counts(op, a["label_counts"], target)
    if needs_sequences:
        sequence_ids(op, document_index, num_documents, target,
                     _checks_rejection.sequences_why(a, sequence_rollout, vespo))
    sampler(op, a, x)


# ---- gspo/gspo.cpp ----------------------------------------------------------------------------------------------
def _policy_tensors(op, a, target):
    # set_policy_inputs
    for name in ("rollout_log_probs", "ref_log_probs"):
        if a[name] is not None:
            check_per_token(op, name, a[name], target)


def _geo_mean(op, a):
    if a["loss_type"] != "geo_mean":
        return
    _check(not a["token_advantages"], op, "loss_type 'geo_mean' takes its document's mean advantage, got "
           "token_advantages = True")
    _check(not a["rollout_correction"], op, "loss_type 'geo_mean' takes no rollout_correction, got '",
           a["rollout_correction"] or "", "'")


def gspo(op, a, x):
    """gspo_forward; returns the number of documents where the arguments give it (None: the data's)."""
    target = a["target"]
    check_scale(op, a["logits_scale_factor"])
    check_clip(op, a)
    check_divisor(op, a["divisor"])
    check_row_stats(op, a.get("row_stats"), x, target.numel())
    check_weighting(op, a["weighting"])
    policy_options(op, a, fused=True, clip=True, sequence_ratio=True)
    _geo_mean(op, a)
    _check(not _checks_rejection.rollout_rejection_modes(op, a, a["bypass_mode"]) or a.get("document_sums") is None,
           op, "rollout_rs with document_sums (sequences split over ranks) is not fused: each rank's sums would need "
           "the whole sequence's rejection")
    document_index = a["document_index"]
    check_per_token_int(op, "document_index", document_index, target)
    if a["old_log_probs"] is not None:
        check_per_token(op, "old_log_probs", a["old_log_probs"], target)
    if a["label_counts"] is not None:
        check_label_counts(op, a["label_counts"], target)
    _policy_tensors(op, a, target)
    sums = a.get("document_sums")
    n_docs = a["num_documents"] if a["num_documents"] is not None else (sums.shape[0] if sums is not None else None)
    if n_docs is not None:
        check_num_documents(op, n_docs)
    adv = per_sequence(a["advantages"], target)
    per_document = (adv.dim() == 1 and list(adv.shape) != list(target.shape) and adv.device == document_index.device
                    and (n_docs is None or adv.shape[0] == n_docs))
    if not per_document:
        check_per_token(op, "advantages", adv, target)
    if sums is not None:
        kl_share = (a["kl_importance_weighted"] and a["beta"] != 0 and a["ref_log_probs"] is not None
                    and not a["token_advantages"])
        basic = a["rollout_log_probs"] is None and a["loss_type"] != "vespo" and not kl_share
        acc = acc_dtype(x.dtype)
        cols = sums.shape[1] if sums.dim() == 2 else -1
        n = len(GSPO_SUMS)
        _check(sums.dim() == 2 and sums.shape[0] == n_docs and (cols == n or (basic and cols == GSPO_BASIC_SUMS))
               and sums.dtype == acc and sums.device == x.device, op, "document_sums must be (", n_docs, ", ", n, ") ",
               _dt(acc), " on ", x.device, " (or with its first 3 columns only)" if basic else "", ", got ",
               _shape(sums.shape), " ", _dt(sums.dtype), " on ", sums.device)
    sampler(op, a, x)
    return n_docs


def document_sums(a):
    op = "gspo_document_sums"
    target = a["target"]
    check_num_documents(op, a["num_documents"])
    check_weighting(op, a["weighting"])
    check_clip(op, a)
    policy_options(op, a, fused=False, clip=True, sequence_ratio=True)
    _geo_mean(op, a)
    check_per_token(op, "log_probs", a["log_probs"], target)
    check_per_token_int(op, "target", target, target)
    check_per_token(op, "advantages", a["advantages"], target)
    if a["old_log_probs"] is not None:
        check_per_token(op, "old_log_probs", a["old_log_probs"], target)
    check_per_token_int(op, "document_index", a["document_index"], target)
    check_label_counts(op, a["label_counts"], target)
    _policy_tensors(op, a, target)


# ---- common/sampler.cpp (sampler_params; the values' ranges are the data's: the real op's), and the row sources ------
def sampler(op, a, x):
    """sampler_params, then what a row source refuses when its passes run with the options (lean, a shard)."""
    if a.get("top_k") is None and a.get("top_p") is None and a.get("min_p") is None:
        return
    _check(a.get("row_stats") is None, op, "top_k, top_p and min_p need each row's whole vocabulary; they are not ",
           "available with row_stats (tensor parallelism)")
    for name, integral in (("top_k", True), ("top_p", False), ("min_p", False)):
        v, target = a.get(name), a["target"]
        if v is not None:
            _check(_integral(v.dtype) if integral else v.dtype.is_floating_point, op, name, " must be ",
                   "an integer" if integral else "a floating-point", " tensor, got ", _dt(v.dtype))
            _check(v.dim() == 0 or list(v.shape) == list(target.shape), op, name, " must be 0-dim (every row) or ",
                   "shaped like the target ", _shape(target.shape), ", got shape ", _shape(v.shape))
    if "hidden" in a:
        _check(a["strategy"] != "lean", op, "top_k, top_p and min_p need each row's whole vocabulary at once, which ",
               "strategy='lean' does not hold; use strategy='fast'")
        return
    start, vocab, total = a.get("vocab_start", 0), x.shape[-1], a.get("vocab_size", -1)
    total = start + vocab if total < 0 else total
    _check(start == 0 and vocab == total, op, "top_k, top_p and min_p need each row's whole vocabulary; they are not ",
           "available with a vocabulary shard (vocab_start ", start, ", vocab_size ", total, ", shard of ", vocab, ")")
