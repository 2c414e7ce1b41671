"""Distillation against a teacher's logits: the functional wrapper of ``torch.ops.rl_losses.distillation`` and its
vocabulary-parallel form (docs/distillation_dpo.md gives the math and the options)."""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from rl_losses import _schema
from rl_losses.batch_invariance import mode_on, shard_sum, vocab_blocks
from rl_losses._checks_heads import DISTILL_KINDS
from rl_losses._inputs import _direct, _options
from rl_losses.distributed import _host_checks, group_max
from rl_losses._schema import DISTILL_STATS, DISTILL_STUDENT_SUMS, column
from rl_losses.outputs import DistillationOutput

_ops = torch.ops.rl_losses
_HOOKS = ("row_stats", "jsd_sums")


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, *, tp_group=None,
                      **options) -> DistillationOutput:
    """Fused distillation loss: a divergence between the student's and the teacher's next-token distributions.

    Q = softmax(logits_scale_factor·logits) (student), P = softmax(teacher_logits / temperature) (teacher); per
    token t:
        forward_kl     Σ P (log P − log Q)
        reverse_kl     Σ Q (log Q − log P)
        cross_entropy  −Σ P log Q              (Fast-LLM's default distillation loss; the forward KL's gradient)
        jsd            β·KL(P || M) + (1−β)·KL(Q || M), M = β·P + (1−β)·Q   (Liger-Kernel's generalised JSD:
                       β = 0 is the forward KL, β = 1 the reverse KL)
    and L = Σ_t mask_t·ℓ_t / D.

    Args:
        logits: (..., V) float32/bfloat16/float16/float64 student logits (under ``tp_group``: this rank's
            vocabulary shard).
        teacher_logits: (..., V) the teacher's logits, same shape, any floating dtype; no gradient flows to them.
        kind: "forward_kl", "reverse_kl", "cross_entropy" or "jsd". beta: JSD's β in [0, 1].
        temperature: T > 0 divides the teacher's logits. (Fast-LLM also multiplies the teacher's logits by its
            logits_scale_factor s: pass temperature = T / s to match it.)
        logits_scale_factor: s > 0, the student's softmax is over s·logits.
        loss_mask: (...) bool/int, tokens that count (default all). divisor: D (default: the tokens that count).
        inplace_backward: write the gradient into ``logits`` (zero extra memory).
        tp_group: vocabulary-parallel process group: both tensors hold this rank's columns; the loss is the
            global one on every rank and each rank gets its shard's gradient.
    Returns: DistillationOutput(loss, divergence): the loss (float32; float64 for float64 logits) and the
        detached per-token divergence ℓ_t, shaped like the batch.
    """
    options = _options("distillation_loss", options, _KEYWORDS)
    if tp_group is not None:
        return _distillation_tp(logits, teacher_logits, tp_group, options)
    op = _direct(_ops.distillation)
    return DistillationOutput(*op(logits, teacher_logits, **options))


distillation_loss.__signature__ = _schema.signature("distillation", drop=_HOOKS, extra={"tp_group": None},
                                                    returns=DistillationOutput)
_KEYWORDS = _schema.keywords("distillation", drop=_HOOKS)


def tp_distillation_stats(logits: torch.Tensor, teacher_logits: torch.Tensor, tp_group, **options) -> torch.Tensor:
    """The (N, 7) statistics of both softmaxes over the whole vocabulary (rl_losses._schema.DISTILL_STATS), identical
    on every rank of ``tp_group``: this shard's, then an all-reduce MAX of the two maxima and one SUM of the five
    sums, each rescaled to the global maximum of its side first. In the batch-invariant mode, over the vocabulary
    blocks (batch_invariance.vocab_blocks: the shards must be even there), gathered and added as one tree, so that
    the degree changes no bit. ``options``: distillation_stats' (temperature, logits_scale_factor)."""
    return _tp_stats(logits, _blocked(logits, teacher_logits, tp_group), tp_group, options)


