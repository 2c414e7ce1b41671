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
import torch.distributed as dist

_ops = torch.ops.rl_losses

# The mode as batch_invariant() last set it, for the Python side (group_sum): read at trace time, a compiled
# function guards on it, where a call of the C++ flag's getter could not be traced. The kernels read the C++ flag,
# which batch_invariant() sets together with this one.
_entered = False


class batch_invariant(contextlib.ContextDecorator):
    """Runs the block (or the decorated function) in the batch-invariant mode; ``enabled=False`` leaves it instead.

    Nests: on exit the mode is what it was on entry. Enter it outside a ``torch.compile``'d function (the switch is
    no tensor operation); the compiled ops then read it when they run.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self._previous: list[bool] = []

    def __enter__(self) -> "batch_invariant":
        global _entered
        self._previous.append(_ops._set_batch_invariant(self.enabled))
        _entered = self.enabled
        return self

    def __exit__(self, *exc) -> bool:
        global _entered
        _entered = self._previous.pop()
        _ops._set_batch_invariant(_entered)
        return False


def mode_on() -> bool:
    """The mode as the Python side reads it (traceable by torch.compile): the switch batch_invariant() sets, or
    deterministic algorithms."""
    return _entered or torch.are_deterministic_algorithms_enabled()


# all_gather_into_tensor's newer name (the old one warns on every call where both exist).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(tensor: torch.Tensor, group) -> torch.Tensor:
    # (world, *tensor.shape): the ranks' tensors in rank order. One collective into one buffer: the list form's
    # buffers and copies cost the host more than its sums (a TP step of the mode: ~0.5 ms of host time against ~1.6 ms
    # of device time on an H200 host).
    world = dist.get_world_size(group)
    out = tensor.new_empty(world * tensor.numel())  # (flat: gloo takes no other layout)
    _all_gather_single(out, tensor.contiguous().view(-1), group=group)
    return out.view(world, *tensor.shape)


def group_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """SUM of ``tensor`` over the process group, in place. In the mode the ranks' tensors are gathered and added in
    rank order: an all-reduce's ring adds a value's contributions starting at a rank chosen by the value's place in
    the message, so a row's sum would depend on the rows beside it. (max needs no order.)"""
    if not mode_on():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor
    parts = _gather(tensor, group)
    total = parts[0]
    for rank in range(1, parts.shape[0]):
        total = total + parts[rank]
    return tensor.copy_(total)


# Across tensor-parallel degrees (docs/consistency.md, "Tensor parallelism"): a rank's sum over its shard is rounded
# before the shards are added, so 1, 2 and 4 ranks would sum a row in different orders. In the mode the vocabulary
# is cut instead into B blocks of V / B columns, the same at every degree: each block is reduced on its own (a row
# of its own for the row-statistics op, whose bits depend on the row alone) and the blocks' sums are added as one
# binary tree over the B blocks, which no rank boundary changes. B is the largest power of two up to 8 that leaves
# blocks of a multiple of 8 columns, 16 bytes of bf16 (a CUDA row pass reads rows that start elsewhere from an
# aligned copy; where V is no multiple of 8, the largest dividing V): 8 for V = 128256 or 151936. It applies where
# each rank's shard is whole blocks: even shards and a degree dividing B (1, 2, 4, 8). Why not more blocks: shorter
# rows cost the statistics pass more (H200, 16384 rows of a 64128-column bf16 shard: 0.51 ms whole, 0.50 in 4 blocks
# and 0.65 in 16 on row_stats' tp_blocks kernel, one warp a row).
def vocab_blocks(vocab_size: int, world: int) -> int:
    """How many vocabulary blocks each of ``world`` ranks with even shards reduces in the mode; 0 where the shards
    are not whole blocks (or outside the mode), and the ranks' sums are merged in rank order (group_sum)."""
    if not mode_on():
        return 0
    # (A loop, not math.gcd: Dynamo traces it where the vocabulary's size is a symbol.)
    step = 8 if vocab_size % 8 == 0 else 1
    blocks = 8
    while blocks > 1 and vocab_size % (step * blocks):
        blocks //= 2
    return blocks // world if blocks % world == 0 else 0


def block_sum(sums: torch.Tensor, group) -> torch.Tensor:
    """(rows, k) from each rank's (rows, B / world, k) block sums, gathered in rank order (that of the shards):
    block b added to block b + B/2, then the same on the first half, down to one: a fixed tree over the blocks."""
    # (world, rows, B / world, k): block r·B/world + j at [r, :, j]; so while more than one rank's remain, the tree's
    # pairs (b, b + half) are the first half of the ranks' blocks and the second's, added without a copy.
    blocks = _gather(sums, group)
    while blocks.shape[0] > 1:
        half = blocks.shape[0] // 2
        blocks = blocks[:half] + blocks[half:]
    blocks = blocks[0]
    while blocks.shape[1] > 1:
        half = blocks.shape[1] // 2
        blocks = blocks[:, :half] + blocks[:, half:]
    return blocks[:, 0]


def is_batch_invariant() -> bool:
    """Whether the ops now run batch-invariant: inside ``batch_invariant()`` or under
    ``torch.use_deterministic_algorithms(True)``."""
    return _ops._batch_invariant()


def shard_sum(sums: torch.Tensor, group, blocks: int) -> torch.Tensor:
    """(rows, k): the group's sum of each rank's (rows, max(blocks, 1), k) sums, over its vocabulary blocks in the
    mode (block_sum; `blocks` from vocab_blocks), else of its shard's (group_sum, in place)."""
    if not sums.numel():
        return sums[:, 0]
    return block_sum(sums, group) if blocks else group_sum(sums[:, 0], group)
