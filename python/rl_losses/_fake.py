"""Fake (meta) kernels of every op, so that torch.compile and meta tensors can trace them.

Each first runs the real kernel's argument checks (``_checks.py``: dtypes, shapes, devices and options, with
the same messages), then describes the output shapes, dtypes and devices as the C++ code in csrc/ makes them.
"""
import torch
from torch.library import register_fake

from rl_losses import _checks, _checks_heads


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batch(target: torch.Tensor) -> list:
    return list(target.shape)


@register_fake("rl_losses::row_stats")
def _row_stats(logits, target, *, logits_scale_factor=1.0, vocab_start=0, vocab_size=-1, entropy=False,
               smoothing=False):
    _checks.check_and_flatten("row_stats", logits, target, vocab_start, vocab_size)
    _checks.check_scale("row_stats", logits_scale_factor)
    return logits.new_empty(_batch(target) + [5], dtype=_acc(logits.dtype))


@register_fake("rl_losses::_scale_grad_")
def _scale_grad_(grad, grad_output, row_unscale=None):
    return None


def _row_unscale(logits, target, with_grad):
    """grad_row_unscale, the last output of the forwards over the row pass: a factor per row where fp16 gradient
    rows are stored pre-scaled (csrc/common/row_pass.h, GradRowPrescaled), else empty."""
    rows = target.numel() if with_grad and logits.dtype == torch.float16 else 0
    return logits.new_empty([rows], dtype=torch.float32)


def _ce_outputs(logits, target, reduction):
    acc = _acc(logits.dtype)
    loss = logits.new_empty(_batch(target) if reduction == "none" else [], dtype=acc)
    return loss, logits.new_empty(_batch(target), dtype=acc)


def _check_cross_entropy(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start, vocab_size,
                         inplace=False):
    op = "cross_entropy"
    rows = _checks.check_and_flatten(op, logits, target, vocab_start, vocab_size)
    if inplace:
        _checks.check_inplace(op, logits, rows)
    _checks.cross_entropy_options(op, logits, target.numel(), s, eps, z, lw, reduction, divisor, row_stats)


@register_fake("rl_losses::cross_entropy")
def _cross_entropy(logits, target, *, logits_scale_factor=1.0, label_smoothing=0.0, z_loss_factor=0.0,
                   label_weight=1.0, reduction="mean", divisor=None, inplace_backward=False, row_stats=None,
                   vocab_start=0, vocab_size=-1):
    # Without autograd (the only way here) inplace_backward writes nothing, so its checks do not apply.
    _check_cross_entropy(logits, target, logits_scale_factor, label_smoothing, z_loss_factor, label_weight,
                         reduction, divisor, row_stats, vocab_start, vocab_size)
    return _ce_outputs(logits, target, reduction)


@register_fake("rl_losses::_cross_entropy_forward")
def _cross_entropy_forward(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start, vocab_size,
                           compute_grad):
    _check_cross_entropy(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start, vocab_size)
    loss, lse = _ce_outputs(logits, target, reduction)
    return (loss, lse, *_grad_outputs(logits, target, compute_grad))


@register_fake("rl_losses::_cross_entropy_forward_inplace")
def _cross_entropy_forward_inplace(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start,
                                   vocab_size):
    _check_cross_entropy(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start, vocab_size,
                         inplace=True)
    return (*_ce_outputs(logits, target, reduction), _row_unscale(logits, target, True))


def _policy_outputs(logits, target, num_documents=None):
    acc = _acc(logits.dtype)
    scalars = [logits.new_empty([], dtype=acc) for _ in range(6)]  # loss, new_lp, low, high, kl_old, entropy
    log_probs = logits.new_empty(_batch(target), dtype=acc)
    # ratio_mean, then the policy family's kl, rollout_ratio_mean, rollout_weight_mean, rollout_corrected_fraction
    out = scalars + [log_probs] + [logits.new_empty([], dtype=acc) for _ in range(5)]
    if num_documents is not None:
        out.append(logits.new_empty([num_documents], dtype=acc))
    out.append(logits.new_empty([], dtype=acc))  # vespo_phi_mean
    return out


def _grad(logits, compute_grad):
    return (torch.empty_like(logits, memory_format=torch.contiguous_format) if compute_grad
            else logits.new_empty([0]))


def _grad_outputs(logits, target, compute_grad):
    """The last outputs of a forward over the row pass: the gradient (a placeholder unless compute_grad) and
    grad_row_unscale."""
    return [_grad(logits, compute_grad), _row_unscale(logits, target, compute_grad)]


# _grpo_forward(logits, target, advantages, old_log_probs, ref_log_probs, loss_weights, label_counts, ε_l, ε_h,
#   delta, beta, divisor, s, compute_entropy, row_stats, vocab_start, vocab_size[, compute_grad])
def _check_grpo(logits, target, advantages, old_log_probs, ref_log_probs=None, loss_weights=None, label_counts=None,
                epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0, divisor=None, logits_scale_factor=1.0,
                compute_entropy=False, row_stats=None, vocab_start=0, vocab_size=-1, *policy, document_index=None,
                num_documents=None, inplace=False, **policy_kwargs):
    op = "grpo"
    rows = _checks.check_and_flatten(op, logits, target, vocab_start, vocab_size)
    if inplace:
        _checks.check_inplace(op, logits, rows)
    _checks.grpo_options(op, logits, target, target.numel(), advantages, old_log_probs, ref_log_probs, loss_weights,
                         label_counts, epsilon_low, epsilon_high, delta, beta, divisor, logits_scale_factor, row_stats)
    _check_policy(op, target, epsilon_high, delta, policy, policy_kwargs)
    _checks.sequence_count(op, document_index, num_documents)


def _policy_values(positional, keywords):
    # The policy family's arguments, positional (the _forward ops: RL_LOSSES_POLICY_ARGS order) or by keyword.
    names = list(_checks.POLICY_DEFAULTS)
    return {**_checks.POLICY_DEFAULTS, **dict(zip(names, positional)), **keywords}


def _check_policy(op, target, epsilon_high, delta, positional, keywords):
    values = _policy_values(positional, keywords)
    _checks.policy_options(op, target, epsilon_high, delta, *(values[k] for k in _checks.POLICY_DEFAULTS))
    return values


@register_fake("rl_losses::grpo")
def _grpo(logits, target, advantages, old_log_probs, *, inplace_backward=False, **kwargs):
    _check_grpo(logits, target, advantages, old_log_probs, **kwargs)
    return tuple(_policy_outputs(logits, target))


@register_fake("rl_losses::_grpo_forward")
def _grpo_forward(logits, target, advantages, old_log_probs, *args):
    # (..., vocab_size, <14 policy args>, document_index, num_documents, compute_grad)
    _check_grpo(logits, target, advantages, old_log_probs, *args[:-3], document_index=args[-3], num_documents=args[-2])
    return tuple(_policy_outputs(logits, target) + _grad_outputs(logits, target, args[-1]))


@register_fake("rl_losses::_grpo_forward_inplace")
def _grpo_forward_inplace(logits, target, advantages, old_log_probs, *args):
    _check_grpo(logits, target, advantages, old_log_probs, *args[:-2], document_index=args[-2], num_documents=args[-1],
                inplace=True)
    return tuple(_policy_outputs(logits, target) + [_row_unscale(logits, target, True)])


def _num_documents(num_documents, document_sums):
    if num_documents is not None:
        return num_documents
    if document_sums is not None:
        return document_sums.shape[0]
    # max(document_index) + 1: known only from the data.
    return torch.library.get_ctx().new_dynamic_size()


