"""Vocabulary-parallel (``tp_group``) and sequence-data-parallel (``sdp_group``) losses (docs/distributed.md).

The functional wrappers (``rl_losses.cross_entropy``, ``z_loss``, ``grpo_loss``, ``gspo_loss``) route here
when given a process group; these functions can also be called directly, e.g. for uneven vocabulary shards.

Design: a thin Python layer around the ops. The C++ ops do all the per-row and per-token math and take the
cross-rank pieces as plain (non-differentiable) tensor inputs — ``row_stats``/``vocab_start``/``vocab_size``
on every loss, ``document_sums`` on GSPO (csrc/registration.cpp) —; this file only runs the collectives
between the ops, with plain ``torch.distributed`` calls (NCCL for CUDA tensors, gloo for CPU tensors).
Why not collectives inside the C++ ops: a schema cannot carry a ProcessGroup without tying the library to
c10d internals, the fake kernels would have to model the communication, and torch.compile could not see it.
Here instead:
  * autograd: the ops take the all-reduced statistics / document sums as inputs and compute this rank's
    whole gradient themselves, so no gradient ever flows through a collective (the statistics are computed
    from ``logits.detach()``), and each rank's gradient is written in the op's one gradient pass;
  * torch.compile: Dynamo rewrites the in-place ``dist.all_reduce`` calls into traceable functional
    collectives (``torch.distributed._functional_collectives``), so a compiled loss keeps one graph
    (``fullgraph=True`` with aot_eager is tested on gloo in tests/test_distributed.py; inductor was checked by
    hand). The host-side checks below are skipped while compiling, and under ``sdp_group`` ``num_documents``
    must then be given (see below);
  * CUDA graphs: NCCL collectives on the current stream are capturable, and nothing here synchronises
    with the host when ``divisor`` / ``num_documents`` are given and the opt-in input checks are off
    (benchmarks/bench_tp.py tries a capture on 2 GPUs).

Tensor parallelism (every loss). Each rank holds a contiguous vocabulary shard ``[vocab_start, vocab_start +
V_loc)`` of the logits; labels are global ids. Per row, ``row_stats`` gives this shard's (max, Σexp(x−max),
Σexp(x−max)·x, Σx, label logit) (csrc/common/math.h: RowStats); two collectives make them global:
all-reduce MAX of the max, then one all-reduce SUM of the other four columns, the first two rescaled by
exp(local max − global max). The loss op, given these statistics, skips its own statistics pass and writes
this shard's gradient; the loss and every metric come out identical on every rank of the group. (So
cross-entropy and GRPO read their shard twice, statistics then loss and gradient, where one device reads the
logits once: the statistics must be global before any gradient entry can be written.) The
gradient each rank gets is that of the (global) loss w.r.t. its own shard: the column-parallel lm_head's
usual all-reduce of the hidden-state gradient completes the backward.
Shards: by default the shards are even — rank r of the group holds columns [r·V_loc, (r+1)·V_loc) and
V = world·V_loc — which costs nothing extra; shards of different widths are then caught on the CPU (and on
CUDA with RL_LOSSES_CHECK_INPUTS=1) by two extra numbers in the MAX all-reduce and reported on every rank.
Uneven shards (V not divisible by the group size) are supported by passing this rank's ``vocab_start`` and
the global ``vocab_size`` (both; the shards must tile [0, V)): chosen over an all-gather of the shard widths
at every call, which would cost a collective and a host synchronisation (and caching it per group could
deadlock when only some ranks' widths change).

Sequence-data parallelism (GSPO). A document's tokens may live on several ranks (document ids are global:
the same id on every rank for a split document). Each rank computes its tokens' log-probs from the row
statistics, then ONE all-reduce SUM over the group of a (num_documents [+1], 7) buffer carries, per document,
the op's six document sums (gspo_document_sums: Σm(lp−old)·w, Σm·A·w, Σm (the labelled count), Σm(old−rollout)
for a sequence-level rollout correction, VESPO's Σm·clamp(lp−old) (+ its rollout terms), the importance-weighted
KL's Σκ·KL) and Σm·lp·w (for the new_logprobs metric), with w = 1/N_t when ``label_counts`` are given, and w = 1
otherwise — then the counts are only known after the sum, and the w-weighted columns are divided by them after
it (exact: N_s is constant over a document); an extra row carries Σm·H and Σm for the entropy metric. The op
then runs with these ``document_sums``, the global per-token ``label_counts`` and the row statistics (so it
reads the logits only once more, for the gradient). Its default divisor is the number of documents with a
labelled token over the group, read from the summed count column. Each rank's loss covers its own tokens: the
SUM of the rank losses equals the single-process loss, and each rank's gradient is that of the global loss
w.r.t. its own logits (what a data-parallel SUM of the weight gradients expects). The metrics (new_logprobs,
clipped fractions, kl_old, ratio_mean, entropy, document_ratios, the policy family's) are the global values,
identical on every rank; ``log_probs`` is per local token. ``num_documents`` defaults to the group's
max(document_index)+1, which costs one more small all-reduce and a host synchronisation: pass it to avoid both.
Both groups together: the tensor-parallel statistics first, then the sequence-data-parallel sums.

Bad input (an error, never a hang): under sdp_group the ranks hold different tokens, so a bad label
or document id may fail on one rank only, before a collective the others are already waiting in. With the
host checks on (CPU tensors; CUDA with RL_LOSSES_CHECK_INPUTS=1), the failing rank still joins the
collective, with a failure flag in its buffer, and then every rank raises: the failing one its own error,
the others "another rank of <group> failed". The flag rides in the buffer of a collective made anyway.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from rl_losses import _schema
from rl_losses.batch_invariance import group_sum, shard_sum, vocab_blocks
from rl_losses._inputs import _check_inputs_enabled, _check_label_range, _check_labels, _options, policy_output
from rl_losses._schema import GSPO_SUMS, ROW_STATS, column
from rl_losses.outputs import PolicyLossOutput

_ops = torch.ops.rl_losses
_STATS = len(ROW_STATS)
# The sums weighted by exp(x − max), adjacent columns of ROW_STATS[1:] (tp_row_stats rescales them in place).
_RESCALED = slice(column(ROW_STATS, "sum_exp") - 1, column(ROW_STATS, "sum_exp_x"))
assert _RESCALED.stop - _RESCALED.start == 2


# ---- shared ------------------------------------------------------------------------------------------------
def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _host_checks(t: torch.Tensor) -> bool:
    # Checks that read a value on the host: free on the CPU, a synchronisation on CUDA (opt-in through
    # RL_LOSSES_CHECK_INPUTS, as in the functional wrappers), impossible inside a compiled graph.
    return not torch.compiler.is_compiling() and (t.device.type == "cpu" or _check_inputs_enabled())


# Bad input must never hang the other ranks in a collective. When the host checks are on, an error
# raised by this rank's local work before a collective is not raised at once: the rank joins the collective
# with a failure flag in the buffer, and after it every rank of the group raises — the failing rank its own
# error, the others a ValueError naming the group. Without the checks (CUDA by default), data errors are
# device-side asserts, and the host-side errors left (shapes, dtypes) are the same on every rank in practice.
def _caught(e: Exception, checked: bool) -> Exception:
    if not checked or isinstance(e, dist.DistError):
        raise e
    return e


def _raise_if_failed(op: str, group_name: str, failed: bool, error: Exception | None) -> None:
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"{op}: another rank of {group_name} failed on its input (its own error says why); "
                         f"this rank stops too")


# ---- tensor parallelism ------------------------------------------------------------------------------------
def _vocab_shard(op: str, logits: torch.Tensor, tp_group, vocab_start, vocab_size) -> tuple[int, int, bool]:
    """(vocab_start, vocab_size, assumed_even) of this rank's shard."""
    if (vocab_start is None) != (vocab_size is None):
        raise ValueError(f"{op}: pass both vocab_start and vocab_size (uneven vocabulary shards) or neither (even "
                         f"shards), got vocab_start={vocab_start}, vocab_size={vocab_size}")
    if vocab_start is not None:
        return int(vocab_start), int(vocab_size), False
    rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    if rank < 0:
        raise ValueError(f"{op}: this process is not a member of tp_group")
    width = logits.shape[-1]
    return rank * width, world * width, True


