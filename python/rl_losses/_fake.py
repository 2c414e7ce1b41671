"""Fake (meta) kernels of every op, so that torch.compile and meta tensors can trace them.

Each binds its call's arguments by name over the op's schema (rl_losses._schema.bind), runs the real kernel's checks
(``_checks.py``, ``_checks_heads.py``: the same conditions in the same order, the same messages), then describes the
results by name as the C++ code makes them (shape, dtype, device); the op's schema orders them.
"""
import torch
from torch.library import register_fake

from rl_losses import _checks, _checks_heads, _schema
from rl_losses._inputs import _OPTIONAL, _metrics_on
from rl_losses._schema import DISTILL_STATS, GSPO_SUMS, ROW_STATS


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(x, shape, dtype=None):
    # torch.empty on x's device (x.new_empty on meta tensors takes a slow Python path).
    return torch.empty(shape, dtype=_acc(x.dtype) if dtype is None else dtype, device=x.device)


def _scalar(x):
    return _empty(x, [])


def _like_target(x, target):
    return _empty(x, list(target.shape))


def _grad(x, compute_grad):
    return torch.empty_like(x, memory_format=torch.contiguous_format) if compute_grad else _empty(x, [0], x.dtype)


def _row_unscale(x, target, with_grad, row_factors=False):
    """grad_row_unscale: a factor per row where fp16 gradient rows are stored pre-scaled (csrc/common/row_pass.h,
    GradRowPrescaled) or the op sets rows' factors after its pass (`row_factors`: grpo's bypass_mode rejection),
    else None."""
    rows = with_grad and (x.dtype == torch.float16 or row_factors)
    return _empty(x, [target.numel()], torch.float32) if rows else None


def _linear_grads(a):
    """grad_hidden, grad_weight, grad_bias as output_mask asks (grad_weight goes into weight_main_grad when given)."""
    hidden, mask = a["hidden"], a["output_mask"]

    def grad(t, wanted):
        return torch.empty_like(t, memory_format=torch.contiguous_format) if wanted and t is not None \
            else _empty(hidden, [0], hidden.dtype)
    return {"grad_hidden": grad(hidden, mask[0]),
            "grad_weight": grad(a["weight"], mask[1] and a["weight_main_grad"] is None),
            "grad_bias": grad(a["bias"], mask[2])}


def _register(op: str, fake) -> None:
    """Registers `fake(arguments by name) -> results by name` as the fake kernel of `op`."""
    names = _schema.results(op)
    # An op that writes an argument returns plain tensors: a result left out (None) is an empty one there
    # (csrc/common/schema.cpp).
    writes = getattr(torch.ops.rl_losses, op).default._schema.is_mutable

    def kernel(*args, **kwargs):
        values = fake(_schema.bind(op, args, kwargs))
        if writes and None in values.values():
            first = values[names[0]]
            values = {n: first.new_empty([0]) if v is None else v for n, v in values.items()}
        return values[names[0]] if len(names) == 1 else tuple(values[n] for n in names)
    register_fake(f"rl_losses::{op}")(kernel)


def _register_loss(name: str, check, results, *, linear: bool = False, row_factors=lambda a: False) -> None:
    """A loss over the row pass's ops (registration.cpp: def_loss, and def_linear with `linear`): its row source's
    checks, then `check(op, a, x)` (x: the logits or the hidden states), whose return `results(a, x, checked)` may
    use; `row_factors(a)`: whether the forward returns a factor per gradient row whatever the dtype."""
    def run(op, a, inplace=False):
        x = _checks.source(op, a, inplace)
        return results(a, x, check(op, a, x))

    def forward(a):
        logits, compute_grad = a["logits"], a["compute_grad"]
        return {**run(name, a), "grad": _grad(logits, compute_grad),
                "grad_row_unscale": _row_unscale(logits, a["target"], compute_grad, row_factors(a))}

    # Without autograd (the only way to the public op's fake) inplace_backward writes nothing: no inplace checks.
    _register(name, lambda a: run(name, a))
    _register(f"_{name}_forward", forward)
    _register(f"_{name}_forward_inplace", lambda a: {**run(name, a, inplace=True),
                                                     "grad_row_unscale": _row_unscale(a["logits"], a["target"], True,
                                                                                       row_factors(a))})
    if linear:
        op = f"linear_{name}"
        _register(op, lambda a: run(op, a))
        _register(f"_{op}_forward", lambda a: {**run(op, a), **_linear_grads(a)})


# ---- shared -----------------------------------------------------------------------------------------------------
def _row_stats(a):
    x = _checks.source("row_stats", a)
    _checks.check_scale("row_stats", a["logits_scale_factor"])
    return {"stats": _empty(x, list(a["target"].shape) + [len(ROW_STATS)])}


_register("row_stats", _row_stats)


@register_fake("rl_losses::_scale_grad_")
def _scale_grad_(grad, grad_output, row_unscale=None):
    return None


# ---- cross-entropy ----------------------------------------------------------------------------------------------
def _cross_entropy_results(a, x, _):
    loss = _like_target(x, a["target"]) if a["reduction"] == "none" else _scalar(x)
    return {"loss": loss, "lse": _like_target(x, a["target"])}


_register_loss("cross_entropy", _checks.cross_entropy, _cross_entropy_results, linear=True)


# ---- the policy family --------------------------------------------------------------------------------------------
def _num_documents(n):
    # max(document_index) + 1 where the arguments do not give it: known only from the data.
    return n if n is not None else torch.library.get_ctx().new_dynamic_size()


