"""Pure-PyTorch implementation of every op (docs/math.md), differentiable through ordinary autograd.

It is the ground truth of the tests (called on float64 inputs) and the ``use_cuda_kernel=False`` path of the
configs. It shares no code with the C++/CUDA ops: every formula is written again here from docs/math.md, in the
plainest PyTorch. It materialises N×V temporaries freely; it is not meant to be fast.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from rl_losses import reference_rejection, reference_verl
from rl_losses.outputs import DistillationOutput, DpoOutput, FusedHeadOutput, PolicyLossOutput  # noqa: F401
from rl_losses.reference_sampler import filtered
from rl_losses.reference_vespo import _rollout_weight, _sequence_sum, _vespo_weights


class Policy(NamedTuple):
    """The policy family's options (docs/policy_losses.md; their defaults are the ops' schemas',
    tests/test_schema.py), which grpo_loss and gspo_loss take by keyword and hand on to their formulas as one."""

    loss_type: str = "ppo_clip"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    dro_beta: float | None = None
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
    rollout_correction: str | None = None
    rollout_cap: float = 3.0
    rollout_mask_bounds: tuple[float, float] | None = None
    kl_estimator: str = "k3"
    kl_importance_weighted: bool = False
    entropy_coefficient: float = 0.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: str | None = None
    bypass_mode: bool = False


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scaled(logits: torch.Tensor, logits_scale_factor: float) -> torch.Tensor:
    return logits.to(_work_dtype(logits)) * logits_scale_factor


def _log_softmax(logits, logits_scale_factor, target, top_k, top_p, min_p):
    # log softmax(s·z), renormalised over the sampler's kept set where top_k / top_p / min_p are given.
    x = filtered(_scaled(logits, logits_scale_factor), target, top_k=top_k, top_p=top_p, min_p=min_p)
    return torch.log_softmax(x, dim=-1)


def _label_logprob(logp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    mask = target >= 0
    lp = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, lp, torch.zeros_like(lp))


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


def cross_entropy(logits, target, *, logits_scale_factor=1.0, label_smoothing=0.0, z_loss_factor=0.0,
                  reduction="mean", divisor=None):
    """Cross-entropy (docs/math.md): the arguments and result of rl_losses.cross_entropy, without
    ``inplace_backward`` and ``tp_group``."""
    x = _scaled(logits, logits_scale_factor)
    mask = target >= 0
    lse = torch.logsumexp(x, dim=-1)
    x_label = x.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - label_smoothing) * (lse - x_label) + z_loss_factor * lse**2
    if label_smoothing:  # absent, not 0·(lse - mean x), which is NaN where a logit is -inf
        per_token = per_token + label_smoothing * (lse - x.mean(-1))
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token
    if divisor is None:
        divisor = mask.sum().clamp_min(1) if reduction == "mean" else 1
    return per_token.sum() / divisor


def z_loss(logits, *, loss_mask=None, logits_scale_factor=1.0, divisor=None):
    """Z-loss alone (docs/math.md): the arguments and result of rl_losses.z_loss, without ``tp_group``."""
    lse = torch.logsumexp(_scaled(logits, logits_scale_factor), dim=-1)
    mask = torch.ones_like(lse, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    per_token = torch.where(mask, lse**2, torch.zeros_like(lse))
    if divisor is None:
        divisor = mask.sum().clamp_min(1)
    return per_token.sum() / divisor


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.exp() - log_ratio - 1


def _per_sequence(t: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor | None:
    # (B,) advantages for (B, T) labels: one value per sequence, broadcast over its tokens.
    if t is None or t.dim() >= target.dim() or t.shape != target.shape[:t.dim()]:
        return t
    return t.reshape(tuple(t.shape) + (1,) * (target.dim() - t.dim())).expand(target.shape)


def _kl_estimate(estimator: str, lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if estimator == "k1":
        return lp - ref
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    return _k3(ref - lp)


def _rollout_corrected(per_token, p: Policy, log_rho, mask, sequence):
    """The surrogate times the detached rollout weight ω (vespo folds ω into φ instead), with ρ and ω (None, None
    without a correction); sequence modes take ρ_s from the sequence's summed log-ratios."""
    if p.rollout_correction is None:
        return per_token, None, None
    if p.rollout_correction.startswith("sequence"):
        log_rho = _sequence_sum(log_rho, mask, sequence)
    rho, weight = _rollout_weight(p, log_rho)
    return (per_token if p.loss_type == "vespo" else per_token * weight.detach()), rho, weight