# _gspo_forward(logits, target, advantages, old_log_probs, document_index, num_documents, label_counts, ε_l, ε_h,
#   delta, weighting, token_advantages, divisor, s, compute_entropy, row_stats, document_sums, vocab_start,
#   vocab_size[, compute_grad])
def _check_gspo(logits, target, advantages, old_log_probs, document_index, num_documents=None, label_counts=None,
                epsilon_low=0.2, epsilon_high=0.2, delta=None, weighting="document", token_advantages=False,
                divisor=None, logits_scale_factor=1.0, compute_entropy=False, row_stats=None, document_sums=None,
                vocab_start=0, vocab_size=-1, ref_log_probs=None, beta=0.0, *policy, inplace=False, **policy_kwargs):
    op = "gspo"
    rows = _checks.check_and_flatten(op, logits, target, vocab_start, vocab_size)
    if inplace:
        _checks.check_inplace(op, logits, rows)
    _checks.gspo_options(op, logits, target, target.numel(), advantages, old_log_probs, document_index,
                         num_documents, label_counts, epsilon_low, epsilon_high, delta, weighting, divisor,
                         logits_scale_factor, row_stats, document_sums)
    values = _check_policy(op, target, epsilon_high, delta, policy, policy_kwargs)
    mode = values["rollout_correction"]
    kl_share = (values["kl_importance_weighted"] and beta != 0 and ref_log_probs is not None
                and not token_advantages)
    basic = not (mode is not None and mode.startswith("sequence")) and values["loss_type"] != "vespo" and not kl_share
    _checks.gspo_document_sums_shape(op, logits, document_sums, num_documents, basic)
    return _num_documents(num_documents, document_sums)


@register_fake("rl_losses::gspo")
def _gspo(logits, target, advantages, old_log_probs, document_index, *, inplace_backward=False, **kwargs):
    n_docs = _check_gspo(logits, target, advantages, old_log_probs, document_index, **kwargs)
    return tuple(_policy_outputs(logits, target, n_docs))


@register_fake("rl_losses::_gspo_forward")
def _gspo_forward(logits, target, advantages, old_log_probs, document_index, *args):
    n_docs = _check_gspo(logits, target, advantages, old_log_probs, document_index, *args[:-1])
    return tuple(_policy_outputs(logits, target, n_docs) + _grad_outputs(logits, target, args[-1]))


@register_fake("rl_losses::_gspo_forward_inplace")
def _gspo_forward_inplace(logits, target, advantages, old_log_probs, document_index, *args):
    n_docs = _check_gspo(logits, target, advantages, old_log_probs, document_index, *args, inplace=True)
    return tuple(_policy_outputs(logits, target, n_docs) + [_row_unscale(logits, target, True)])


@register_fake("rl_losses::gspo_document_sums")
def _gspo_document_sums(log_probs, target, advantages, old_log_probs, document_index, label_counts, num_documents, *,
                        weighting="document", token_advantages=False, ref_log_probs=None, beta=0.0, **policy):
    _checks.gspo_document_sums(log_probs, target, advantages, old_log_probs, document_index, label_counts,
                               num_documents, weighting, beta, policy)
    return log_probs.new_empty([num_documents, _checks.GSPO_SUMS], dtype=_checks.acc_dtype(log_probs.dtype))


# ---- fused lm_head: outputs as the logits ops', with the hidden states' dtype and device ------------------------
def _linear_grads(hidden, weight, bias, output_mask, weight_main_grad=None):
    """grad_hidden, grad_weight, grad_bias as output_mask asks (grad_weight goes into weight_main_grad when given)."""
    def grad(t, wanted):
        return torch.empty_like(t, memory_format=torch.contiguous_format) if wanted and t is not None \
            else hidden.new_empty([0])
    return [grad(hidden, output_mask[0]), grad(weight, output_mask[1] and weight_main_grad is None),
            grad(bias, output_mask[2])]


def _check_linear_cross_entropy(hidden, weight, target, bias=None, logits_scale_factor=1.0, label_smoothing=0.0,
                                z_loss_factor=0.0, label_weight=1.0, reduction="mean", divisor=None,
                                chunk_size=None, strategy="fast", weight_main_grad=None, skip_unlabelled=True,
                                output_mask=(False, False, False)):
    op = "linear_cross_entropy"
    _checks.check_linear(op, hidden, weight, bias, target, chunk_size, strategy, weight_main_grad)
    wants_grad = output_mask[0] or output_mask[1] or (output_mask[2] and bias is not None)
    _checks._check(reduction != "none" or not wants_grad, op,
                   "reduction='none' cannot be differentiated (the weight gradient is summed over tokens in the ",
                   "forward); use 'sum' or 'mean', or call it without gradients")
    _checks.cross_entropy_options(op, hidden, target.numel(), logits_scale_factor, label_smoothing, z_loss_factor,
                                  label_weight, reduction, divisor, None)


