"""verl: rl_losses' fused log-prob/entropy kernel in place of verl's (docs/integrations/verl.md).

verl's actor, with ``actor_rollout_ref.model.use_fused_kernels=True``, computes the per-token log-probs and
entropies of the rolled labels from the last hidden state and the lm_head weight, through
``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (``fused_kernel_options.impl_backend=torch``)
or ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (``impl_backend=triton``), then its own
policy loss from them. This module provides both with the same signatures, computed by
``rl_losses.linear_token_log_probs`` (one chunked pass forward, one backward; CPU and CUDA), and
``install()`` puts them in verl's modules. Importing this module installs them when verl is importable, so
naming it in verl's ``VERL_USE_EXTERNAL_MODULES`` or ``actor_rollout_ref.model.external_lib`` turns it on in
every worker.

verl's policy-loss registry (``register_policy_loss``) is not used: its functions receive the per-token
log-probs after the lm_head, where a fused lm_head loss has nothing left to fuse; the fused part is this
kernel.
"""
from __future__ import annotations

import torch

import rl_losses

_ops = torch.ops.rl_losses


def _check_ndim(hidden_states: torch.Tensor, input_ids: torch.Tensor) -> None:
    if hidden_states.dim() not in (2, 3):
        raise ValueError(f"hidden_states must be 2-D (T, H) or 3-D (B, T, H), got shape {tuple(hidden_states.shape)}")
    if input_ids.shape != hidden_states.shape[:-1]:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} but hidden_states has batch shape "
                         f"{tuple(hidden_states.shape[:-1])}")


class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for verl's ``FusedLinearForPPO``: ``forward(hidden_states, vocab_weights, input_ids,
    temperature=1.0) -> (log_probs, entropy)``, log-probs float32 and the entropy in the hidden states' dtype,
    as verl returns them; differentiable w.r.t. hidden_states and vocab_weights through both outputs.

    ``chunk_size`` is the number of rows of logits alive at once (verl's default 512; None: rl_losses' own
    default, as many rows as fit 512 MiB of logits). ``impl_backend`` is accepted for compatibility and
    ignored: rl_losses runs its own kernels."""

    def __init__(self, chunk_size: int | None = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger", "triton", "rl_losses"):
            raise ValueError(f"FusedLinearForPPO: unsupported impl_backend {impl_backend!r}")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        _check_ndim(hidden_states, input_ids)
        log_probs, entropy = rl_losses.linear_token_log_probs(
            hidden_states, vocab_weights, input_ids.to(torch.int64), temperature=float(temperature),
            compute_entropy=True, chunk_size=self.chunk_size)
        return log_probs.float(), entropy.to(hidden_states.dtype)


def fused_linear_for_ppo_fwd(hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``_fused_linear_for_ppo_fwd`` (one chunk, no autograd): (log_probs float32, entropy)."""
    with torch.no_grad():
        log_probs, entropy = rl_losses.linear_token_log_probs(hidden_states, vocab_weights, input_ids.to(torch.int64),
                                                              temperature=temperature, compute_entropy=True)
    return log_probs.float(), entropy.to(hidden_states.dtype)


def fused_linear_for_ppo_bwd(dlog_probs: torch.Tensor | None, dentropy: torch.Tensor | None,
                             hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                             temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``_fused_linear_for_ppo_bwd``: (d hidden_states, d vocab_weights) for the upstream gradients of
    the log-probs and the entropy (either may be None). Runs the statistics pass, then the gradient pass."""
    if dlog_probs is None and dentropy is None:
        raise ValueError("fused_linear_for_ppo_bwd: dlog_probs and dentropy are both None")
    labels = input_ids.to(torch.int64)
    scale = 1.0 / float(temperature)
    _, _, stats = _ops._linear_token_log_probs_forward(hidden_states, vocab_weights, labels, None, scale,
                                                       dentropy is not None, None)
    d_hidden, d_weight, _ = _ops._linear_token_log_probs_backward(
        hidden_states, vocab_weights, labels, None, stats, dlog_probs, dentropy, scale, None, [True, True, False])
    return d_hidden, d_weight


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none", dist_process_group=None):
    """Drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (verl's Triton kernel):
    returns (log_probs, entropy) float32 per token, flattened to (N,) as verl's kernel returns them, for
    reduction="none"; their sums or means otherwise."""
    if dist_process_group is not None:
        raise ValueError("linear_cross_entropy: a vocabulary-parallel dist_process_group is not supported by the "
                         "fused linear form; gather the lm_head weight, or call rl_losses.token_log_probs on the "
                         "vocabulary-parallel logits with tp_group")
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    log_probs, entropy = rl_losses.linear_token_log_probs(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                          labels.reshape(-1).to(torch.int64),
                                                          temperature=float(temperature), compute_entropy=True)
    if reduction == "sum":
        return log_probs.sum(), entropy.sum()
    if reduction == "mean":
        return log_probs.mean(), entropy.mean()
    return log_probs, entropy


def install() -> bool:
    """Replace verl's fused log-prob/entropy kernels with rl_losses' (both backends). Returns False when verl
    is not importable. verl's model forwards import these names at call time, so installing before the first
    forward is enough."""
    try:
        import verl.utils.experimental.torch_functional as torch_functional
        import verl.utils.kernel.linear_cross_entropy as triton_functional
    except ImportError:
        return False
    # verl's own per-chunk functions (_fused_linear_for_ppo_fwd/_bwd) stay: only its FusedLinearForPPOFunction
    # calls them, and that is no longer reached through FusedLinearForPPO.
    torch_functional.FusedLinearForPPO = FusedLinearForPPO
    triton_functional.linear_cross_entropy = linear_cross_entropy
    return True


INSTALLED = install()
