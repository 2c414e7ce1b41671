"""Pure-PyTorch references of distillation from a sparse teacher (docs/distillation_dpo.md): the forward KL over
the teacher's top-K ids with its remaining mass treated by ``tail``, and the sampled-token KL estimators. Plain
autograd through the student's full log-softmax, in float64 for float64 inputs (the tests' references)."""
from __future__ import annotations

import torch

from rl_losses.outputs import TopkDistillationOutput
from rl_losses.reference import _scaled

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def topk_distillation_loss(logits, target, teacher_ids, teacher_log_probs, *, tail="none", logits_scale_factor=1.0,
                           divisor=None) -> TopkDistillationOutput:
    """Per token t with target_t >= 0: log q = log_softmax(s·z_t), gathered at the teacher's ids, and
        none         Σ p (log p − log q)
        renormalize  Σ (p/P)(log(p/P) − log(q/Q))
        tail         none + (1−P) log((1−P)/(1−Q))
    with P = Σ p, Q = Σ q over the ids; L = Σ_t ℓ_t / D (D: the labelled tokens by default)."""
    log_q_all = torch.log_softmax(_scaled(logits, logits_scale_factor), dim=-1)
    keep = target >= 0
    ids = torch.where(keep.unsqueeze(-1), teacher_ids, torch.zeros_like(teacher_ids))
    log_q = log_q_all.gather(-1, ids)
    log_p = torch.where(keep.unsqueeze(-1), teacher_log_probs.detach().to(log_q.dtype), torch.zeros_like(log_q))
    p = log_p.exp()
    big_p, big_q = p.sum(-1), log_q.exp().sum(-1)

    def plogr(w, a, b):  # Σ w·(a − b), w = 0 terms exactly 0
        return torch.where(w > 0, w * (a - b), torch.zeros_like(w)).sum(-1)

    if tail == "renormalize":
        log_pn = log_p - big_p.log().unsqueeze(-1)
        per_token = plogr(p / big_p.unsqueeze(-1), log_pn, log_q - torch.logsumexp(log_q, -1, keepdim=True))
    else:
        per_token = plogr(p, log_p, log_q)
        if tail == "tail":
            rest_p = (1 - big_p).clamp_min(0)
            rest_q = -torch.expm1(torch.logsumexp(log_q, -1))
            per_token = per_token + torch.where(rest_p > 0, rest_p * (rest_p.log() - rest_q.log()),
                                                torch.zeros_like(rest_p))
        elif tail != "none":
            raise ValueError(f"topk_distillation_loss: unknown tail {tail!r}")
    zero = torch.zeros_like(per_token)
    per_token = torch.where(keep, per_token, zero)
    if divisor is None:
        divisor = keep.sum().clamp_min(1)
    return TopkDistillationOutput(per_token.sum() / divisor, per_token.detach(),
                                  torch.where(keep, big_q, zero).detach(), torch.where(keep, big_p, zero).detach())


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
