"""The batch-invariant mode (docs/consistency.md, "Batch invariance").

In it, every op computes each row's outputs (log-prob, entropy, loss terms) and gradient row from that row alone:
the same bits whatever the batch size, the row's position and the other rows, with or without a gradient
(``token_log_probs`` equals ``grpo_loss``'s ``log_probs`` bit for bit), and for the fused lm_head whatever the
chunk size. Every reduction over rows (the loss, ``grad_weight``) is deterministic from run to run. The mode is on
inside ``batch_invariant()`` and while ``torch.use_deterministic_algorithms(True)`` is set; the ops read it in C++
once per call, so a function compiled with ``torch.compile`` (even ``fullgraph=True``) follows the mode in force
when it runs. The switch is process-wide, like ``torch.use_deterministic_algorithms``.
"""
from __future__ import annotations

import contextlib

import torch

_ops = torch.ops.rl_losses


class batch_invariant(contextlib.ContextDecorator):
    """Runs the block (or the decorated function) in the batch-invariant mode; ``enabled=False`` leaves it instead.

    Nests: on exit the mode is what it was on entry. Enter it outside a ``torch.compile``'d function (the switch is
    no tensor operation); the compiled ops then read it when they run.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self._previous: list[bool] = []

    def __enter__(self) -> "batch_invariant":
        self._previous.append(_ops._set_batch_invariant(self.enabled))
        return self

    def __exit__(self, *exc) -> bool:
        _ops._set_batch_invariant(self._previous.pop())
        return False


def is_batch_invariant() -> bool:
    """Whether the ops now run batch-invariant: inside ``batch_invariant()`` or under
    ``torch.use_deterministic_algorithms(True)``."""
    return _ops._batch_invariant()