def _blocked(logits: torch.Tensor, teacher_logits: torch.Tensor, tp_group):
    """(blocks, the student's rows, the teacher's) for the statistics ops: the batch-invariant mode's vocabulary blocks
    a rank reduces (batch_invariance.vocab_blocks; shards even), each a row of its own (all of the shard a row where
    blocks is 0). Made once a call, since a shard that is a column slice of wider logits is copied by the reshape."""
    world = dist.get_world_size(tp_group)
    blocks = vocab_blocks(logits.shape[-1] * world, world)
    def rows(t):
        return t.detach().reshape(-1, t.shape[-1] // blocks) if blocks else t.detach()
    return blocks, rows(logits), rows(teacher_logits)


def _tp_stats(logits: torch.Tensor, blocked, tp_group, options: dict) -> torch.Tensor:
    blocks, rows, teacher_rows = blocked
    stats = _ops.distillation_stats(rows, teacher_rows, **options)
    stats = stats.reshape(-1, max(blocks, 1), len(DISTILL_STATS))
    maxima = [column(DISTILL_STATS, "ms"), column(DISTILL_STATS, "mt")]
    block_max = stats[..., maxima]
    # In the mode each rank counts its blocks from its own width: shards of different widths would gather different
    # counts. With the host checks on, the MAX carries the widest and the narrowest shard, and every rank refuses
    # uneven shards (outside the mode they are taken).
    checked = mode_on() and _host_checks(logits)
    width = float(logits.shape[-1])
    global_max, extras = group_max(block_max.amax(dim=1) if blocks else block_max[:, 0], tp_group,
                                   [width, -width] if checked else None)
    if checked and extras[0] != -extras[1]:
        raise ValueError(f"distillation_loss: in the batch-invariant mode the vocabulary shards of tp_group must "
                         f"be even (from {int(-extras[1])} to {int(extras[0])} columns)")
    # A shard (block) whose values on one side are all -inf has sums 0 there (its own are NaN: -inf - -inf).
    factor = torch.where(block_max == float("-inf"), 0.0, torch.exp(block_max - global_max.unsqueeze(1)))
    sums = [k for k in range(len(DISTILL_STATS)) if k not in maxima]
    # Each sum rescales with the max of its exponent's side: the student's or the teacher's.
    side = [0 if DISTILL_STATS[k] in DISTILL_STUDENT_SUMS else 1 for k in sums]
    factor = factor[..., side]
    summed = shard_sum(torch.where(factor == 0, 0.0, stats[..., sums] * factor), tp_group, blocks)
    out = stats.new_empty(stats.shape[0], len(DISTILL_STATS))
    out[:, maxima] = global_max
    out[:, sums] = summed
    return out


def _distillation_tp(logits, teacher_logits, tp_group, options) -> DistillationOutput:
    def option(name):
        return _schema.option("distillation", options, name)

    kind, beta = option("kind"), option("beta")
    if kind not in DISTILL_KINDS:  # before any collective: the same error on every rank
        raise ValueError(f"distillation_loss: kind must be one of {DISTILL_KINDS}, got {kind!r}")
    softmax = {name: option(name) for name in _schema.keywords("distillation_stats")}
    blocked = _blocked(logits, teacher_logits, tp_group)
    stats = _tp_stats(logits, blocked, tp_group, softmax)
    jsd_sums = None
    if kind == "jsd" and 0.0 < beta < 1.0:
        blocks, rows, teacher_rows = blocked
        jsd_sums = _ops.distillation_jsd_sums(rows, teacher_rows,
                                              stats.repeat_interleave(blocks, dim=0) if blocks else stats, beta=beta,
                                              **softmax)
        jsd_sums = jsd_sums.reshape(-1, blocks, 2) if blocks else jsd_sums.reshape(-1, 1, 2).clone()
        jsd_sums = shard_sum(jsd_sums, tp_group, blocks)
        del rows, teacher_rows
    del blocked  # (a column slice's block rows are copies: freed before the op allocates its gradient)
    return DistillationOutput(*_ops.distillation(logits, teacher_logits, row_stats=stats, jsd_sums=jsd_sums,
                                                 **options))


_HALF = (torch.bfloat16, torch.float16)


def _accumulate_grad_weight(grad_w: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w (fp32, or fp64) += gradᵀ @ h. On CUDA, 16-bit operands go to a 16-bit GEMM with an fp32 output
    (ATen's addmm with out_dtype, CUDA only): converted to fp32 first they made an fp32 GEMM, which held linear JSD at
    N = 4096, H = 4096, V = 128256 to 105 ms on an H200 (Liger's fused linear JSD: 79 ms)."""
    if grad.is_cuda and grad_w.dtype == torch.float32 and grad.dtype in _HALF and h.dtype == grad.dtype:
        torch.ops.aten.addmm.dtype_out(grad_w, grad.t(), h, torch.float32, out=grad_w)
    else:
        grad_w.addmm_(grad.t().to(grad_w.dtype), h.to(grad_w.dtype))


# The rows of every GEMM in the mode, the fused lm_head's (csrc/common/batch_invariant.h).
_INVARIANT_ROWS = _ops._invariant_gemm_rows()


def _padded_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a's rows padded with zeros to _INVARIANT_ROWS (a GEMM of one shape whatever a's row count), from
    contiguous rows on a 16-byte boundary (a GEMM library also picks its kernel by the operands' alignment)."""
    if a.shape[0] == _INVARIANT_ROWS and a.is_contiguous() and a.data_ptr() % 16 == 0:
        return a @ b
    padded = a.new_zeros(_INVARIANT_ROWS, a.shape[1])
    padded[: a.shape[0]] = a
    return (padded @ b)[: a.shape[0]]


class _LinearDistillation(torch.autograd.Function):
    """Distillation of ``hidden @ weight.T`` computed a chunk of rows at a time: each chunk's logits and their
    gradient exist only while the chunk is processed, and turn at once into grad_hidden and grad_weight (fp32
    accumulator). The gradients are computed in the forward and scaled by the upstream gradient in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_logits, options, loss_mask, divisor, chunk_size):
        h = hidden.reshape(-1, hidden.shape[-1])
        teacher = teacher_logits.reshape(-1, teacher_logits.shape[-1])
        mask = None if loss_mask is None else loss_mask.reshape(-1)
        n = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype != torch.float64 else weight.dtype,
                             device=weight.device) if need_w else None
        total = None
        # In the batch-invariant mode every GEMM over rows takes _INVARIANT_ROWS rows (the last piece padded with
        # zeros), as the fused lm_head's do: a GEMM library picks its kernel, and a row's order of additions, by the
        # GEMM's shape, so a row's logits and grad_hidden would depend on how many rows share its chunk.
        invariant = mode_on()
        if invariant:
            chunk_size = _INVARIANT_ROWS
        matmul = _padded_matmul if invariant else torch.matmul
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            logits = matmul(h[rows], weight.t())
            loss, _, grad = _ops._distillation_forward(
                logits, teacher[rows], loss_mask=None if mask is None else mask[rows], divisor=divisor, row_stats=None,
                jsd_sums=None, compute_grad=need_h or need_w, **options)
            total = loss if total is None else total + loss
            if need_h:
                grad_h[rows] = matmul(grad, weight)
            if need_w:
                _accumulate_grad_weight(grad_w, grad, h[rows])
        ctx.save_for_backward(grad_h.view(hidden.shape) if need_h else None,
                              grad_w.to(weight.dtype) if need_w else None)
        return total if total is not None else h.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.saved_tensors
        scale = lambda g: None if g is None else (g * grad_output.to(g.dtype))  # noqa: E731
        return scale(grad_h), scale(grad_w), None, None, None, None, None


def linear_distillation_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor, *,
                             chunk_size: int = 4096, **options) -> torch.Tensor:
    """Distillation loss of the student's ``hidden @ weight.T`` against ``teacher_logits`` (see
    distillation_loss), chunk_size rows of student logits at a time: the student's (N, V) logits and their
    gradient are never materialised whole. Differentiable w.r.t. ``hidden`` (..., H) and ``weight`` (V, H).
    The default divisor (the tokens of ``loss_mask``) is read on the host once. In the batch-invariant mode the
    chunks are of 1024 rows whatever ``chunk_size`` (docs/consistency.md)."""
    options = _options("linear_distillation_loss", options, _LINEAR_KEYWORDS)
    loss_mask, divisor = options.pop("loss_mask", None), options.pop("divisor", None)
    if chunk_size < 1:
        raise ValueError(f"linear_distillation_loss: chunk_size must be >= 1, got {chunk_size}")
    if teacher_logits.shape[:-1] != hidden.shape[:-1] or teacher_logits.shape[-1] != weight.shape[0]:
        raise ValueError(f"linear_distillation_loss: teacher_logits has shape {tuple(teacher_logits.shape)} but the "
                         f"student's logits would have shape {tuple(hidden.shape[:-1]) + (weight.shape[0],)}")
    if divisor is None:
        divisor = float(max(int(loss_mask.bool().sum()) if loss_mask is not None else hidden[..., 0].numel(), 1))
    # The forward op takes every option: the defaults of those not given.
    options = {name: _schema.option("distillation", options, name) for name in ("kind", "beta", "temperature",
                                                                                "logits_scale_factor")}
    return _LinearDistillation.apply(hidden, weight, teacher_logits, options, loss_mask, float(divisor), chunk_size)


# Its options are distillation's, less inplace_backward; chunk_size is its own.
_LINEAR_DROP = _HOOKS + ("inplace_backward",)
_signature = _schema.signature("distillation", drop=_LINEAR_DROP, rename={"logits": "hidden"},
                               extra={"chunk_size": 4096})
_weight = inspect.Parameter("weight", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
linear_distillation_loss.__signature__ = _signature.replace(
    parameters=[*list(_signature.parameters.values())[:1], _weight, *list(_signature.parameters.values())[1:]])
_LINEAR_KEYWORDS = _schema.keywords("distillation", drop=_LINEAR_DROP)
