"""The verl tests' shared pieces: an ActorConfig, random ragged (B, T) batches, and one call of a verl-style
policy-loss function with its gradient w.r.t. the log-probs."""
import pytest
import torch

verl_config = pytest.importorskip("verl.workers.config")


def make_config(global_batch_info=None, **overrides):
    config = verl_config.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                                     use_dynamic_bsz=False, **overrides)
    config.global_batch_info.update(global_batch_info or {})  # verl fills the dict in place, per step
    return config


def make_inputs(dtype, seed, batch=6, length=64):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    old = lp + 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, length).contiguous()
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    lengths[2] = 0  # a fully masked sequence: verl does not count it
    # (lengths >= 32: verl divides a sequence's token sum by its length + 1e-8, 3e-10 relative here)
    mask = (torch.arange(length) < lengths.unsqueeze(1)).to(dtype)
    weights = torch.rand(batch, length, generator=g, dtype=torch.float64) * 2
    return [t.to(dtype) for t in (lp, old, adv, weights)] + [mask]


def run(fn, lp, old, adv, mask, mode, config, weights):
    x = lp.clone().requires_grad_(True)
    loss, metrics = fn(old, x, adv, mask, mode, config, weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics
