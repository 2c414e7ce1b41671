"""rl_losses: fused cross-entropy, GRPO and GSPO loss heads for PyTorch.

The ops live in ``torch.ops.rl_losses`` (C++/CUDA, loaded from ``rl_losses._C``). This package adds:

- functional wrappers: ``cross_entropy``, ``z_loss``, ``grpo_loss``, ``gspo_loss`` (from logits) and
  ``linear_cross_entropy``, ``linear_grpo_loss``, ``linear_gspo_loss`` (from hidden states and the lm_head
  weight, without materialising the logits); the policy losses return a ``PolicyLossOutput``;
- per-token log-probs and entropies, differentiable through both (``token_log_probs``,
  ``linear_token_log_probs``), and drop-ins for trainers (``rl_losses.integrations``: TRL, verl);
- distillation against a teacher's logits (``distillation_loss``, ``linear_distillation_loss``) or its top-K
  log-probs (``topk_distillation_loss``, ``linear_topk_distillation_loss``; ``sampled_kl_loss``), DPO
  (``dpo_loss``) and several losses in one pass over the logits (``fused_head_loss``, rl_losses.fused_head);
- Fast-LLM-style configs (``rl_losses.config``, entry point ``LanguageModelLossConfig.from_dict``) that build
  the loss modules of ``rl_losses.losses``;
- ``pack_documents`` / ``Document``: variable-length rollouts packed into the batch the losses take;
- ``rl_losses.reference`` (the pure-PyTorch float64 ground truth) and ``rl_losses.distributed`` (the
  ``tp_group`` / ``sdp_group`` layer the wrappers route to);
- ``forward_backward``: a loss wrapper's result and the gradient of its logits in one call, without autograd.

``target`` is always the next-token labels (``target[t] = input_ids[t + 1]``), negative where there is no
label. The documentation is in the repository's docs/ folder: math.md (every formula), conventions.md
(labels, masks, divisors, packing), api.md (this API), distributed.md, performance.md, distillation_dpo.md.
"""
import torch  # noqa: F401  (must load before the library, which links against it)

from rl_losses import _C  # noqa: F401  (loads the library, which registers the ops)
from rl_losses import _fake  # noqa: F401  (fake kernels for torch.compile / meta tensors)
from rl_losses.batch_invariance import batch_invariant, is_batch_invariant
from rl_losses.functional import (
    PolicyLossOutput,
    cross_entropy,
    cuda_kernels_available,
    grpo_loss,
    gspo_loss,
    linear_cross_entropy,
    linear_grpo_loss,
    linear_gspo_loss,
    linear_token_log_probs,
    token_log_probs,
    z_loss,
)
from rl_losses.distillation import DistillationOutput, distillation_loss, linear_distillation_loss
from rl_losses.dpo import DpoOutput, dpo_loss
from rl_losses.outputs import SampledKlOutput, TopkDistillationOutput
from rl_losses.topk_distillation import (linear_sampled_kl_loss, linear_topk_distillation_loss, sampled_kl_loss,
                                         topk_distillation_loss)
from rl_losses.forward_backward import forward_backward
from rl_losses.fused_head import fused_head_loss
from rl_losses.kept_set import kept_token_log_probs, linear_kept_token_log_probs
from rl_losses.policy_token import PolicyTokenOutput, policy_token_loss
from rl_losses import aggregation, config, distributed, fused_head, losses, packing, reference  # noqa: F401  (submodules)
from rl_losses.config import LanguageModelLossConfig
from rl_losses.packing import Document, pack_documents

__version__ = "0.1.0"

__all__ = [
    # functional wrappers and their named result
    "cross_entropy",
    "z_loss",
    "grpo_loss",
    "gspo_loss",
    "linear_cross_entropy",
    "linear_grpo_loss",
    "linear_gspo_loss",
    "PolicyLossOutput",
    "token_log_probs",
    "kept_token_log_probs",
    "linear_kept_token_log_probs",
    "linear_token_log_probs",
    "distillation_loss",
    "linear_distillation_loss",
    "DistillationOutput",
    "topk_distillation_loss",
    "linear_topk_distillation_loss",
    "TopkDistillationOutput",
    "sampled_kl_loss",
    "linear_sampled_kl_loss",
    "SampledKlOutput",
    "dpo_loss",
    "DpoOutput",
    "fused_head_loss",
    "policy_token_loss",
    "PolicyTokenOutput",
    "fused_head",
    "cuda_kernels_available",
    # the loss and its gradient in one call, without autograd
    "forward_backward",
    # the batch-invariant mode (docs/consistency.md)
    "batch_invariant",
    "is_batch_invariant",
    # configs and loss modules
    "LanguageModelLossConfig",
    "config",
    "losses",
    # packing
    "Document",
    "pack_documents",
    # the reference and the distributed layer
    "reference",
    "distributed",
    # aggregation presets (TRL / verl loss conventions as loss_weights and divisor)
    "aggregation",
]