@register_fake("rl_losses::linear_cross_entropy")
def _linear_cross_entropy(hidden, weight, target, *, reduction="mean", **kwargs):
    _check_linear_cross_entropy(hidden, weight, target, reduction=reduction, **kwargs)
    return _ce_outputs(hidden, target, reduction)


# _linear_cross_entropy_forward(hidden, weight, target, bias, s, ε, ζ, label_weight, reduction, divisor,
#   chunk_size, strategy, weight_main_grad, skip_unlabelled, output_mask)
@register_fake("rl_losses::_linear_cross_entropy_forward")
def _linear_cross_entropy_forward(hidden, weight, target, bias, s, eps, z, lw, reduction, divisor, chunk_size, strategy,
                                  weight_main_grad, skip_unlabelled, output_mask):
    _check_linear_cross_entropy(hidden, weight, target, bias, s, eps, z, lw, reduction, divisor, chunk_size, strategy,
                                weight_main_grad, skip_unlabelled, output_mask)
    return (*_ce_outputs(hidden, target, reduction),
            *_linear_grads(hidden, weight, bias, output_mask, weight_main_grad))


# _linear_grpo_forward(hidden, weight, target, advantages, old_log_probs, bias, ref_log_probs, loss_weights,
#   label_counts, ε_l, ε_h, delta, beta, divisor, s, compute_entropy, chunk_size, strategy, weight_main_grad,
#   skip_unlabelled, <14 policy args>, document_index, num_documents, output_mask)
def _check_linear_grpo(hidden, weight, target, advantages, old_log_probs, bias=None, ref_log_probs=None,
                       loss_weights=None, label_counts=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0,
                       divisor=None, logits_scale_factor=1.0, compute_entropy=False, chunk_size=None, strategy="fast",
                       weight_main_grad=None, skip_unlabelled=True, *policy, document_index=None,
                       num_documents=None, **policy_kwargs):
    op = "linear_grpo"
    _checks.check_linear(op, hidden, weight, bias, target, chunk_size, strategy, weight_main_grad)
    _checks.grpo_options(op, hidden, target, target.numel(), advantages, old_log_probs, ref_log_probs, loss_weights,
                         label_counts, epsilon_low, epsilon_high, delta, beta, divisor, logits_scale_factor, None)
    _check_policy(op, target, epsilon_high, delta, policy, policy_kwargs)
    _checks.sequence_count(op, document_index, num_documents)


@register_fake("rl_losses::linear_grpo")
def _linear_grpo(hidden, weight, target, advantages, old_log_probs, **kwargs):
    _check_linear_grpo(hidden, weight, target, advantages, old_log_probs, **kwargs)
    return tuple(_policy_outputs(hidden, target))


@register_fake("rl_losses::_linear_grpo_forward")
def _linear_grpo_forward(hidden, weight, target, advantages, old_log_probs, bias, *args):
    # args: ref_log_probs ... chunk_size (11), strategy, weight_main_grad, skip_unlabelled, <14 policy args>,
    # document_index, num_documents, output_mask
    _check_linear_grpo(hidden, weight, target, advantages, old_log_probs, bias, *args[:-3], document_index=args[-3],
                       num_documents=args[-2])
    return tuple(_policy_outputs(hidden, target) + _linear_grads(hidden, weight, bias, args[-1], args[12]))


# _linear_gspo_forward(hidden, weight, target, advantages, old_log_probs, document_index, bias, num_documents,
#   label_counts, ε_l, ε_h, delta, weighting, token_advantages, divisor, s, compute_entropy, chunk_size, strategy,
#   weight_main_grad, skip_unlabelled, ref_log_probs, beta, <14 policy args>, output_mask)
def _check_linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, bias=None,
                       num_documents=None, label_counts=None, epsilon_low=0.2, epsilon_high=0.2, delta=None,
                       weighting="document", token_advantages=False, divisor=None, logits_scale_factor=1.0,
                       compute_entropy=False, chunk_size=None, strategy="fast", weight_main_grad=None,
                       skip_unlabelled=True, ref_log_probs=None, beta=0.0, *policy, **policy_kwargs):
    op = "linear_gspo"
    _checks.check_linear(op, hidden, weight, bias, target, chunk_size, strategy, weight_main_grad)
    _checks.gspo_options(op, hidden, target, target.numel(), advantages, old_log_probs, document_index,
                         num_documents, label_counts, epsilon_low, epsilon_high, delta, weighting, divisor,
                         logits_scale_factor, None, None)
    _check_policy(op, target, epsilon_high, delta, policy, policy_kwargs)
    return _num_documents(num_documents, None)