def group_max(local_max: torch.Tensor, tp_group, extras: list[float] | None = None):
    """The MAX over tp_group of ``local_max`` (a new tensor: the collective writes into it) and of ``extras``, host
    numbers riding in the same all-reduce (the shard widths, a failure flag): (global max, the extras' maxima as a
    list, or None)."""
    if extras is None:
        buffer = local_max.clone()
    else:
        buffer = torch.cat([local_max.reshape(-1), local_max.new_tensor(extras)])
    if buffer.numel():  # (every rank of the group holds the same rows: all skip, or none)
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=tp_group)
    if extras is None:
        return buffer, None
    n = local_max.numel()
    return buffer[:n].view(local_max.shape), buffer[n:].tolist()


def tp_row_stats(op: str, logits: torch.Tensor, target: torch.Tensor, tp_group, *, logits_scale_factor: float,
                 vocab_start: int, vocab_size: int, even: bool, entropy: bool = False,
                 smoothing: bool = False) -> torch.Tensor:
    """The row statistics of the whole vocabulary, (N, 5) float32 (float64 for float64 logits), identical on
    every rank of ``tp_group``, from this rank's shard. Two collectives: MAX, then one SUM of 4 columns (in the
    batch-invariant mode, an all-gather of the 4 columns of each vocabulary block: batch_invariance.vocab_blocks).
    Shards assumed even must be: there each rank takes its width for every rank's (checked with the host checks),
    and in the mode ranks of different widths would gather blocks of different counts.

    With the host checks on, the MAX carries three more numbers: the widest shard, the narrowest (negated) —
    shards assumed even that are not are reported on every rank — and the failure flag."""
    checked = _host_checks(logits)
    error = None
    # The mode's vocabulary blocks (batch_invariance.vocab_blocks): each a row of its own for row_stats, the
    # label given to each block shifted by the block's offset (outside the block in all but the one that holds it).
    blocks = vocab_blocks(vocab_size, dist.get_world_size(tp_group)) if even else 0
    block_width = logits.shape[-1] // max(blocks, 1)
    try:
        if blocks and checked:  # on the CPU too: the op would name a block's row in its label error
            _check_label_range(op, target, vocab_size)
        else:
            _check_labels(op, target, vocab_size)
        rows, labels = logits.detach(), target
        if blocks:
            # (A shard that is a column slice of wider logits is copied by the reshape.)
            rows = rows.reshape(-1, block_width)
            # (A label left negative, or beyond its block, is no label of the block: no masking needed.)
            offsets = torch.arange(0, blocks * block_width, block_width, device=target.device)
            labels = (target.reshape(-1, 1) - offsets).reshape(-1)
        stats = _ops.row_stats(rows, labels, logits_scale_factor=logits_scale_factor, vocab_start=vocab_start,
                               vocab_size=vocab_size, entropy=entropy, smoothing=smoothing, tp_blocks=bool(blocks))
        stats = stats.reshape(target.numel(), max(blocks, 1), _STATS)
    except (RuntimeError, ValueError) as e:
        error = _caught(e, checked)
        stats = torch.zeros(target.numel(), max(blocks, 1), _STATS, dtype=_acc(logits.dtype), device=logits.device)
    block_max = stats[..., column(ROW_STATS, "max")]
    local_max = block_max.amax(dim=1) if blocks else block_max[:, 0]
    width = float(logits.shape[-1])
    global_max, extras = group_max(local_max, tp_group, [width, -width, float(error is not None)] if checked else None)
    if checked:
        widest, narrowest, failed = extras
        if even and widest != -narrowest:
            raise ValueError(f"{op}: the vocabulary shards of tp_group are uneven (from {int(-narrowest)} to "
                             f"{int(widest)} columns); pass this rank's vocab_start and the global vocab_size to "
                             f"rl_losses.distributed.{op}")
        _raise_if_failed(op, "tp_group", failed > 0, error)
    # A shard (block) whose values are all -inf has sums 0; guard its factor (exp(-inf - -inf) would be NaN).
    factor = torch.where(block_max == float("-inf"), 0.0, torch.exp(block_max - global_max.unsqueeze(1)))
    # The sums weighted by exp(x − max) rescale to the global max; Σx and the label's logit add as they are.
    sums = stats[..., 1:].clone()
    sums[..., _RESCALED].mul_(factor.unsqueeze(-1))
    sums = shard_sum(sums, tp_group, blocks)
    return torch.cat([global_max.unsqueeze(1), sums], dim=1)


