"""The ops' schemas read back, so that Python types no default, argument position or result count of its own.

Every argument's type, name and default, and every result's name, has one home: the argument lists of
csrc/op_args.h, from which registration.cpp builds the schemas. This module reads them from
``torch.ops.rl_losses.<op>.default._schema``: the defaults, the documented signature of a wrapper, and the results
by name. The column layouts of the few result tensors that hold several values per row (row statistics, GSPO's
per-document sums) are named here, once, and tests/test_schema.py holds them against the C++ ops.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

_ops = torch.ops.rl_losses

# Columns of row_stats / the ops' `row_stats` (csrc/common/math.h: RowStats): per row of s·logits, the max, Σexp(x−max),
# Σexp(x−max)·x, Σx and the label's logit.
ROW_STATS = ("max", "sum_exp", "sum_exp_x", "sum_x", "label_logit")
# Columns of distillation_stats (csrc/distillation/distillation_math.h: DistillStats).
# The student's x and the teacher's y: max x, Σe^(x−max x), max y, Σe^(y−max y), Σe^(y−max y)·(y − x),
# Σe^(x−max x)·(x − y), Σe^(y−max y)·x; each sum rescales with the max of its exponent's side.
DISTILL_STATS = ("ms", "ss", "mt", "st", "wt", "ws", "hx")
DISTILL_STUDENT_SUMS = ("ss", "ws")
# Columns of gspo_document_sums / gspo's `document_sums` (csrc/gspo/gspo.h: GspoSum).
GSPO_SUMS = ("log_ratio", "advantage", "count", "rollout_log_ratio", "vespo_log_w", "kl_share")
# The first columns alone, accepted where the policy family's are unused.
GSPO_BASIC_SUMS = 3


def column(layout: tuple[str, ...], name: str) -> int:
    return layout.index(name)


def _read_schemas():
    """Every op's schema, read once at import: what the wrappers look up per call is then a dict's, which
    torch.compile traces as a constant."""
    out = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace == "rl_losses" and "." not in name:
            out[name] = getattr(_ops, name).default._schema
    return out


_SCHEMAS = _read_schemas()
_DEFAULTS = {op: {a.name: a.default_value for a in s.arguments if a.has_default_value()} for op, s in _SCHEMAS.items()}
_ARGUMENTS = {op: frozenset(a.name for a in s.arguments) for op, s in _SCHEMAS.items()}
_RESULTS = {op: tuple(r.name for r in s.returns) for op, s in _SCHEMAS.items()}


def ops() -> tuple[str, ...]:
    return tuple(_SCHEMAS)


def schema(op: str) -> torch._C.FunctionSchema:
    return _SCHEMAS[op]


def defaults(op: str) -> dict[str, Any]:
    """The public op's defaults, by argument name."""
    return _DEFAULTS[op]


def arguments(op: str) -> frozenset[str]:
    return _ARGUMENTS[op]


def results(op: str) -> tuple[str, ...]:
    """The op's result names, in its order."""
    return _RESULTS[op]


def default(op: str, name: str) -> Any:
    return defaults(op)[name]


def option(op: str, options: dict, name: str) -> Any:
    """An option of a call: given, or the op's default."""
    return options[name] if name in options else defaults(op)[name]


def items_at(positions) -> Callable[[tuple], tuple]:
    """A function returning the items of a tuple at `positions`: as fast as an operator.itemgetter, and traceable by
    torch.compile, which an itemgetter is not."""
    return eval(f"lambda out: ({''.join(f'out[{int(i)}], ' for i in positions)})")


def getter(op: str, names: tuple[str, ...]) -> Callable[[tuple], tuple]:
    """The op's results of those names, in their order (a NamedTuple's fields): found once per op, at import, by
    the op's wrapper."""
    return items_at(results(op).index(name) for name in names)


def bind(op: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every argument of a call by name, the omitted ones at their defaults (the fake kernels)."""
    values = dict(defaults(op))
    values.update(zip((a.name for a in schema(op).arguments), args))
    values.update(kwargs)
    return values


_ANNOTATIONS = {"Tensor": torch.Tensor, "float": float, "int": int, "bool": bool, "str": str,
                "List[float]": list[float], "List[bool]": list[bool]}


def _annotation(t) -> Any:
    if isinstance(t, torch._C.OptionalType):
        return _ANNOTATIONS.get(str(t.getElementType()), Any) | None
    return _ANNOTATIONS.get(str(t), Any)


def signature(op: str, *, drop=(), rename: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
              keyword_only=(), returns: Any = inspect.Signature.empty) -> inspect.Signature:
    """A wrapper's documented signature from the op's schema: its tensors positional, its options keyword-only
    with the schema's defaults, less `drop` (the hooks the wrapper fills itself), names changed by `rename`, then
    the wrapper's own keyword options `extra` (name -> default). `keyword_only`: positional arguments of the
    schema that the wrapper takes by keyword."""
    rename = rename or {}
    params = []
    for a in schema(op).arguments:
        if a.name in drop:
            continue
        keyword = a.kwarg_only or a.name in keyword_only
        kind = inspect.Parameter.KEYWORD_ONLY if keyword else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default_value = a.default_value if a.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(rename.get(a.name, a.name), kind, default=default_value,
                                        annotation=_annotation(a.type)))
    for name, value in (extra or {}).items():
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value))
    return inspect.Signature(params, return_annotation=returns)


def check_keywords(name: str, options: dict, allowed: frozenset[str]) -> None:
    """A wrapper taking **options refuses an unknown one as Python would."""
    if not options.keys() <= allowed:
        unknown = sorted(options.keys() - allowed)
        raise TypeError(f"{name}() got an unexpected keyword argument {unknown[0]!r}")


def keywords(op: str, *, drop=(), extra=()) -> frozenset[str]:
    """The keyword options of a wrapper over `op`: the op's, less `drop`, plus the wrapper's own `extra`."""
    return frozenset(a.name for a in schema(op).arguments if a.kwarg_only and a.name not in drop) | frozenset(extra)