def _policy_results(op):
    def results(a, x, num_documents):
        out = {name: _scalar(x) for name in _schema.results(op)}
        out["log_probs"] = _like_target(x, a["target"])
        if "document_ratios" in out:
            out["document_ratios"] = _empty(x, [_num_documents(num_documents)])
        # The metrics of an option that is off are not returned (csrc/common/policy.h, policy_metrics_on: the rule
        # the wrappers read too).
        for names, on in zip(_OPTIONAL, _metrics_on(op, a)):
            if not on:
                out.update(dict.fromkeys(names))
        return out
    return results


# grpo's bypass_mode rejection sets the rejected rows' factors after its pass (csrc/grpo/grpo.cpp).
_register_loss("grpo", _checks.grpo, _policy_results("grpo"), linear=True,
               row_factors=lambda a: a["bypass_mode"] and a["rollout_rs"] is not None)
_register_loss("gspo", _checks.gspo, _policy_results("gspo"), linear=True)


def _document_sums(a):
    _checks.document_sums(a)
    lp = a["log_probs"]
    return {"document_sums": _empty(lp, [a["num_documents"], len(GSPO_SUMS)])}


_register("gspo_document_sums", _document_sums)


def _policy_token_loss(a):
    _checks_heads.policy_token(a)
    lp = a["log_probs"]
    return {name: _empty(lp, lp.shape) for name in _schema.results("policy_token_loss")}


_register("policy_token_loss", _policy_token_loss)


# ---- the kept-set gradient -------------------------------------------------------------------------------------------
def _scatter_rows(a):
    _checks_heads.scatter_rows(a)
    ids = a["ids"]
    return {"grad": torch.empty([*ids.shape[:-1], a["vocab_size"]], dtype=a["values"].dtype, device=ids.device)}


_register("_scatter_rows", _scatter_rows)


# ---- per-token log-probs and entropies ----------------------------------------------------------------------------
def _token_log_probs(name, with_stats):
    def fake(a):
        x = _checks.source(name, a)
        target = a["target"]
        _checks_heads.token_log_probs(name, a, x)
        out = {"log_probs": _like_target(x, target),
               "entropy": _like_target(x, target) if a["compute_entropy"] else _empty(x, [0])}
        if with_stats:  # the statistics for the backward, unless given (row_stats: those are the backward's)
            computed = a.get("row_stats") is None
            out["stats"] = _empty(x, [target.numel(), len(ROW_STATS)] if computed else [0])
        return out
    return fake


for _name in ("token_log_probs", "linear_token_log_probs"):
    _register(_name, _token_log_probs(_name, False))
    _register(f"_{_name}_forward", _token_log_probs(_name, True))


def _token_log_probs_backward(a):
    x = _checks.source("token_log_probs", a)
    _checks_heads.token_log_probs_backward("token_log_probs", a, x)
    return {"grad": torch.empty_like(x, memory_format=torch.contiguous_format)}


def _linear_token_log_probs_backward(a):
    op = "linear_token_log_probs"
    x = _checks.source(op, a)
    if _checks.linear_wants_grad(a):
        _checks_heads.token_log_probs_backward(op, a, x)
    return _linear_grads(a)


_register("_token_log_probs_backward", _token_log_probs_backward)
_register("_linear_token_log_probs_backward", _linear_token_log_probs_backward)


# ---- distillation -------------------------------------------------------------------------------------------------
def _distillation(inplace=False, compute_grad=False):
    def fake(a):
        _checks_heads.distillation(a, inplace)
        logits = a["logits"]
        out = {"loss": _scalar(logits), "divergence": _empty(logits, list(logits.shape[:-1]))}
        if compute_grad:
            out["grad"] = _grad(logits, a["compute_grad"])
        return out
    return fake


_register("distillation", _distillation())
_register("_distillation_forward", _distillation(compute_grad=True))
_register("_distillation_forward_inplace", _distillation(inplace=True))


def _distillation_stats(a):
    _checks_heads.distillation_stats(a)
    logits = a["logits"]
    return {"stats": _empty(logits, list(logits.shape[:-1]) + [len(DISTILL_STATS)])}


def _distillation_jsd_sums(a):
    _checks_heads.distillation_jsd_sums(a)
    logits = a["logits"]
    return {"jsd_sums": _empty(logits, list(logits.shape[:-1]) + [2])}


_register("distillation_stats", _distillation_stats)
_register("distillation_jsd_sums", _distillation_jsd_sums)


# ---- distillation from a sparse teacher --------------------------------------------------------------------------
def _topk_distillation_results(a, x, _):
    out = {name: _like_target(x, a["target"]) for name in _schema.results("topk_distillation")}
    out["loss"] = _scalar(x)
    return out


_register_loss("topk_distillation", _checks_heads.topk_distillation, _topk_distillation_results, linear=True)


# ---- DPO and the fused head -----------------------------------------------------------------------------------------
def _dpo_results(a, x, n_pairs):
    out = {name: _scalar(x) for name in _schema.results("dpo")}
    out["log_probs"] = _like_target(x, a["target"])
    out["document_log_probs"] = _empty(x, [2 * n_pairs])
    return out


def _fused_head_results(a, x, _):
    out = {name: _scalar(x) for name in _schema.results("fused_head")}
    out["log_probs"] = _like_target(x, a["target"])
    for result, weight in _FUSED_HEAD_TERMS.items():  # a term of weight 0 has no output (csrc/fused_head/fused_head.cpp)
        if a[weight] == 0:
            out[result] = None
    return out


_FUSED_HEAD_TERMS = {"label_loss": "label_weight", "z_loss": "z_loss_weight", "grpo_loss": "grpo_weight",
                     "gspo_loss": "gspo_weight", "distillation_loss": "distillation_weight"}


_register_loss("dpo", lambda op, a, x: _checks_heads.dpo(a), _dpo_results)
_register_loss("fused_head", lambda op, a, x: _checks_heads.fused_head(a), _fused_head_results)