def _tp_setup(op, logits, target, tp_group, logits_scale_factor, vocab_start, vocab_size, *, entropy=False,
              smoothing=False):
    """(row_stats, vocab_start, vocab_size) for the op: all-reduced over tp_group when one is given."""
    if tp_group is None:
        if vocab_start is not None or vocab_size is not None:
            raise ValueError(f"{op}: vocab_start/vocab_size describe a tp_group shard, but tp_group is None")
        return None, 0, -1
    start, total, even = _vocab_shard(op, logits, tp_group, vocab_start, vocab_size)
    stats = tp_row_stats(op, logits, target, tp_group, logits_scale_factor=logits_scale_factor,
                         vocab_start=start, vocab_size=total, even=even, entropy=entropy, smoothing=smoothing)
    return stats, start, total


def _shard_signature(fn, op: str, *, extra=None, returns=None) -> frozenset[str]:
    """Gives a distributed loss its documented signature: its op's, less the hooks this layer fills, with the
    group(s) and the shard arguments (None: even shards); returns the keyword options it passes on."""
    hooks = ("row_stats", "vocab_start", "vocab_size", "document_sums")
    extra = {**(extra or {"tp_group": inspect.Parameter.empty}), "vocab_start": None, "vocab_size": None}
    fn.__signature__ = _schema.signature(op, drop=hooks, extra=extra, returns=returns)
    return _schema.keywords(op, drop=hooks)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, tp_group, vocab_start: int | None = None,
                  vocab_size: int | None = None, **options) -> torch.Tensor:
    """Vocabulary-parallel cross-entropy / z-loss (docs/distributed.md); see rl_losses.cross_entropy.

    Args:
        logits: (..., V_loc) this rank's contiguous shard of the vocabulary; target: (...) global label ids.
        tp_group: the vocabulary-parallel process group.
        label_weight: 1 for cross-entropy, 0 for the z-loss alone (rl_losses.z_loss).
        vocab_start, vocab_size: this shard's first global column and the global V, for uneven shards
            (default: even shards, rank·V_loc and world·V_loc).
    Returns: the loss, identical on every rank; backward gives this rank's shard of the gradient.
    """
    options = _options("cross_entropy", options, _CROSS_ENTROPY)

    def option(name):
        return _schema.option("cross_entropy", options, name)

    stats, start, total = _tp_setup("cross_entropy", logits, target, tp_group, option("logits_scale_factor"),
                                    vocab_start, vocab_size,
                                    smoothing=option("label_smoothing") != 0 and option("label_weight") != 0)
    return _ops.cross_entropy(logits, target, row_stats=stats, vocab_start=start, vocab_size=total, **options)[0]