def _rows_as_sequences(target):
    # The rows of the labels' leading dimensions are the sequences.
    rows = torch.arange(target.numel() // target.shape[-1], device=target.device)
    return rows.reshape(target.shape[:-1]).unsqueeze(-1).expand(target.shape)


def grpo_loss(logits, target, advantages, old_log_probs=None, *, epsilon_low=0.2, epsilon_high=0.2, delta=None,
              ref_log_probs=None, beta=0.0, loss_weights=None, divisor=None, logits_scale_factor=1.0,
              label_counts=None, compute_entropy=False, compute_metrics=True, rollout_log_probs=None,
              document_index=None, num_documents=None, aggregation=None, top_k=None, top_p=None, min_p=None,
              **policy) -> PolicyLossOutput:
    """GRPO per token with the policy family of docs/policy_losses.md (``policy``: the options of Policy); see
    PolicyLossOutput. ``num_documents`` only bounds ``document_index``'s ids (the sums per sequence do not depend
    on it). ``rollout_rs`` rejects tokens before everything but the sums of a sequence-level rollout correction;
    ``aggregation`` is a preset over the kept labels."""
    p = Policy(**policy)
    if num_documents is not None and document_index is not None and document_index.numel():
        if int(document_index.max()) >= num_documents:
            raise ValueError(f"grpo: document_index holds {int(document_index.max())} but num_documents is "
                             f"{num_documents}")
    logp = _log_softmax(logits, logits_scale_factor, target, top_k, top_p, min_p)
    sequence = document_index if document_index is not None else (
        _rows_as_sequences(target) if target.dim() >= 2 else None)
    labelled = target >= 0  # before rejection: the sums of a sequence-level rollout correction (verl's rollout_is)
    old_log_probs, judged = reference_rejection.bypass_inputs(p.bypass_mode, old_log_probs, rollout_log_probs,
                                                              _label_logprob(logp, target))
    given_target, target = target, reference_rejection.rejected_labels(
        target, judged, rollout_log_probs, sequence, p.rollout_rs, p.rollout_rs_threshold)
    mask = target >= 0
    maskf = mask.to(logp.dtype)
    lp = _label_logprob(logp, target)
    adv = _per_sequence(advantages, target).to(logp.dtype)
    old = lp.detach() if old_log_probs is None else old_log_probs.to(logp.dtype)
    ratio = torch.exp(lp - old)
    selected = reference_verl.cov_selection(p, old, lp.detach(), adv, mask, epsilon_low, epsilon_high)  # one draw for both uses
    log_rho = None if p.rollout_correction is None else old.detach() - rollout_log_probs.to(logp.dtype)
    phi = share = None
    if p.loss_type == "vespo":
        phi, share = _vespo_weights(p, lp.detach(), old, adv, mask, sequence, log_rho, old_log_probs is None)
        per_token = -(phi * adv) * lp
    else:
        per_token = _surrogate(p, ratio, adv, lp, epsilon_low, epsilon_high, delta, old, selected)
    per_token, rho, weight = _rollout_corrected(per_token, p, log_rho, labelled, sequence)
    kl = None
    if ref_log_probs is not None:
        kl = _kl_estimate(p.kl_estimator, lp, ref_log_probs.to(logp.dtype))
        if p.kl_importance_weighted:
            kl = kl * ratio  # differentiated through the ratio too, as TRL's and Liger's
        if beta != 0.0:
            per_token = per_token + beta * kl
    entropy_tok = _entropy(logp)
    if p.entropy_coefficient != 0.0:
        per_token = per_token - p.entropy_coefficient * entropy_tok
    if aggregation is not None:
        loss_weights, divisor = reference_rejection.aggregation_weights(aggregation, maskf, sequence, loss_weights,
                                                                        divisor)
    weights = maskf if loss_weights is None else torch.where(mask, loss_weights.to(logp.dtype), 0.0)
    if divisor is None:
        divisor = mask.sum().clamp_min(1)
    # A token of weight 0 does not count: an exact 0, even where its own terms are not finite.
    loss = torch.where(mask & (weights != 0), weights * per_token, 0.0).sum() / divisor

    with torch.no_grad():
        n_lab = mask.sum().clamp_min(1)

        def mean(x):
            return torch.where(mask, x, 0.0).sum() / n_lab

        if label_counts is not None and p.rollout_rs is not None:
            label_counts = reference_rejection.recounted(label_counts.to(logp.dtype), given_target, target, sequence)
        counts = maskf if label_counts is None else label_counts.to(logp.dtype).clamp_min(1)
        doc_weight = torch.where(mask, 1 / counts, 0.0)
        new_logprobs = (doc_weight * lp).sum() / doc_weight.sum().clamp_min(1e-30)
        low_flag, high_flag = _clip_flags(p, ratio, adv, epsilon_low, epsilon_high, delta, old, lp, selected)
        low, high = mean(low_flag.to(logp.dtype)), mean(high_flag.to(logp.dtype))
        kl_old = mean(_k3(old - lp))
        with_entropy = compute_entropy or p.entropy_coefficient != 0.0
        entropy = mean(entropy_tok) if with_entropy else None
        ratio_mean = mean(ratio)
        kl_mean = mean(kl) if kl is not None else None
        rollout = (None, None, None) if rho is None else (
            mean(rho), mean(weight), mean((weight != rho).to(logp.dtype)))
        phi_mean = None if phi is None else (torch.where(mask, phi * share, 0.0).sum()
                                             / torch.where(mask, share, 0.0).sum().clamp_min(1))
    return _metrics_kept(PolicyLossOutput(loss, new_logprobs.detach(), low, high, kl_old, entropy, lp.detach(),
                                          ratio_mean, None, kl_mean, *rollout, phi_mean, loss_type=p.loss_type),
                         compute_metrics, compute_entropy)


def _metrics_kept(out: PolicyLossOutput, compute_metrics: bool, compute_entropy: bool) -> PolicyLossOutput:
    """Without compute_metrics: every metric None but new_logprobs and the entropy asked for."""
    if compute_metrics:
        return out
    gone = ("clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean", "kl", "rollout_ratio_mean",
            "rollout_weight_mean", "rollout_corrected_fraction", "vespo_phi_seq_mean")
    return out._replace(**dict.fromkeys(gone), entropy=out.entropy if compute_entropy else None)


# The loss types over each token's own log-probs (verl's gpg, dro, dppo_tv, dppo_kl): reference_verl's formulas.
TOKEN_LOG_PROB_LOSS_TYPES = ("gpg", "dro", "dppo_tv", "dppo_kl")


def _verl_options(p: Policy, epsilon_low, epsilon_high):
    if p.loss_type == "dro":
        return dict(beta=p.dro_beta)
    if p.loss_type.startswith("dppo"):
        return dict(clip_low=epsilon_low, clip_high=epsilon_high, clip_ratio_c=p.clip_ratio_c)
    return {}


def _surrogate(p: Policy, ratio, adv, lp, epsilon_low, epsilon_high, delta=None, old=None, selected=None):
    """The per-token objective of each loss type at ratio r (docs/policy_losses.md; vespo's: _vespo_weights; the
    per-token loss types of verl's menu read the old log-probs ``old`` too, clip_cov and kl_cov their subset
    ``selected`` of reference_verl.cov_selection)."""
    if p.loss_type == "kl_cov":
        return -adv * ratio + torch.where(selected, p.ppo_kl_coef * (lp - old).abs(), 0.0)
    if p.loss_type in TOKEN_LOG_PROB_LOSS_TYPES:
        return reference_verl.PER_TOKEN[p.loss_type](old, lp, adv, torch.ones_like(lp),
                                                     **_verl_options(p, epsilon_low, epsilon_high))[0]
    if p.loss_type == "geo_mean":  # the clip is in the ratio (gspo_loss)
        return -adv * ratio
    if p.loss_type == "cispo":
        return -ratio.clamp(max=epsilon_high).detach() * adv * lp
    if p.loss_type == "sapo":
        # (full_like: torch.where of two Python floats would round them to float32)
        tau = torch.where(adv > 0, torch.full_like(ratio, p.sapo_temperature_pos),
                          torch.full_like(ratio, p.sapo_temperature_neg))
        return -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    capped = ratio if delta is None else ratio.clamp(max=delta)
    loss = -torch.minimum(capped * adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv)
    return torch.where(selected, 0.0, loss) if p.loss_type == "clip_cov" else loss


def _clip_flags(p: Policy, ratio, adv, epsilon_low, epsilon_high, delta=None, old=None, lp=None, selected=None):
    # TRL's clip_ratio flags, on its coef_1 after the two-sided clip min(r, δ); dppo's: outside its trust region,
    # "high" where A > 0; clip_cov's: its subset, "high".
    if p.loss_type == "clip_cov":
        return torch.zeros_like(selected), selected
    if p.loss_type.startswith("dppo"):
        outside = ~reference_verl.dppo_trust_region(p.loss_type, old, lp, adv, clip_low=epsilon_low,
                                                    clip_high=epsilon_high)
        return outside & ~(adv > 0), outside & (adv > 0)
    if p.loss_type == "ppo_clip":
        capped = ratio if delta is None else ratio.clamp(max=delta)
        return (capped < 1 - epsilon_low) & (adv < 0), (capped > 1 + epsilon_high) & (adv > 0)
    high = (ratio > epsilon_high) & (adv > 0) if p.loss_type == "cispo" else torch.zeros_like(ratio, dtype=torch.bool)
    return torch.zeros_like(ratio, dtype=torch.bool), high


def gspo_loss(logits, target, advantages, old_log_probs, document_index, *, num_documents=None,
              label_counts=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, weighting="document",
              token_advantages=False, divisor=None, logits_scale_factor=1.0, compute_entropy=False,
              compute_metrics=True, ref_log_probs=None, beta=0.0, rollout_log_probs=None, top_k=None, top_p=None,
              min_p=None, **policy) -> PolicyLossOutput:
    """GSPO: sequence-level geometric-mean ratio over packed documents (vectorised with index_add), with
    the policy family of docs/policy_losses.md at the sequence ratio (``policy``: the options of Policy; vespo: φ
    of the document's summed log-ratios; the importance-weighted KL differentiated through R_s)."""
    p = Policy(**policy)
    logp = _log_softmax(logits, logits_scale_factor, target, top_k, top_p, min_p)
    old_log_probs, judged = reference_rejection.bypass_inputs(p.bypass_mode, old_log_probs, rollout_log_probs,
                                                              _label_logprob(logp, target))
    given_target, target = target, reference_rejection.rejected_labels(
        target, judged, rollout_log_probs, document_index, p.rollout_rs, p.rollout_rs_threshold)
    if label_counts is not None and p.rollout_rs is not None:
        label_counts = reference_rejection.recounted(label_counts.to(logp.dtype), given_target, target, document_index)
    dt = logp.dtype
    doc = document_index.reshape(-1).long()
    mask = ((target >= 0).reshape(-1)) & (doc >= 0)
    maskf = mask.to(dt)
    # Tokens outside the mask (unlabelled, or padding of document -1) count nowhere, even with non-finite logits.
    lp = torch.where(mask, _label_logprob(logp, target).reshape(-1), 0.0)
    if num_documents is None:
        num_documents = int(doc.max().item()) + 1 if doc.numel() > 0 else 0
    safe_doc = torch.where(doc >= 0, doc, 0)
    advantages = _per_sequence(advantages, target)
    if advantages.shape != target.shape:  # one advantage per document
        advantages = advantages[safe_doc]
    adv = advantages.reshape(-1).to(dt)
    old = lp.detach() if old_log_probs is None else old_log_probs.reshape(-1).to(dt)
    if label_counts is None:
        per_doc_count = torch.zeros(num_documents, dtype=dt, device=lp.device).index_add_(0, safe_doc, maskf)
        counts = per_doc_count[safe_doc]
    else:
        counts = label_counts.reshape(-1).to(dt)
    u = torch.where(mask, 1 / counts.clamp_min(1), 0.0)
    zeros = torch.zeros(num_documents, dtype=dt, device=lp.device)
    token_log_ratio = lp - old
    geo_mean = p.loss_type == "geo_mean"
    if geo_mean:  # GMPO: each token's log-ratio clipped inside the mean (verl's geo_mean)
        token_log_ratio, outside = reference_verl.geo_mean_log_ratio(token_log_ratio, adv, epsilon_low, epsilon_high)
    log_ratio = zeros.index_add(0, safe_doc, torch.where(mask, u * token_log_ratio, 0.0))
    adv_mean = zeros.index_add(0, safe_doc, (u * adv).detach())
    has_label = zeros.index_add(0, safe_doc, maskf) > 0
    ratio = log_ratio.exp()
    # Each token carries its share κ_t·f(R_s, A) of its document's loss, κ_t = u_t ("document": the shares of a
    # document sum to f_s) or m_t ("token": they sum to N_s·f_s). With label_counts that are only part of a
    # document (it is split over sequence-data-parallel ranks), a call's loss is its tokens' share.
    if token_advantages:
        # GSPO-token: each token's own advantage, and a ratio whose gradient flows through its own log-prob.
        tok_ratio = (lp - lp.detach()).exp() * ratio[safe_doc].detach()
        tok_adv = adv
    else:
        tok_ratio = ratio[safe_doc]
        tok_adv = adv_mean[safe_doc]
    log_rho = None if p.rollout_correction is None else old.detach() - rollout_log_probs.reshape(-1).to(dt)
    phi = share = None
    if p.loss_type == "vespo":
        phi, share = _vespo_weights(p, lp.detach(), old, tok_adv.detach(), mask, doc, log_rho, old_log_probs is None)
        f_tok = -(phi * tok_adv) * lp
    else:
        # ppo_clip's δ caps R_s in the unclipped term only (TRL's coef_1 = clamp(coef_1, max=δ) after coef_2).
        f_tok = _surrogate(p, tok_ratio, tok_adv, lp, epsilon_low, epsilon_high, delta)
    f_tok, rho, weight = _rollout_corrected(f_tok, p, log_rho, mask, doc)
    kl = None
    if ref_log_probs is not None:
        kl = _kl_estimate(p.kl_estimator, lp, ref_log_probs.reshape(-1).to(dt))
        if p.kl_importance_weighted:
            # Differentiated through the ratio (as GRPO's): R_s reaches every token of the document; GSPO-token's
            # ratio only its own token.
            kl = kl * tok_ratio
        if beta != 0.0:
            f_tok = f_tok + beta * kl
    entropy_tok = _entropy(logp).reshape(-1)
    if p.entropy_coefficient != 0.0:
        f_tok = f_tok - p.entropy_coefficient * entropy_tok
    kappa = maskf if weighting == "token" else u
    if divisor is None:
        divisor = has_label.sum().clamp_min(1)
    loss = torch.where(mask, kappa * f_tok, 0.0).sum() / divisor

    with torch.no_grad():
        n_docs = has_label.sum().clamp_min(1)
        n_lab = mask.sum().clamp_min(1)

        def mean(x):
            return torch.where(mask, x, 0.0).sum() / n_lab

        new_logprobs = zeros.index_add(0, safe_doc, u * lp).sum() / n_docs
        low_flag, high_flag = _clip_flags(p, ratio, adv_mean, epsilon_low, epsilon_high, delta)
        low = (low_flag & has_label).to(dt).sum() / n_docs
        high = (high_flag & has_label).to(dt).sum() / n_docs
        if geo_mean:  # verl's clipped fractions: per token
            low, high = mean((outside & (adv < 0)).to(dt)), mean((outside & (adv > 0)).to(dt))
        kl_old = torch.where(has_label, _k3(-log_ratio), 0.0).sum() / n_docs
        with_entropy = compute_entropy or p.entropy_coefficient != 0.0
        entropy = mean(entropy_tok) if with_entropy else None
        ratio_mean = torch.where(has_label, ratio, 0.0).sum() / n_docs
        kl_mean = mean(kl) if kl is not None else None
        rollout = (None, None, None) if rho is None else (
            mean(rho), mean(weight), mean((weight != rho).to(dt)))
        phi_mean = None if phi is None else torch.where(mask, phi * u, 0.0).sum() / n_docs
    return _metrics_kept(PolicyLossOutput(loss, new_logprobs, low, high, kl_old, entropy,
                                          torch.where(mask, lp, 0.0).detach().reshape(target.shape), ratio_mean,
                                          ratio.detach(), kl_mean, *rollout, phi_mean, loss_type=p.loss_type),
                         compute_metrics, compute_entropy)


def distillation_loss(logits, teacher_logits, *, kind="forward_kl", beta=0.5, temperature=1.0,
                      logits_scale_factor=1.0, loss_mask=None, divisor=None) -> DistillationOutput:
    """Divergence of the student's softmax(s·z) from the teacher's softmax(z_teacher / T), per token, summed over
    the masked-in tokens and divided by D (default: their number). docs/distillation_dpo.md gives the kinds;
    ``jsd`` is Liger-Kernel's generalised JSD, with β = 0 the forward KL and β = 1 the reverse KL."""
    log_q = torch.log_softmax(_scaled(logits, logits_scale_factor), dim=-1)
    log_p = torch.log_softmax(teacher_logits.detach().to(log_q.dtype) / temperature, dim=-1)
    q, p = log_q.exp(), log_p.exp()

    def plogr(w, a, b):  # Σ w·(a − b), with w = 0 terms exactly 0
        return torch.where(w > 0, w * (a - b), torch.zeros_like(w)).sum(-1)

    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    elif kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "forward_kl":
        per_token = plogr(p, log_p, log_q)
    elif kind == "reverse_kl":
        per_token = plogr(q, log_q, log_p)
    elif kind == "cross_entropy":
        per_token = -torch.where(p > 0, p * log_q, torch.zeros_like(p)).sum(-1)
    elif kind == "jsd":
        log_m = torch.logaddexp(log_p + torch.log(torch.tensor(beta, dtype=log_q.dtype)),
                                log_q + torch.log1p(torch.tensor(-beta, dtype=log_q.dtype)))
        per_token = beta * plogr(p, log_p, log_m) + (1 - beta) * plogr(q, log_q, log_m)
    else:
        raise ValueError(f"distillation_loss: unknown kind {kind!r}")
    mask = torch.ones(per_token.shape, dtype=torch.bool, device=per_token.device) if loss_mask is None \
        else loss_mask.bool()
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if divisor is None:
        divisor = mask.sum().clamp_min(1)
    return DistillationOutput(per_token.sum() / divisor, per_token.detach())


def dpo_loss(logits, target, document_index, pairs, reference_chosen_log_probs, reference_rejected_log_probs, *,
             beta=1.0, logits_scale_factor=1.0, divisor=None) -> DpoOutput:
    """DPO over packed documents: π_s = Σ of the labelled log-probs of document s; per pair k = (c, r),
    h_k = β·((π_c − ref_c) − (π_r − ref_r)), L = −Σ_k log σ(h_k) / D (D = the number of pairs by default)."""
    logp = torch.log_softmax(_scaled(logits, logits_scale_factor), dim=-1)
    doc = document_index.reshape(-1).long()
    mask = (target.reshape(-1) >= 0) & (doc >= 0)
    lp = torch.where(mask, _label_logprob(logp, target).reshape(-1), 0.0)
    pairs = pairs.long()
    n_pairs = pairs.shape[0]
    sums = torch.zeros(2 * n_pairs, dtype=lp.dtype, device=lp.device).index_add(0, torch.where(doc >= 0, doc, 0), lp)
    reward_c = beta * (sums[pairs[:, 0]] - reference_chosen_log_probs.to(lp.dtype))
    reward_r = beta * (sums[pairs[:, 1]] - reference_rejected_log_probs.to(lp.dtype))
    losses = -torch.nn.functional.logsigmoid(reward_c - reward_r)
    loss = losses.sum() / (n_pairs if divisor is None else divisor)
    with torch.no_grad():
        return DpoOutput(loss, reward_c.mean(), reward_r.mean(), (reward_c > reward_r).to(lp.dtype).mean(),
                         (reward_c - reward_r).mean(), lp.detach().reshape(target.shape), sums.detach())


def fused_head_loss(logits, target, *, label_weight=0.0, label_smoothing=0.0, label_divisor=None, z_loss_weight=0.0,
                    z_loss_divisor=None, z_loss_mask=None, grpo_weight=0.0, advantages=None, old_log_probs=None,
                    ref_log_probs=None, loss_weights=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0,
                    grpo_divisor=None, gspo_weight=0.0, document_index=None, num_documents=None, label_counts=None,
                    weighting="document", gspo_divisor=None, logits_scale_factor=1.0, rollout_log_probs=None,
                    distillation_weight=0.0, teacher_logits=None, kind="forward_kl", distillation_beta=0.5,
                    temperature=1.0, distillation_mask=None, distillation_divisor=None, **policy) -> FusedHeadOutput:
    """The weighted sum of the separate losses: CE and GRPO over the labelled tokens, the z-loss over
    ``z_loss_mask`` (every token without one), GSPO over the documents of ``document_index``; both policy terms
    with ``rollout_log_probs`` and the options of Policy (``policy``) as grpo_loss and gspo_loss take them; the
    distillation term distillation_loss over ``distillation_mask`` (every token without one), its β
    ``distillation_beta``. A term of weight 0 is None."""
    s = logits_scale_factor
    zero = logits.new_zeros((), dtype=_work_dtype(logits))
    label = cross_entropy(logits, target, logits_scale_factor=s, label_smoothing=label_smoothing,
                          divisor=label_divisor) if label_weight else zero
    z = z_loss(logits, loss_mask=z_loss_mask, logits_scale_factor=s, divisor=z_loss_divisor) if z_loss_weight else zero
    # The GRPO term's sequence rejection groups tokens by document_index where given (as grpo_loss does).
    sequences = dict(document_index=document_index, num_documents=num_documents) \
        if str(policy.get("rollout_rs") or "").startswith("seq") else {}
    grpo = grpo_loss(logits, target, advantages, old_log_probs, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                     delta=delta, ref_log_probs=ref_log_probs, beta=beta, loss_weights=loss_weights,
                     divisor=grpo_divisor, logits_scale_factor=s, rollout_log_probs=rollout_log_probs,
                     **sequences, **policy).loss if grpo_weight else zero
    gspo = gspo_loss(logits, target, advantages, old_log_probs, document_index, num_documents=num_documents,
                     label_counts=label_counts, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                     weighting=weighting, divisor=gspo_divisor, logits_scale_factor=s, ref_log_probs=ref_log_probs,
                     beta=beta, rollout_log_probs=rollout_log_probs, **policy).loss if gspo_weight else zero
    distill = distillation_loss(logits, teacher_logits, kind=kind, beta=distillation_beta, temperature=temperature,
                                logits_scale_factor=s, loss_mask=distillation_mask,
                                divisor=distillation_divisor).loss if distillation_weight else zero
    lp = _label_logprob(torch.log_softmax(_scaled(logits, s), dim=-1), target)
    total = (label_weight * label + z_loss_weight * z + grpo_weight * grpo + gspo_weight * gspo
             + distillation_weight * distill)
    weights = (label_weight, z_loss_weight, grpo_weight, gspo_weight, distillation_weight)
    label, z, grpo, gspo, distill = (t.detach() if w else None for t, w in zip((label, z, grpo, gspo, distill), weights))
    return FusedHeadOutput(total, label, z, grpo, lp.detach(), gspo, distill)  # a term of weight 0: None


def token_log_probs(logits, target, *, logits_scale_factor=1.0, compute_entropy=False, top_k=None, top_p=None,
                    min_p=None):
    """(log_probs, entropy or None) per token: log softmax(s·z)[y] (0 where y < 0) and −Σ p log p, over the
    sampler's kept set where top_k / top_p / min_p are given."""
    logp = _log_softmax(logits, logits_scale_factor, target, top_k, top_p, min_p)
    return _label_logprob(logp, target), _entropy(logp) if compute_entropy else None


def linear_token_log_probs(hidden, weight, target, *, bias=None, logits_scale_factor=1.0, compute_entropy=False,
                           **sampler):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return token_log_probs(logits, target, logits_scale_factor=logits_scale_factor, compute_entropy=compute_entropy,
                           **sampler)
