"""Input handling shared by the functional wrappers (functional.py) and the distributed losses (distributed.py):
the opt-in host checks of label and document ids on CUDA, the options' normalisation and the named result of the
policy ops. Kept apart so that functional.py can route to distributed.py without an import cycle."""
from __future__ import annotations

import itertools
import os
import threading
from typing import Callable

import torch

from rl_losses import _schema
from rl_losses.outputs import PolicyLossOutput


_tracing = torch.compiler.is_dynamo_compiling


# The rl_losses.forward_backward call in progress on this thread (`call`), or none.
_CAPTURE = threading.local()


def _direct(packet):
    """What the wrappers call for ``torch.ops.rl_losses.<op>``: the op's C++ function (``packet._op``), which the
    OpOverloadPacket calls after a Python frame of its own (the arguments repacked through *args / **kwargs and a
    torchbind test) that cost ~0.5-1 µs per fwd+bwd call on a CPU host
    (benchmarks/results/cpu-2026-11-27-python-layer.txt). torch.compile's tracing knows the packet, not the C++
    function: while it traces, the packet. Inside rl_losses.forward_backward, its forward op's call."""
    if _tracing():
        return packet
    call = getattr(_CAPTURE, "call", None)
    return packet._op if call is None else call.stub(packet)

# os.environ.get of an unset name raises and catches a KeyError inside (~2 µs a call); the dict behind os.environ,
# which every write to os.environ updates, answers the same in a lookup.
_ENVIRON = os.environ._data
_CHECK_INPUTS = os.environ.encodekey("RL_LOSSES_CHECK_INPUTS")


def _check_inputs_enabled() -> bool:
    # Opt-in host-side validation of label / document ids on CUDA (it synchronises with the device).
    # On the CPU the kernels always check; on CUDA an out-of-range label trips a device-side assert.
    value = _ENVIRON.get(_CHECK_INPUTS)
    return value is not None and os.environ.decodevalue(value) not in ("", "0")


def _check_labels(name: str, target: torch.Tensor, vocab_size: int | None) -> None:
    # The opt-in CUDA range check of labels against the (global) vocabulary size; None: the op reports the
    # shape error. It reads a value on the host, so it is skipped inside a compiled graph.
    if (target.is_cuda and vocab_size is not None and target.numel() > 0 and _check_inputs_enabled()
            and not torch.compiler.is_compiling()):
        _check_label_range(name, target, vocab_size)


def _check_label_range(name: str, target: torch.Tensor, vocab_size: int) -> None:
    # The range check itself, for callers that decided it runs (it reads the largest label on the host).
    if target.numel():
        high = int(target.max())
        if high >= vocab_size:
            raise ValueError(f"{name}: target holds label {high}, out of range for vocab_size {vocab_size}")


def _check_labels_in(name: str, target: torch.Tensor, vocab_of: torch.Tensor, dim: int) -> None:
    # _check_labels against vocab_of.shape[dim] (none for a 0-dim vocab_of), read only where the check runs. The
    # wrappers call it only where the variable is present (``_CHECK_INPUTS in _ENVIRON``, the cheapest question).
    if target.is_cuda and vocab_of.dim() >= 1:
        _check_labels(name, target, vocab_of.shape[dim])


def _check_document_ids(name: str, document_index: torch.Tensor, num_documents: int | None) -> None:
    # The opt-in CUDA range check of document ids (the CPU kernels always check).
    if (_CHECK_INPUTS in _ENVIRON and num_documents is not None and document_index.is_cuda
            and _check_inputs_enabled() and document_index.numel()):
        high = int(document_index.max())
        if high >= num_documents:
            raise ValueError(f"{name}: document_index holds {high} but num_documents is {num_documents}")


def _divisor(divisor) -> float | None:
    if divisor is None:
        return None
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.item()
    return float(divisor)