_CROSS_ENTROPY = _shard_signature(cross_entropy, "cross_entropy")


def _with_entropy(op: str, options: dict) -> bool:
    # The entropy bonus needs Σp·x in the statistics, as the entropy metric does.
    return _schema.option(op, options, "compute_entropy") or _schema.option(op, options, "entropy_coefficient") != 0


def grpo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
              old_log_probs: torch.Tensor | None, *, tp_group, vocab_start: int | None = None,
              vocab_size: int | None = None, **options) -> PolicyLossOutput:
    """Vocabulary-parallel GRPO; see rl_losses.grpo_loss for the options, and cross_entropy above for the shard
    arguments. The loss and metrics are identical on every rank of ``tp_group``."""
    options = _options("grpo_loss", options, _GRPO)
    stats, start, total = _tp_setup("grpo_loss", logits, target, tp_group,
                                    _schema.option("grpo", options, "logits_scale_factor"), vocab_start, vocab_size,
                                    entropy=_with_entropy("grpo", options))
    out = _ops.grpo(logits, target, advantages, old_log_probs, row_stats=stats, vocab_start=start, vocab_size=total,
                    **options)
    return policy_output("grpo", out, options)


_GRPO = _shard_signature(grpo_loss, "grpo", returns=PolicyLossOutput)


