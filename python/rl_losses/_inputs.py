"""Input handling shared by the functional wrappers (functional.py) and the distributed losses (distributed.py):
the opt-in host checks of label and document ids on CUDA, the options' normalisation and the named result of the
policy ops. Kept apart so that functional.py can route to distributed.py without an import cycle."""
from __future__ import annotations

import os

import torch

from rl_losses import _schema
from rl_losses.outputs import PolicyLossOutput


def _check_inputs_enabled() -> bool:
    # Opt-in host-side validation of label / document ids on CUDA (it synchronises with the device).
    # On the CPU the kernels always check; on CUDA an out-of-range label trips a device-side assert.
    return os.environ.get("RL_LOSSES_CHECK_INPUTS", "0") not in ("", "0")


def _check_labels(name: str, target: torch.Tensor, vocab_size: int | None) -> None:
    # The opt-in CUDA range check of labels against the (global) vocabulary size; None: the op reports the
    # shape error. It reads a value on the host, so it is skipped inside a compiled graph.
    if (vocab_size is not None and target.is_cuda and target.numel() > 0 and _check_inputs_enabled()
            and not torch.compiler.is_compiling()):
        high = int(target.max())
        if high >= vocab_size:
            raise ValueError(f"{name}: target holds label {high}, out of range for vocab_size {vocab_size}")


def _vocab_size(t: torch.Tensor, dim: int) -> int | None:
    return t.shape[dim] if t.dim() >= 1 else None


def _check_document_ids(name: str, document_index: torch.Tensor, num_documents: int | None) -> None:
    # The opt-in CUDA range check of document ids (the CPU kernels always check).
    if document_index.is_cuda and _check_inputs_enabled() and num_documents is not None and document_index.numel():
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
    _schema.check_keywords(name, options, allowed)
    for key, value in options.items():
        if key.endswith("divisor") and value is not None:
            options[key] = _divisor(value)
    if options.get("rollout_mask_bounds") is not None:
        options["rollout_mask_bounds"] = [float(b) for b in options["rollout_mask_bounds"]]
    return options


def _layout(op: str) -> tuple[int, ...]:
    # The position in `op`'s results of each field of PolicyLossOutput but loss_type (-1: not a result of op).
    names = _schema.results(op)
    return tuple(names.index(f) if f in names else -1 for f in PolicyLossOutput._fields[:-1])


_LAYOUTS = {op: _layout(op) for op in ("grpo", "gspo", "linear_grpo", "linear_gspo")}
# The metrics of an option, None where it is off.
_FIELD = {name: i for i, name in enumerate(PolicyLossOutput._fields)}
_ROLLOUT = [_FIELD[f] for f in ("rollout_ratio_mean", "rollout_weight_mean", "rollout_corrected_fraction")]


def policy_output(op: str, out, options: dict) -> PolicyLossOutput:
    """The named result of a policy op from its results by name, with None for the metrics whose option is off."""
    values = [out[i] if i >= 0 else None for i in _LAYOUTS[op]]
    defaults = _schema.defaults(op)
    get = options.get
    if not get("compute_entropy", defaults["compute_entropy"]) and \
            get("entropy_coefficient", defaults["entropy_coefficient"]) == 0:
        values[_FIELD["entropy"]] = None
    if get("ref_log_probs") is None:
        values[_FIELD["kl"]] = None
    if get("rollout_correction", defaults["rollout_correction"]) is None:
        for i in _ROLLOUT:
            values[i] = None
    loss_type = get("loss_type", defaults["loss_type"])
    if loss_type != "vespo":
        values[_FIELD["vespo_phi_seq_mean"]] = None
    values.append(loss_type)
    return PolicyLossOutput._make(values)