def _options(name: str, options: dict, allowed: frozenset[str]) -> dict:
    """A wrapper's keyword options as its op takes them: an unknown one refused as Python would, the divisors as
    numbers (a 0-dim tensor is read on the host), the mask bounds as a list."""
    if not options:
        return options
    if not allowed.issuperset(options):  # (no keys view made)
        _schema.check_keywords(name, options, allowed)
    if _CONVERTED.isdisjoint(options):  # most calls: nothing to convert
        return options
    for key in _DIVISORS.intersection(options):
        value = options[key]
        if value is not None and type(value) is not float:
            options[key] = _divisor(value)
    if options.get("rollout_mask_bounds") is not None:
        options["rollout_mask_bounds"] = [float(b) for b in options["rollout_mask_bounds"]]
    for key in _SAMPLER:
        value = options.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            options[key] = torch.tensor(value)  # a 0-dim CPU tensor: every row, read without a synchronisation
    return options


# The sampler's options (docs/consistency.md): a number for every row, or a tensor shaped like the target.
_SAMPLER = ("top_k", "top_p", "min_p")
# The divisor options of every op, and every option _options converts.
_DIVISORS = frozenset(key for op in _schema.ops() for key in _schema.arguments(op) if key.endswith("divisor"))
_CONVERTED = _DIVISORS | {"rollout_mask_bounds", *_SAMPLER}


_FIELDS = PolicyLossOutput._fields
_LAYOUTS = {op: tuple(_schema.results(op).index(f) if f in _schema.results(op) else None for f in _FIELDS[:-1])
            for op in ("grpo", "gspo", "linear_grpo", "linear_gspo")}
# The metrics of each option, None where it is off: compute_metrics', the entropy, the KL, the rollout correction,
# vespo (the ops' own rule, csrc/common/policy.h: policy_metrics_on; the fake kernels read these too).
_OPTIONAL = (("clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean"), ("entropy",), ("kl",),
             ("rollout_ratio_mean", "rollout_weight_mean", "rollout_corrected_fraction"), ("vespo_phi_seq_mean",))


def _picker(op: str, on: tuple[bool, ...]) -> Callable[[tuple, str], PolicyLossOutput]:
    """The maker of PolicyLossOutput from `op`'s results and the loss type: the fields of `op`'s layout, None for
    those the op lacks and for the metrics of the options (_OPTIONAL) that are not `on`. Generated code: one tuple
    built, as fast as an itemgetter, and traceable by torch.compile, which an itemgetter is not."""
    hidden = {field for fields, is_on in zip(_OPTIONAL, on) if not is_on for field in fields}
    items = "".join("None, " if i is None or f in hidden else f"out[{i}], " for f, i in zip(_FIELDS, _LAYOUTS[op]))
    return eval(f"lambda out, loss_type: new(PolicyLossOutput, ({items}loss_type))",
                {"new": tuple.__new__, "PolicyLossOutput": PolicyLossOutput})


# Every op's getter for every set of metric options, made at import (torch.compile traces a dict's lookup, not the
# code that would make a getter on a first call).
_PICKERS = {(op, on): _picker(op, on)
            for op in _LAYOUTS for on in itertools.product((False, True), repeat=len(_OPTIONAL))}


def _metrics_on(op: str, options: dict) -> tuple[bool, ...]:
    """Whether the metrics of each option of _OPTIONAL are on in a call of `op` with `options`."""
    defaults = _schema.defaults(op)
    get = options.get
    metrics = bool(get("compute_metrics", defaults["compute_metrics"]))
    return (metrics,
            bool(get("compute_entropy", defaults["compute_entropy"])
                 or metrics and get("entropy_coefficient", defaults["entropy_coefficient"]) != 0),
            metrics and get("ref_log_probs") is not None,
            metrics and get("rollout_correction", defaults["rollout_correction"]) is not None,
            metrics and get("loss_type", defaults["loss_type"]) == "vespo")


# The options that turn metrics on or off; a call without any of them takes its op's picker of the defaults.
_METRIC_OPTIONS = frozenset(("compute_metrics", "compute_entropy", "entropy_coefficient", "ref_log_probs",
                             "rollout_correction", "loss_type"))
_AT_DEFAULTS = {op: (_PICKERS[op, _metrics_on(op, {})], _schema.default(op, "loss_type")) for op in _LAYOUTS}


def policy_output(op: str, out, options: dict) -> PolicyLossOutput:
    """The named result of a policy op from its results by name, with None for the metrics whose option is off."""
    make, loss_type = _AT_DEFAULTS[op]
    if _METRIC_OPTIONS.isdisjoint(options):
        return make(out, loss_type)
    return _PICKERS[op, _metrics_on(op, options)](out, options.get("loss_type", loss_type))