@register_fake("rl_losses::linear_gspo")
def _linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, **kwargs):
    n_docs = _check_linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, **kwargs)
    return tuple(_policy_outputs(hidden, target, n_docs))


@register_fake("rl_losses::_linear_gspo_forward")
def _linear_gspo_forward(hidden, weight, target, advantages, old_log_probs, document_index, bias, *args):
    # args: num_documents ... chunk_size (11), strategy, weight_main_grad, skip_unlabelled, ..., output_mask
    n_docs = _check_linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, bias, *args[:-1])
    return tuple(_policy_outputs(hidden, target, n_docs) + _linear_grads(hidden, weight, bias, args[-1], args[12]))


# ---- distillation: (loss, divergence[, grad]) -----------------------------------------------------------------
def _distill_outputs(logits):
    acc = _acc(logits.dtype)
    return logits.new_empty([], dtype=acc), logits.new_empty(list(logits.shape[:-1]), dtype=acc)


@register_fake("rl_losses::distillation")
def _distillation(logits, teacher_logits, *, kind="forward_kl", beta=0.5, temperature=1.0, logits_scale_factor=1.0,
                  loss_mask=None, divisor=None, inplace_backward=False, row_stats=None, jsd_sums=None):
    # Without autograd (the only way here) inplace_backward writes nothing, so its checks do not apply.
    _checks_heads.distillation(logits, teacher_logits, kind, beta, temperature, logits_scale_factor, loss_mask, divisor,
                         row_stats, jsd_sums)
    return _distill_outputs(logits)


@register_fake("rl_losses::_distillation_forward")
def _distillation_forward(logits, teacher_logits, kind, beta, temperature, logits_scale_factor, loss_mask, divisor,
                          row_stats, jsd_sums, compute_grad):
    _checks_heads.distillation(logits, teacher_logits, kind, beta, temperature, logits_scale_factor, loss_mask, divisor,
                         row_stats, jsd_sums)
    return (*_distill_outputs(logits), _grad(logits, compute_grad))


@register_fake("rl_losses::_distillation_forward_inplace")
def _distillation_forward_inplace(logits, teacher_logits, kind, beta, temperature, logits_scale_factor, loss_mask,
                                  divisor, row_stats, jsd_sums):
    _checks_heads.distillation(logits, teacher_logits, kind, beta, temperature, logits_scale_factor, loss_mask, divisor,
                         row_stats, jsd_sums, inplace=True)
    return _distill_outputs(logits)


@register_fake("rl_losses::distillation_stats")
def _distillation_stats(logits, teacher_logits, *, temperature=1.0, logits_scale_factor=1.0):
    _checks_heads.distillation_stats(logits, teacher_logits, temperature, logits_scale_factor)
    return logits.new_empty(list(logits.shape[:-1]) + [_checks_heads.DISTILL_STATS_FIELDS], dtype=_acc(logits.dtype))


@register_fake("rl_losses::distillation_jsd_sums")
def _distillation_jsd_sums(logits, teacher_logits, row_stats, *, beta=0.5, temperature=1.0, logits_scale_factor=1.0):
    _checks_heads.distillation_jsd_sums(logits, teacher_logits, row_stats, beta, temperature, logits_scale_factor)
    return logits.new_empty(list(logits.shape[:-1]) + [2], dtype=_acc(logits.dtype))


# ---- DPO: 5 scalars, the per-token log-probs and the per-document sums (2 per pair) -------------------------------
def _dpo_outputs(logits, target, n_pairs):
    acc = _acc(logits.dtype)
    scalars = [logits.new_empty([], dtype=acc) for _ in range(5)]
    return scalars + [logits.new_empty(_batch(target), dtype=acc), logits.new_empty([2 * n_pairs], dtype=acc)]


