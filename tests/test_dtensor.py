"""On 2 gloo ranks (CPU): the linear_* ops and linear_token_log_probs with an FSDP2-style DTensor lm_head weight
(sharded over the vocabulary rows, or replicated), and vocabulary-parallel token_log_probs (tp_group). Each
rank saves its outputs and gradients; the tests compare them here with the single-process float64 reference."""
from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
N, H, V = 7, 6, 10


def _inputs():
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8
    target = torch.randint(0, V, (N,), generator=g)
    target[2] = -100
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    old = -torch.rand(N, generator=g, dtype=torch.float64) * 3
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    g_lp, g_h = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    return hidden, weight, target, advantages, old, logits, g_lp, g_h


def _ops(hidden, weight, target, advantages, old):
    import rl_losses

    lp, ent = rl_losses.linear_token_log_probs(hidden, weight, target, compute_entropy=True, chunk_size=3)
    return {
        "linear_cross_entropy": rl_losses.linear_cross_entropy(hidden, weight, target, chunk_size=3),
        "linear_grpo": rl_losses.linear_grpo_loss(hidden, weight, target, advantages, old).loss,
        "linear_gspo": rl_losses.linear_gspo_loss(hidden, weight, target, advantages, old,
                                                  torch.arange(N) // 4, num_documents=2).loss,
        "linear_token_log_probs": lp.sum() + 0.5 * ent.sum(),
    }


def _rank(rank, store_path, out_dir):
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        import rl_losses

        dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
        mesh = init_device_mesh("cpu", (WORLD,))
        hidden, weight, target, advantages, old, logits, g_lp, g_h = _inputs()
        results = {}
        for placement in ("shard", "replicate"):
            for name in _ops(hidden, weight, target, advantages, old):
                w = distribute_tensor(weight, mesh, [Shard(0) if placement == "shard" else Replicate()])
                w.requires_grad_()
                h = hidden.clone().requires_grad_()
                loss = _ops(h, w, target, advantages, old)[name]
                loss.backward()
                results[(placement, name)] = (loss.detach(), h.grad, w.grad.full_tensor())
        try:
            rl_losses.linear_cross_entropy(distribute_tensor(hidden, mesh, [Shard(0)]), weight, target)
        except ValueError as e:
            results["hidden_error"] = str(e)
        # Vocabulary-parallel token_log_probs: this rank's column block of the logits.
        block = logits.chunk(WORLD, dim=-1)[rank].clone().requires_grad_()
        lp, ent = rl_losses.token_log_probs(block, target, temperature=0.7, compute_entropy=True,
                                            tp_group=dist.group.WORLD)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        results["tp"] = (lp.detach(), ent.detach(), block.grad)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (the parent reports the traceback)
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())


@pytest.fixture(scope="module")
def world_results():
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(out_dir, "store"), out_dir)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
            if p.is_alive():
                p.terminate()
        errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
        assert not errors, "\n".join(errors)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


def _reference(name):
    from rl_losses import reference

    hidden, weight, target, advantages, old, *_ = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if name == "linear_token_log_probs":
        lp, ent = reference.linear_token_log_probs(h, w, target, compute_entropy=True)
        loss = lp.sum() + 0.5 * ent.sum()
    else:
        loss = _ops(h, w, target, advantages, old)[name]  # the plain-tensor op: its own tests check it
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("placement", ["shard", "replicate"])
@pytest.mark.parametrize("name", ["linear_cross_entropy", "linear_grpo", "linear_gspo", "linear_token_log_probs"])
def test_dtensor_weight(world_results, placement, name):
    expected = _reference(name)
    for rank in range(WORLD):
        for a, e in zip(world_results[rank][(placement, name)], expected):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def test_dtensor_hidden_is_refused(world_results):
    assert "hidden is a DTensor" in world_results[0]["hidden_error"]


def test_tensor_parallel_token_log_probs(world_results):
    from rl_losses import reference

    _, _, target, _, _, logits, g_lp, g_h = _inputs()
    x = logits.clone().requires_grad_()
    lp, ent = reference.token_log_probs(x, target, logits_scale_factor=1 / 0.7, compute_entropy=True)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    for rank in range(WORLD):
        r_lp, r_ent, r_grad = world_results[rank]["tp"]
        torch.testing.assert_close(r_lp, lp.detach(), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(r_ent, ent.detach(), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(r_grad, x.grad.chunk(WORLD, dim=-1)[rank], rtol=1e-9, atol=1e-12)
