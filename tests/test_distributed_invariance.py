"""The batch-invariant mode under a process group (docs/consistency.md, "Tensor parallelism"): the cross-rank sums
are added in rank order (rl_losses.batch_invariance.group_sum), not by an all-reduce whose order of additions
depends on a value's place in the message. Three gloo processes on CPU tensors (with two ranks every order gives
the same sum: a + b = b + a); RL_LOSSES_DIST_BACKEND=nccl runs them on CUDA tensors, one GPU per rank.
"""
import os

import pytest
import torch
import torch.distributed as dist

from helpers_invariance import join_group, run_ranks

BACKEND = os.environ.get("RL_LOSSES_DIST_BACKEND", "gloo")
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not (dist.is_nccl_available() and torch.cuda.device_count() >= 3 if BACKEND == "nccl"
                                    else dist.is_gloo_available()), reason=f"needs {BACKEND} (and 3 GPUs for nccl)")
WORLD = 3
N, V = 64, 96  # V split into three shards of 32


def _inputs():
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64).float() * 3
    return (logits, torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g),
            -3 * torch.rand(N, generator=g))


def _worker(rank: int, store: str, out: str) -> None:
    import rl_losses
    from rl_losses.batch_invariance import group_sum
    device = join_group(BACKEND, rank, store, WORLD)
    results = {}
    # Every rotation of three values whose sum depends on the order: rank r holds VALUES[(r + j) % 3] at j.
    values = (1.0, 1e8, -1e8)
    t = torch.tensor([values[(rank + j) % 3] for j in range(30000)], dtype=torch.float32, device=device)
    with rl_losses.batch_invariant():
        results["group_sum"] = group_sum(t.clone(), dist.group.WORLD).cpu()
    logits, target, advantages, old = (x.to(device) for x in _inputs())
    shard = logits[:, rank * (V // WORLD):(rank + 1) * (V // WORLD)]
    for name, rows in (("all", torch.arange(N, device=device)), ("dropped", torch.arange(1, N, device=device)),
                       ("reversed", torch.arange(N, device=device).flip(0))):
        x = shard[rows].contiguous().requires_grad_()
        with rl_losses.batch_invariant():
            out_ = rl_losses.grpo_loss(x, target[rows], advantages[rows], old[rows], tp_group=dist.group.WORLD,
                                       divisor=1.0)
            out_.loss.backward()
            log_probs, entropy = rl_losses.token_log_probs(shard[rows].contiguous(), target[rows],
                                                           compute_entropy=True, tp_group=dist.group.WORLD)
        results[name] = tuple(x.cpu() for x in (rows, out_.log_probs.detach(), x.grad, log_probs, entropy))
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, WORLD)


def test_group_sum_adds_in_rank_order(ranks):
    """((r0 + r1) + r2) for every element, wherever it sits: 1 + 1e8 - 1e8 is 0 in that order, 1 in others."""
    values = (1.0, 1e8, -1e8)
    j = torch.arange(30000)
    parts = [torch.tensor(values, dtype=torch.float32)[(r + j) % 3] for r in range(WORLD)]
    expected = (parts[0] + parts[1]) + parts[2]
    assert torch.equal(expected[:3], torch.tensor([0.0, 1.0, 0.0]))  # the order shows in the sums
    for r in range(WORLD):
        assert torch.equal(ranks[r]["group_sum"], expected)


def test_rows_do_not_depend_on_the_batch_under_tp(ranks):
    """Dropping a row or reversing the batch leaves every other row's GRPO log-prob, gradient shard, and
    token_log_probs' log-prob and entropy the same bits, on every rank; the no-gradient log-probs are GRPO's."""
    for r in range(WORLD):
        rows, *full = ranks[r]["all"]
        for name in ("dropped", "reversed"):
            sub_rows, *sub = ranks[r][name]
            for a, b, what in zip(full, sub, ("grpo log_probs", "gradient", "log_probs", "entropy")):
                assert torch.equal(a[sub_rows], b), f"rank {r}, {name}: {what}"
        assert torch.equal(full[0], full[2]), f"rank {r}: token_log_probs differs from grpo_loss's log_probs"


def test_matches_the_float64_reference(ranks):
    """The sharded log-probs, entropies and gradient shards against rl_losses.reference in float64."""
    from rl_losses import reference
    logits, target, advantages, old = _inputs()
    x = logits.double().requires_grad_()
    ref = reference.grpo_loss(x, target, advantages.double(), old.double(), divisor=1.0)
    ref.loss.backward()
    ref_log_probs, ref_entropy = reference.token_log_probs(logits.double(), target, compute_entropy=True)
    for r in range(WORLD):
        _, grpo_log_probs, grad, log_probs, entropy = ranks[r]["all"]
        for got, want, what in ((grpo_log_probs, ref.log_probs, "grpo log_probs"), (log_probs, ref_log_probs,
                                "log_probs"), (entropy, ref_entropy, "entropy"),
                                (grad, x.grad[:, r * (V // WORLD):(r + 1) * (V // WORLD)], "gradient")):
            torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6, msg=what)