@register_fake("rl_losses::dpo")
def _dpo(logits, target, document_index, pairs, reference_chosen_log_probs, reference_rejected_log_probs, *,
         beta=1.0, logits_scale_factor=1.0, divisor=None, inplace_backward=False, row_stats=None, vocab_start=0,
         vocab_size=-1):
    n = _checks_heads.dpo(logits, target, document_index, pairs, reference_chosen_log_probs, reference_rejected_log_probs,
                    beta, logits_scale_factor, divisor, row_stats, vocab_start, vocab_size)
    return tuple(_dpo_outputs(logits, target, n))


@register_fake("rl_losses::_dpo_forward")
def _dpo_forward(logits, target, document_index, pairs, ref_c, ref_r, beta, s, divisor, row_stats, vocab_start,
                 vocab_size, compute_grad):
    n = _checks_heads.dpo(logits, target, document_index, pairs, ref_c, ref_r, beta, s, divisor, row_stats, vocab_start,
                    vocab_size)
    return tuple(_dpo_outputs(logits, target, n) + _grad_outputs(logits, target, compute_grad))


@register_fake("rl_losses::_dpo_forward_inplace")
def _dpo_forward_inplace(logits, target, document_index, pairs, ref_c, ref_r, beta, s, divisor, row_stats,
                         vocab_start, vocab_size):
    n = _checks_heads.dpo(logits, target, document_index, pairs, ref_c, ref_r, beta, s, divisor, row_stats, vocab_start,
                    vocab_size, inplace=True)
    return tuple(_dpo_outputs(logits, target, n) + [_row_unscale(logits, target, True)])


# ---- the fused head: loss, label_loss, z_loss, grpo_loss (0-dim), the per-token log-probs, gspo_loss (0-dim) -------
_HEAD_DEFAULTS = dict(label_weight=0.0, label_smoothing=0.0, label_divisor=None, z_loss_weight=0.0,
                      z_loss_divisor=None, z_loss_mask=None, grpo_weight=0.0, advantages=None, old_log_probs=None,
                      ref_log_probs=None, loss_weights=None, epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0,
                      grpo_divisor=None, gspo_weight=0.0, document_index=None, num_documents=None, label_counts=None,
                      weighting="document", gspo_divisor=None, logits_scale_factor=1.0, row_stats=None, vocab_start=0,
                      vocab_size=-1)


def _head_outputs(logits, target):
    acc = _acc(logits.dtype)
    return ([logits.new_empty([], dtype=acc) for _ in range(4)] + [logits.new_empty(_batch(target), dtype=acc)]
            + [logits.new_empty([], dtype=acc)])


@register_fake("rl_losses::fused_head_loss")
def _fused_head_loss(logits, target, *, inplace_backward=False, **kwargs):
    _checks_heads.fused_head(logits, target, *{**_HEAD_DEFAULTS, **kwargs}.values())
    return tuple(_head_outputs(logits, target))


@register_fake("rl_losses::_fused_head_loss_forward")
def _fused_head_loss_forward(logits, target, *args):
    _checks_heads.fused_head(logits, target, *args[:-1])
    return tuple(_head_outputs(logits, target) + _grad_outputs(logits, target, args[-1]))


@register_fake("rl_losses::_fused_head_loss_forward_inplace")
def _fused_head_loss_forward_inplace(logits, target, *args):
    _checks_heads.fused_head(logits, target, *args, inplace=True)
    return tuple(_head_outputs(logits, target) + [_row_unscale(logits, target, True)])


# ---- per-token log-probs and entropies ------------------------------------------------------------------------
def _token_log_probs_outputs(x, target, compute_entropy, with_stats):
    acc = _acc(x.dtype)
    log_probs = x.new_empty(_batch(target), dtype=acc)
    entropy = x.new_empty(_batch(target) if compute_entropy else [0], dtype=acc)
    stats = x.new_empty([target.numel(), 5] if with_stats else [0], dtype=acc)
    return log_probs, entropy, stats


def _check_token_log_probs(op, x, target, logits_scale_factor, row_stats=None):
    # The checks of the real kernels that the shapes alone decide (csrc/common/checks.cpp).
    torch._check(x.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16),
                 lambda: f"{op}: logits must be float32, float64, bfloat16 or float16, got {x.dtype}")
    torch._check(not target.dtype.is_floating_point and target.dtype != torch.bool,
                 lambda: f"{op}: target must be an integer tensor, got {target.dtype}")
    torch._check(logits_scale_factor > 0, lambda: f"{op}: logits_scale_factor must be > 0, got {logits_scale_factor}")
    if row_stats is not None:
        torch._check(list(row_stats.shape) == [target.numel(), 5],
                     lambda: f"{op}: row_stats must have shape ({target.numel()}, 5), got {tuple(row_stats.shape)}")


