"""Pure-PyTorch references of distillation from a sparse teacher (docs/distillation_dpo.md): the forward KL, reverse
KL or JSD over the teacher's top-K ids with its remaining mass treated by ``tail``, and the sampled-token KL
estimators. Plain autograd through the student's full log-softmax, in float64 for float64 inputs (the tests'
references)."""
from __future__ import annotations

import math

import torch

from rl_losses.outputs import TopkDistillationOutput
from rl_losses.reference import _scaled

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def _divergence(kind, beta, log_p, log_q):
    """Σ over the last dim of f(p, q) (docs/distillation_dpo.md), a term exactly 0 where its weights are 0:
    forward_kl p log(p/q), reverse_kl q log(q/p), jsd β p log(p/m) + (1−β) q log(q/m) with m = β p + (1−β) q
    (β = 0: forward_kl, β = 1: reverse_kl, as distillation's)."""
    def xlogy(w, a, b):  # w·(a − b), 0 where w = 0
        return torch.where(w > 0, w * (a - b), torch.zeros_like(w))

    p, q = log_p.exp(), log_q.exp()
    if kind == "jsd" and beta == 0:
        kind = "forward_kl"
    elif kind == "jsd" and beta == 1:
        kind = "reverse_kl"
    if kind == "forward_kl":
        return xlogy(p, log_p, log_q).sum(-1)
    if kind == "reverse_kl":
        return xlogy(q, log_q, log_p).sum(-1)
    if kind != "jsd":
        raise ValueError(f"topk_distillation_loss: unknown kind {kind!r}")
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return (beta * xlogy(p, log_p, log_m) + (1 - beta) * xlogy(q, log_q, log_m)).sum(-1)


def topk_distillation_loss(logits, target, teacher_ids, teacher_log_probs, *, tail="none", kind="forward_kl",
                           beta=0.5, logits_scale_factor=1.0, divisor=None) -> TopkDistillationOutput:
    """Per token t with target_t >= 0: log q = log_softmax(s·z_t), gathered at the teacher's ids, and the
    divergence `kind` (f summed over buckets) over
        none         the K ids, (p_i, q_i)
        renormalize  the K ids, (p_i/P, q_i/Q)
        tail         the K ids and one more bucket (1−P, 1−Q), each at least 1 − e^{−1e-7} (TRL's clamp)
    with P = Σ p, Q = Σ q over the ids; L = Σ_t ℓ_t / D (D: the labelled tokens by default)."""
    log_q_all = torch.log_softmax(_scaled(logits, logits_scale_factor), dim=-1)
    keep = target >= 0
    ids = torch.where(keep.unsqueeze(-1), teacher_ids, torch.arange(teacher_ids.shape[-1], device=teacher_ids.device))
    log_q = log_q_all.gather(-1, ids)
    # An unlabelled row's teacher is the student itself (finite terms: no NaN through the masked branch).
    log_p = torch.where(keep.unsqueeze(-1), teacher_log_probs.detach().to(log_q.dtype), log_q.detach())
    big_p, log_big_q = log_p.exp().sum(-1), torch.logsumexp(log_q, -1)
    if tail == "renormalize":
        log_p, log_q = log_p - big_p.log().unsqueeze(-1), log_q - log_big_q.unsqueeze(-1)
    elif tail == "tail":
        # TRL's add_tail_bucket on each side: log(1 − e^{min(log mass, −1e-7)}) (the clamp stops the gradient).
        def tail_of(log_mass):
            return torch.log(-torch.expm1(log_mass.clamp(max=-1e-7))).unsqueeze(-1)

        log_p = torch.cat([log_p, tail_of(big_p.log())], -1)
        log_q = torch.cat([log_q, tail_of(log_big_q)], -1)
    elif tail != "none":
        raise ValueError(f"topk_distillation_loss: unknown tail {tail!r}")
    per_token = _divergence(kind, beta, log_p, log_q)
    zero = torch.zeros_like(per_token)
    per_token = torch.where(keep, per_token, zero)
    if divisor is None:
        divisor = keep.sum().clamp_min(1)
    return TopkDistillationOutput(per_token.sum() / divisor, per_token.detach(),
                                  torch.where(keep, log_big_q.exp(), zero).detach(),
                                  torch.where(keep, big_p, zero).detach())


def sampled_kl(log_probs, teacher_log_probs, estimator="k1"):
    """verl's kl_penalty of log q(y) − log p_teacher(y) at the sampled token y, per token (the float64 reference:
    written out here, independent of the wrapper's)."""
    d = log_probs - teacher_log_probs
    if estimator in ("k1", "kl"):
        return d
    if estimator == "abs":
        return d.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * d * d
    if estimator in ("k3", "low_var_kl"):
        r = (-d).clamp(-20, 20)
        return (r.exp() - r - 1).clamp(-10, 10)
    raise ValueError(f"sampled_kl: unknown estimator {estimator!r}")
