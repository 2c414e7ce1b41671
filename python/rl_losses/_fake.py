"""Fake (meta) kernels of every op, so that torch.compile and meta tensors can trace them.

They only describe output shapes, dtypes and devices; they mirror the C++ shape logic in csrc/.
"""
import torch
from torch.library import register_fake


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batch(target: torch.Tensor) -> list:
    return list(target.shape)


@register_fake("rl_losses::row_stats")
def _row_stats(logits, target, *, logits_scale_factor=1.0, vocab_start=0, vocab_size=-1, entropy=False,
               smoothing=False):
    return logits.new_empty(_batch(target) + [5], dtype=_acc(logits.dtype))


@register_fake("rl_losses::_scale_grad_")
def _scale_grad_(grad, grad_output):
    return None


def _ce_outputs(logits, target, reduction):
    acc = _acc(logits.dtype)
    loss = logits.new_empty(_batch(target) if reduction == "none" else [], dtype=acc)
    return loss, logits.new_empty(_batch(target), dtype=acc)


@register_fake("rl_losses::cross_entropy")
def _cross_entropy(logits, target, *, logits_scale_factor=1.0, label_smoothing=0.0, z_loss_factor=0.0,
                   label_weight=1.0, reduction="mean", divisor=None, inplace_backward=False, row_stats=None,
                   vocab_start=0, vocab_size=-1):
    return _ce_outputs(logits, target, reduction)


@register_fake("rl_losses::_cross_entropy_forward")
def _cross_entropy_forward(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start, vocab_size,
                           compute_grad):
    loss, lse = _ce_outputs(logits, target, reduction)
    grad = (torch.empty_like(logits, memory_format=torch.contiguous_format) if compute_grad
            else logits.new_empty([0]))
    return loss, lse, grad


@register_fake("rl_losses::_cross_entropy_forward_inplace")
def _cross_entropy_forward_inplace(logits, target, s, eps, z, lw, reduction, divisor, row_stats, vocab_start,
                                   vocab_size):
    return _ce_outputs(logits, target, reduction)


def _policy_outputs(logits, target, num_documents=None):
    acc = _acc(logits.dtype)
    scalars = [logits.new_empty([], dtype=acc) for _ in range(6)]  # loss, new_lp, low, high, kl_old, entropy
    log_probs = logits.new_empty(_batch(target), dtype=acc)
    # ratio_mean, then the policy family's kl, rollout_ratio_mean, rollout_weight_mean, rollout_corrected_fraction
    out = scalars + [log_probs] + [logits.new_empty([], dtype=acc) for _ in range(5)]
    if num_documents is not None:
        out.append(logits.new_empty([num_documents], dtype=acc))
    return out


def _grad(logits, compute_grad):
    return (torch.empty_like(logits, memory_format=torch.contiguous_format) if compute_grad
            else logits.new_empty([0]))


@register_fake("rl_losses::grpo")
def _grpo(logits, target, advantages, old_log_probs, **kwargs):
    return tuple(_policy_outputs(logits, target))


@register_fake("rl_losses::_grpo_forward")
def _grpo_forward(logits, target, advantages, old_log_probs, *args):
    return tuple(_policy_outputs(logits, target) + [_grad(logits, args[-1])])


@register_fake("rl_losses::_grpo_forward_inplace")
def _grpo_forward_inplace(logits, target, advantages, old_log_probs, *args):
    return tuple(_policy_outputs(logits, target))


def _num_documents(num_documents, document_sums):
    if num_documents is not None:
        return num_documents
    if document_sums is not None:
        return document_sums.shape[0]
    # max(document_index) + 1: known only from the data.
    return torch.library.get_ctx().new_dynamic_size()


@register_fake("rl_losses::gspo")
def _gspo(logits, target, advantages, old_log_probs, document_index, *, num_documents=None, document_sums=None,
          **kwargs):
    return tuple(_policy_outputs(logits, target, _num_documents(num_documents, document_sums)))


# _gspo_forward(logits, target, advantages, old_log_probs, document_index, num_documents, label_counts, ε_l, ε_h,
#   weighting, token_advantages, divisor, s, compute_entropy, row_stats, document_sums, vocab_start, vocab_size
#   [, compute_grad])
@register_fake("rl_losses::_gspo_forward")
def _gspo_forward(logits, target, advantages, old_log_probs, document_index, num_documents, *args):
    n_docs = _num_documents(num_documents, args[9])
    return tuple(_policy_outputs(logits, target, n_docs) + [_grad(logits, args[-1])])


@register_fake("rl_losses::_gspo_forward_inplace")
def _gspo_forward_inplace(logits, target, advantages, old_log_probs, document_index, num_documents, *args):
    return tuple(_policy_outputs(logits, target, _num_documents(num_documents, args[9])))


@register_fake("rl_losses::gspo_document_sums")
def _gspo_document_sums(log_probs, target, advantages, old_log_probs, document_index, label_counts, num_documents):
    return log_probs.new_empty([num_documents, 3])


# ---- fused lm_head: outputs as the logits ops', with the hidden states' dtype and device ------------------------
def _linear_grads(hidden, weight, bias, output_mask):
    def grad(t, wanted):
        return torch.empty_like(t, memory_format=torch.contiguous_format) if wanted and t is not None \
            else hidden.new_empty([0])
    return [grad(hidden, output_mask[0]), grad(weight, output_mask[1]), grad(bias, output_mask[2])]


@register_fake("rl_losses::linear_cross_entropy")
def _linear_cross_entropy(hidden, weight, target, *, reduction="mean", **kwargs):
    return _ce_outputs(hidden, target, reduction)


# _linear_cross_entropy_forward(hidden, weight, target, bias, s, ε, ζ, label_weight, reduction, divisor,
#   chunk_size, output_mask)
@register_fake("rl_losses::_linear_cross_entropy_forward")
def _linear_cross_entropy_forward(hidden, weight, target, bias, s, eps, z, lw, reduction, divisor, chunk_size,
                                  output_mask):
    return (*_ce_outputs(hidden, target, reduction), *_linear_grads(hidden, weight, bias, output_mask))


@register_fake("rl_losses::linear_grpo")
def _linear_grpo(hidden, weight, target, advantages, old_log_probs, **kwargs):
    return tuple(_policy_outputs(hidden, target))


@register_fake("rl_losses::_linear_grpo_forward")
def _linear_grpo_forward(hidden, weight, target, advantages, old_log_probs, bias, *args):
    return tuple(_policy_outputs(hidden, target) + _linear_grads(hidden, weight, bias, args[-1]))


@register_fake("rl_losses::linear_gspo")
def _linear_gspo(hidden, weight, target, advantages, old_log_probs, document_index, *, num_documents=None,
                 **kwargs):
    return tuple(_policy_outputs(hidden, target, _num_documents(num_documents, None)))


# _linear_gspo_forward(hidden, weight, target, advantages, old_log_probs, document_index, bias, num_documents,
#   ... , output_mask)
@register_fake("rl_losses::_linear_gspo_forward")
def _linear_gspo_forward(hidden, weight, target, advantages, old_log_probs, document_index, bias, num_documents,
                         *args):
    out = _policy_outputs(hidden, target, _num_documents(num_documents, None))
    return tuple(out + _linear_grads(hidden, weight, bias, args[-1]))
