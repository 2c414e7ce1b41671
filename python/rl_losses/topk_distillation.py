"""Distillation from a sparse teacher (docs/distillation_dpo.md): the functional wrappers of
``torch.ops.rl_losses.topk_distillation`` and ``linear_topk_distillation`` (a forward KL, reverse KL or JSD over the
teacher's top-K ids per token), and the sampled-token KL estimators of on-policy distillation over the per-token
log-probs."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rl_losses import _schema
from rl_losses._inputs import _direct, _divisor, _options
from rl_losses.distributed import _tp_setup
from rl_losses.functional import _plain_lm_head, linear_token_log_probs, token_log_probs
from rl_losses.outputs import SampledKlOutput, TopkDistillationOutput

_ops = torch.ops.rl_losses

_TOPK_DOC = """
    Per token t with target_t >= 0, q = softmax(logits_scale_factor·logits_t) over the whole vocabulary and the
    teacher's K pairs (k_i, log p_i), P = Σ p_i, Q = Σ q_{k_i}: the divergence `kind` summed over buckets b,
        forward_kl   f = p log(p/q)                          (verl's forward_kl_topk with tail "none")
        reverse_kl   f = q log(q/p)
        jsd          f = β p log(p/m) + (1−β) q log(q/m), m = β p + (1−β) q   (β = 0: forward_kl, 1: reverse_kl)
    over the buckets `tail` makes of the ids:
        none         (p_i, q_{k_i})                          (the student's mass on the ids only)
        renormalize  (p_i/P, q_{k_i}/Q)                      (both sides renormalised; TRL's add_tail=False)
        tail         (p_i, q_{k_i}) and (1−P, 1−Q)           (the remaining mass as one more bucket, each side at
                                                             least 1 − e^{−1e-7}, as TRL's add_tail)
    and L = Σ_t ℓ_t / D. The student's rows are read once (twice for jsd: its statistics first), the gradient
    written once; nothing V-wide besides it.

    Args:
        target: (...) int64/int32, the sampled tokens; a negative id marks a token that does not count (its
            teacher entries are not read).
        teacher_ids: (..., K) int64, 1 <= K <= V, distinct within a row, any order.
        teacher_log_probs: (..., K) floating, the teacher's log-probs of those ids (mass at most 1 + 1e-3).
        tail: "none", "renormalize" or "tail". kind: "forward_kl", "reverse_kl" or "jsd". beta: JSD's β in [0, 1].
        logits_scale_factor: s > 0. divisor: D (default: the tokens that count).
    The teacher's values are checked on the host: on a GPU only with RL_LOSSES_CHECK_INPUTS=1 (a synchronisation).
    Returns: TopkDistillationOutput(loss, divergence, student_mass, teacher_mass), float32 (float64 for float64
        inputs); the per-token results detached, shaped like target.
"""


def topk_distillation_loss(logits: torch.Tensor, target: torch.Tensor, teacher_ids: torch.Tensor,
                           teacher_log_probs: torch.Tensor, *, tp_group=None, **options) -> TopkDistillationOutput:
    options = _options("topk_distillation_loss", options, _TOPK)
    if tp_group is not None:
        return _topk_tp(logits, target, teacher_ids, teacher_log_probs, tp_group, options)
    return TopkDistillationOutput(*_direct(_ops.topk_distillation)(logits, target, teacher_ids, teacher_log_probs,
                                                                  **options))


def _topk_tp(logits, target, teacher_ids, teacher_log_probs, tp_group, options) -> TopkDistillationOutput:
    # A vocabulary shard (even shards, as distillation_loss's): the whole vocabulary's row statistics
    # (distributed.tp_row_stats: in the batch-invariant mode its blocks, the same at every degree), and s·z at the
    # teacher's ids, each from the shard that holds the id and 0 from the others, so that their SUM over the group is
    # that value exactly, in any order. Every rank then computes the same K-wide sums, loss and outputs, and the
    # gradient of its own columns.
    op = "topk_distillation_loss"
    scale = _schema.option("topk_distillation", options, "logits_scale_factor")
    stats, start, total = _tp_setup(op, logits, target, tp_group, scale, None, None)
    width = logits.shape[-1]
    # Ids of another dtype, device or batch shape are not gathered from: the op, called with the caller's, refuses
    # them by name on every rank (each holds the same ids), after the collective every rank makes.
    local = teacher_ids.to(device=logits.device, dtype=torch.int64) - start
    if local.dim() == logits.dim() and local.shape[:-1] == logits.shape[:-1]:
        values = logits.detach().gather(-1, local.clamp(0, width - 1)).to(stats.dtype)
        if scale != 1:  # (x · 1 is x: no launch for the default)
            values = values * scale
        # −0.0 elsewhere: x + (−0.0) is x for every x, both zeros included.
        student_at_ids = torch.where((local >= 0) & (local < width), values, -0.0)
    else:
        student_at_ids = local.new_zeros(local.shape, dtype=stats.dtype)
    if student_at_ids.numel():
        dist.all_reduce(student_at_ids, op=dist.ReduceOp.SUM, group=tp_group)
    return TopkDistillationOutput(*_ops.topk_distillation(logits, target, teacher_ids, teacher_log_probs,
                                                         row_stats=stats, student_at_ids=student_at_ids,
                                                         vocab_start=start, vocab_size=total, **options))


topk_distillation_loss.__doc__ = """Fused divergence from a teacher's top-K log-probs (logits (..., V)
    float32/bfloat16/float16/float64; inplace_backward writes the gradient into them). Under ``tp_group``
    (vocabulary parallelism, even shards) logits is this rank's column shard, teacher_ids global ids, and every
    rank returns the same results and its shard's gradient.""" + _TOPK_DOC
_TOPK_DROP = ("row_stats", "student_at_ids", "vocab_start", "vocab_size")
topk_distillation_loss.__signature__ = _schema.signature("topk_distillation", drop=_TOPK_DROP,
                                                         extra={"tp_group": None}, returns=TopkDistillationOutput)
_TOPK = _schema.keywords("topk_distillation", drop=_TOPK_DROP)


def linear_topk_distillation_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                  teacher_ids: torch.Tensor, teacher_log_probs: torch.Tensor,
                                  **options) -> TopkDistillationOutput:
    options = _options("linear_topk_distillation_loss", options, _LINEAR_TOPK)
    weight = _plain_lm_head("linear_topk_distillation_loss", hidden, weight, options)
    op = _direct(_ops.linear_topk_distillation)
    return TopkDistillationOutput(*op(hidden, weight, target, teacher_ids, teacher_log_probs, **options))


linear_topk_distillation_loss.__doc__ = """topk_distillation_loss of ``hidden @ weight.T (+ bias)`` (the fused
    lm_head: chunk_size, strategy, weight_main_grad, skip_unlabelled as linear_cross_entropy's), the logits never
    whole; differentiable w.r.t. hidden, weight and bias.""" + _TOPK_DOC
linear_topk_distillation_loss.__signature__ = _schema.signature("linear_topk_distillation",
                                                                returns=TopkDistillationOutput)
_LINEAR_TOPK = _schema.keywords("linear_topk_distillation")

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def sampled_kl(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """verl's kl_penalty estimators of KL(student || teacher) at the sampled token, per token, from d = log q(y) −
    log p_teacher(y): k1/kl d; abs |d|; k2/mse d²/2; k3/low_var_kl e^{−d} + d − 1 (−d clamped to [−20, 20], the
    result to [−10, 10], as verl does). Differentiable w.r.t. log_probs."""
    d = log_probs - teacher_log_probs.detach().to(log_probs.dtype)
    if estimator in ("k1", "kl"):
        return d
    if estimator == "abs":
        return d.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * d.square()
    if estimator in ("k3", "low_var_kl"):
        r = torch.clamp(-d, min=-20, max=20)
        return torch.clamp(torch.exp(r) - r - 1, min=-10, max=10)
    raise ValueError(f"sampled_kl: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _sampled_kl_output(name, log_probs, labels, teacher_log_probs, estimator, divisor) -> SampledKlOutput:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"{name}: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if teacher_log_probs.shape != labels.shape:
        raise ValueError(f"{name}: teacher_log_probs has shape {tuple(teacher_log_probs.shape)} but labels has "
                         f"{tuple(labels.shape)}")
    keep = labels >= 0
    zero = torch.zeros_like(log_probs)
    # An unlabelled token's teacher value is not read (padding may hold anything).
    teacher = torch.where(keep, teacher_log_probs.detach().to(log_probs.dtype), zero)
    kl = torch.where(keep, sampled_kl(log_probs, teacher, estimator), zero)
    d = divisor if divisor is not None else keep.sum().clamp_min(1)
    advantages = torch.where(keep, teacher - log_probs, zero).detach()
    return SampledKlOutput(kl.sum() / d, kl.detach(), advantages)


def sampled_kl_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_log_probs: torch.Tensor, *,
                    estimator: str = "k1", temperature: float = 1.0, divisor=None, tp_group=None) -> SampledKlOutput:
    """The reverse-KL estimate of on-policy distillation at the sampled tokens (verl's
    compute_distillation_loss_reverse_kl_estimator): log q(y) from token_log_probs (one fused pass, differentiable),
    then sampled_kl elementwise; L = Σ_t kl_t / D over the labelled tokens (labels >= 0; D: their number by default).
    ``advantages`` = log p_teacher(y) − log q(y) (detached): the per-token reward to feed the policy losses.

    Args:
        logits: (..., V); labels: (...) sampled token ids (negative: ignored); teacher_log_probs: (...) the
            teacher's log-prob of each label. estimator: k1/kl, abs, k2/mse, k3/low_var_kl. temperature: T > 0.
        tp_group: vocabulary parallelism, as token_log_probs' (logits: this rank's shard; the results the same on
            every rank).
    Returns: SampledKlOutput(loss, kl, advantages).
    """
    log_probs, _ = token_log_probs(logits, labels, temperature=temperature, tp_group=tp_group)
    return _sampled_kl_output("sampled_kl_loss", log_probs, labels, teacher_log_probs, estimator,
                              None if divisor is None else _divisor(divisor))


def linear_sampled_kl_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           teacher_log_probs: torch.Tensor, *, estimator: str = "k1", temperature: float = 1.0,
                           divisor=None, **options) -> SampledKlOutput:
    """sampled_kl_loss of ``hidden @ weight.T (+ bias)`` over linear_token_log_probs (``options``: its fused
    lm_head options)."""
    log_probs, _ = linear_token_log_probs(hidden, weight, labels, temperature=temperature, **options)
    return _sampled_kl_output("linear_sampled_kl_loss", log_probs, labels, teacher_log_probs, estimator,
                              None if divisor is None else _divisor(divisor))