def token_log_probs(logits: torch.Tensor, target: torch.Tensor, *, tp_group, vocab_start: int | None = None,
                    vocab_size: int | None = None, **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Vocabulary-parallel per-token log-probs and entropies (see rl_losses.token_log_probs, and
    cross_entropy above for the shard arguments). The outputs are identical on every rank of ``tp_group``;
    the backward gives this rank's shard of the gradient, from the upstream gradients of its own outputs
    (every rank must receive the same ones, as it does when the rest of the model is replicated over the
    group)."""
    options = _options("token_log_probs", options, _TOKEN_LOG_PROBS)
    compute_entropy = _schema.option("token_log_probs", options, "compute_entropy")
    stats, start, total = _tp_setup("token_log_probs", logits, target, tp_group,
                                    _schema.option("token_log_probs", options, "logits_scale_factor"), vocab_start,
                                    vocab_size, entropy=compute_entropy)
    log_probs, entropy = _ops.token_log_probs(logits, target, row_stats=stats, vocab_start=start, vocab_size=total,
                                              **options)
    return log_probs, entropy if compute_entropy else None


_TOKEN_LOG_PROBS = _shard_signature(token_log_probs, "token_log_probs")


# ---- sequence-data parallelism (GSPO) ----------------------------------------------------------------------
def _group_num_documents(document_index: torch.Tensor, sdp_group) -> int:
    # max(document_index) + 1 over the group: one small all-reduce and a host synchronisation.
    local = document_index.max() + 1 if document_index.numel() else document_index.new_zeros(())
    local = local.reshape(1).to(torch.int64).clamp_min(0)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=sdp_group)
    return int(local.item())


def _sdp_local_sums(op, stats, target, advantages, old_log_probs, document_index, label_counts, num_documents,
                    compute_entropy, checked, sum_options) -> torch.Tensor:
    """This rank's share of the SDP all-reduce: (num_documents [+1], len(GSPO_SUMS) + 1), see the module comment."""
    if checked and document_index.numel():
        high = int(document_index.max())
        if high >= num_documents:
            raise ValueError(f"{op}: document_index holds {high} but num_documents is {num_documents}")
    def stat(name):
        return stats[:, column(ROW_STATS, name)]

    lse = stat("max") + torch.log(stat("sum_exp"))
    labelled = target.reshape(-1) >= 0
    log_probs = torch.where(labelled, stat("label_logit") - lse, 0.0)
    # gspo_document_sums validates the per-token inputs (shapes, dtypes, devices) against target.
    counts = label_counts if label_counts is not None else torch.ones(target.shape, dtype=stats.dtype,
                                                                      device=stats.device)
    sums = _ops.gspo_document_sums(log_probs.view(target.shape), target, advantages, old_log_probs,
                                   document_index, counts, num_documents, **sum_options)
    doc = document_index.reshape(-1).to(torch.int64)
    mask = (labelled & (doc >= 0)).to(stats.dtype)
    weight = mask / counts.reshape(-1).to(stats.dtype).clamp_min(1)
    lp_sums = torch.zeros(num_documents, dtype=stats.dtype, device=stats.device).index_add_(
        0, torch.where(doc >= 0, doc, 0), weight * log_probs)
    payload = torch.cat([sums, lp_sums.unsqueeze(1)], dim=1)
    if compute_entropy:
        entropy = torch.where(mask > 0, lse - stat("sum_exp_x") / stat("sum_exp"), 0.0)
        row = torch.zeros(payload.shape[1], dtype=payload.dtype, device=payload.device)
        row[0], row[1] = entropy.sum(), mask.sum()
        payload = torch.cat([payload, row.unsqueeze(0)])
    return payload


def gspo_loss(logits: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
              old_log_probs: torch.Tensor | None, document_index: torch.Tensor, *, tp_group=None, sdp_group=None,
              vocab_start: int | None = None, vocab_size: int | None = None, **options) -> PolicyLossOutput:
    """GSPO over a vocabulary-parallel and/or sequence-data-parallel group (docs/math.md, docs/distributed.md); see
    rl_losses.gspo_loss, and cross_entropy above for the shard arguments.

    Under ``sdp_group``: ``document_index`` holds global document ids; ``label_counts`` (when given) are the
    counts of each token's whole document over the group; ``num_documents`` (the global number) defaults to
    the group's max(document_index)+1 (a host synchronisation). The loss is this rank's tokens' share (the
    sum over the group is the loss); the metrics are the group's. The options are rl_losses.gspo_loss's, the
    policy family's every one available here (a split document's rollout ratio, VESPO weight and
    importance-weighted KL sum ride in the same all-reduce as its ratio).
    """
    options = _options("gspo_loss", options, _GSPO)

    def option(name):
        return _schema.option("gspo", options, name)

    entropy = _with_entropy("gspo", options)
    op = "gspo_loss"
    tp = (op, logits, target, tp_group, option("logits_scale_factor"), vocab_start, vocab_size)
    if sdp_group is None:
        stats, start, total = _tp_setup(*tp, entropy=entropy)
        out = _ops.gspo(logits, target, advantages, old_log_probs, document_index, row_stats=stats, vocab_start=start,
                        vocab_size=total, **options)
        return policy_output("gspo", out, options)
    # The per-document sums need one advantage per token: broadcast per-sequence / per-document ones here.
    if advantages.shape != target.shape:
        if advantages.dim() < target.dim() and advantages.shape == target.shape[:advantages.dim()]:
            advantages = advantages.reshape(advantages.shape + (1,) * (target.dim() - advantages.dim()))
        else:
            advantages = advantages[torch.where(document_index >= 0, document_index, 0).long()]
        advantages = advantages.expand(target.shape)

    num_documents, label_counts = options.pop("num_documents", None), options.pop("label_counts", None)
    if num_documents is None:
        if torch.compiler.is_compiling():
            raise ValueError(f"{op}: under sdp_group and torch.compile, pass num_documents (its default needs a "
                             f"host synchronisation)")
        num_documents = _group_num_documents(document_index, sdp_group)
    if num_documents < 0:
        raise ValueError(f"{op}: num_documents must be >= 0, got {num_documents}")
    n_sums = len(GSPO_SUMS)
    # This rank's local work, up to the SDP all-reduce (the TP statistics first when there is a tp_group).
    checked = _host_checks(logits)
    error = None
    try:
        stats, start, total = _tp_setup(*tp, entropy=entropy)
        if stats is None:  # no tensor parallelism: this rank's statistics are the whole vocabulary's
            _check_labels(op, target, logits.shape[-1])
            stats = _ops.row_stats(logits.detach(), target, logits_scale_factor=option("logits_scale_factor"),
                                   entropy=entropy).reshape(-1, _STATS)
        # The options the sums depend on: gspo_document_sums' keyword arguments.
        sums_keywords = _schema.keywords("gspo_document_sums")
        sum_options = {k: v for k, v in options.items() if k in sums_keywords}
        payload = _sdp_local_sums(op, stats, target, advantages, old_log_probs, document_index, label_counts,
                                  num_documents, entropy, checked, sum_options)
    except (RuntimeError, ValueError) as e:
        error = _caught(e, checked)
        payload = torch.zeros(num_documents + entropy, n_sums + 1, dtype=_acc(logits.dtype), device=logits.device)
    if checked:
        flag = payload.new_zeros(1, payload.shape[1])
        flag[0, 0] = float(error is not None)
        payload = torch.cat([payload, flag])
    if payload.numel():
        group_sum(payload, sdp_group)
    if checked:
        _raise_if_failed(op, "sdp_group", payload[-1, 0].item() > 0, error)

    # Columns: GSPO_SUMS, then Σ w·lp (the new_logprobs metric).
    docs, count = payload[:num_documents], payload[:num_documents, column(GSPO_SUMS, "count")]
    doc = document_index.reshape(-1).to(torch.int64)
    if label_counts is None:
        # The sums were taken with w = 1: divide the w-weighted columns by each document's (now global) labelled
        # count: Σu(lp−old), Σu·A, Σw·lp, and under weighting "document" Σκ'·KL and (token modes) Σκ'·ω.
        divided = [column(GSPO_SUMS, "log_ratio"), column(GSPO_SUMS, "advantage"), n_sums]
        if option("weighting") == "document":
            divided.append(column(GSPO_SUMS, "kl_share"))
            if (option("rollout_correction") or "").startswith("token"):
                divided.append(column(GSPO_SUMS, "rollout_log_ratio"))
        scale = torch.ones_like(docs)
        scale[:, divided] = (1 / count.clamp_min(1)).unsqueeze(1)
        docs = docs * scale
        label_counts = count.index_select(0, torch.where(doc >= 0, doc, 0)).view(target.shape)
    out = _ops.gspo(logits, target, advantages, old_log_probs, document_index, num_documents=num_documents,
                    label_counts=label_counts, row_stats=stats, document_sums=docs[:, :n_sums].contiguous(),
                    vocab_start=start, vocab_size=total, **options)
    # The op's new_logprobs and entropy cover this rank's tokens only: the group's come from the all-reduce.
    new_logprobs = docs[:, n_sums].sum() / (count > 0).sum().clamp_min(1)
    result = policy_output("gspo", out, options)
    # The entropy bonus needs the sums; the metric is None where the op left it out (compute_metrics=False).
    group_entropy = (None if result.entropy is None
                     else payload[num_documents, 0] / payload[num_documents, 1].clamp_min(1))
    result = result._replace(new_logprobs=new_logprobs, entropy=group_entropy)
    geo_mean = option("loss_type") == "geo_mean"  # its clipped fractions are of tokens, not documents
    if (result.kl is not None or result.rollout_ratio_mean is not None or result.vespo_phi_seq_mean is not None
            or geo_mean):
        # The op's KL and rollout metrics (and geo_mean's clipped fractions) are means over this rank's labelled
        # tokens: one more small all-reduce of their sums makes them the group's (after the op: the
        # importance-weighted KL needs the ratios). The φ metric is already divided by the group's document
        # count: its sum over the ranks is the group's.
        n = ((target >= 0) & (document_index >= 0)).sum().to(out[0].dtype)
        means = [result.kl, result.rollout_ratio_mean, result.rollout_weight_mean, result.rollout_corrected_fraction]
        if geo_mean:
            means += [result.clipped_fraction_low, result.clipped_fraction_high]
        zero = n.new_zeros(())
        phi = result.vespo_phi_seq_mean
        sums = torch.stack([n] + [n * m if m is not None else zero for m in means] + [zero if phi is None else phi])
        group_sum(sums, sdp_group)
        group = [sums[k + 1] / sums[0].clamp_min(1) if m is not None else None for k, m in enumerate(means)]
        result = result._replace(kl=group[0], rollout_ratio_mean=group[1], rollout_weight_mean=group[2],
                                 rollout_corrected_fraction=group[3],
                                 vespo_phi_seq_mean=None if phi is None else sums[len(means) + 1])
        if geo_mean:
            result = result._replace(clipped_fraction_low=group[4], clipped_fraction_high=group[5])
    return result


_GSPO = _shard_signature(gspo_loss, "gspo", extra={"tp_group": None, "sdp_group": None}, returns=PolicyLossOutput)