@register_fake("rl_losses::token_log_probs")
def _token_log_probs(logits, target, *, logits_scale_factor=1.0, compute_entropy=False, row_stats=None,
                     vocab_start=0, vocab_size=-1):
    _check_token_log_probs("token_log_probs", logits, target, logits_scale_factor, row_stats)
    return _token_log_probs_outputs(logits, target, compute_entropy, False)[:2]


@register_fake("rl_losses::_token_log_probs_forward")
def _token_log_probs_forward(logits, target, logits_scale_factor, compute_entropy, row_stats, vocab_start,
                             vocab_size):
    _check_token_log_probs("token_log_probs", logits, target, logits_scale_factor, row_stats)
    return _token_log_probs_outputs(logits, target, compute_entropy, row_stats is None)


@register_fake("rl_losses::_token_log_probs_backward")
def _token_log_probs_backward(logits, target, stats, grad_log_probs, grad_entropy, logits_scale_factor, vocab_start,
                              vocab_size):
    _check_token_log_probs("token_log_probs", logits, target, logits_scale_factor, stats)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _check_linear_token_log_probs(hidden, weight, target, bias, logits_scale_factor, chunk_size, strategy,
                                  weight_main_grad):
    op = "linear_token_log_probs"
    _checks.check_linear(op, hidden, weight, bias, target, chunk_size, strategy, weight_main_grad)
    _check_token_log_probs(op, hidden, target, logits_scale_factor)


@register_fake("rl_losses::linear_token_log_probs")
def _linear_token_log_probs(hidden, weight, target, *, bias=None, logits_scale_factor=1.0, compute_entropy=False,
                            chunk_size=None, strategy="fast", weight_main_grad=None, skip_unlabelled=True):
    _check_linear_token_log_probs(hidden, weight, target, bias, logits_scale_factor, chunk_size, strategy,
                                  weight_main_grad)
    return _token_log_probs_outputs(hidden, target, compute_entropy, False)[:2]


@register_fake("rl_losses::_linear_token_log_probs_forward")
def _linear_token_log_probs_forward(hidden, weight, target, bias, logits_scale_factor, compute_entropy, chunk_size,
                                    strategy, weight_main_grad, skip_unlabelled):
    _check_linear_token_log_probs(hidden, weight, target, bias, logits_scale_factor, chunk_size, strategy,
                                  weight_main_grad)
    return _token_log_probs_outputs(hidden, target, compute_entropy, True)


@register_fake("rl_losses::_linear_token_log_probs_backward")
def _linear_token_log_probs_backward(hidden, weight, target, bias, stats, grad_log_probs, grad_entropy,
                                     logits_scale_factor, chunk_size, strategy, weight_main_grad, skip_unlabelled,
                                     output_mask):
    _check_linear_token_log_probs(hidden, weight, target, bias, logits_scale_factor, chunk_size, strategy,
                                  weight_main_grad)
    return tuple(_linear_grads(hidden, weight, bias, output_mask, weight_main_grad))


@register_fake("rl_losses::policy_token_loss")
def _policy_token_loss(log_probs, old_log_probs, advantages, ref_log_probs=None, rollout_log_probs=None,
                       loss_mask=None, *,
                       epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0, loss_type="ppo_clip",
                       sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, rollout_correction=None, rollout_cap=3.0,
                       rollout_mask_bounds=None, kl_estimator="k3", kl_importance_weighted=False):
    _checks.policy_token_options(log_probs, old_log_probs, advantages, epsilon_low, epsilon_high, delta,
                                 ref_log_probs, beta, loss_type, sapo_temperature_pos, sapo_temperature_neg,
                                 rollout_log_probs, rollout_correction, rollout_cap, rollout_mask_bounds,
                                 kl_estimator, kl_importance_weighted, loss_mask)
    return tuple(log_probs.new_empty(log_probs.shape, dtype=_acc(log_probs.dtype)) for _ in range(7))
