"""Vocabulary-parallel distillation on gloo: 2 processes (CPU tensors, FileStore rendezvous) each hold a column
shard of the student's and the teacher's logits; every rank's loss must equal the single-process loss on the
whole vocabulary and its gradient the single-process gradient's column block, for every kind."""
import pytest
import torch
import torch.distributed as dist

import rl_losses

from conftest import assert_close
from helpers import assert_grad_close, gloo_world_results

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
CASES = {  # name: (kind, options, student dtype, vocabulary, column cut)
    "forward_kl": ("forward_kl", dict(temperature=1.5), torch.float64, 24, 12),
    "reverse_kl_uneven_values": ("reverse_kl", dict(logits_scale_factor=0.7), torch.float64, 24, 12),
    "cross_entropy_fp32": ("cross_entropy", dict(), torch.float32, 30, 15),
    "jsd_masked": ("jsd", dict(beta=0.3, mask=True), torch.float64, 26, 13),
    "jsd_divisor_fp32": ("jsd", dict(beta=0.7, divisor=4.0), torch.float32, 32, 16),
}


def _inputs(name):
    kind, options, dtype, vocab, _ = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 7919 + vocab)
    logits = (torch.randn(3, 5, vocab, generator=g) * 2).to(dtype)
    teacher = logits.double() + torch.randn(3, 5, vocab, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3 if options.get("mask") else None
    kwargs = {k: v for k, v in options.items() if k != "mask"}
    return logits, teacher, mask, dict(kind=kind, loss_mask=mask, **kwargs)


def _run(logits, teacher, kwargs, tp_group=None):
    x = logits.clone().requires_grad_()
    out = rl_losses.distillation_loss(x, teacher, tp_group=tp_group, **kwargs)
    (out.loss * 1.3).backward()
    return {"loss": out.loss.detach(), "divergence": out.divergence, "grad": x.grad}


def _rank_results(rank):
    results = {}
    for name, (_, _, _, vocab, cut) in CASES.items():
        logits, teacher, _, kwargs = _inputs(name)
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        results[name] = _run(logits[..., cols].contiguous(), teacher[..., cols].contiguous(), kwargs,
                             tp_group=dist.group.WORLD)
    return results


@pytest.fixture(scope="module")
def world_results():
    return gloo_world_results(_rank_results, WORLD)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name, world_results):
    _, _, dtype, vocab, cut = CASES[name]
    logits, teacher, mask, kwargs = _inputs(name)
    expected = _run(logits, teacher, kwargs)
    for rank, results in enumerate(world_results):
        got = results[name]
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        assert_close(got["loss"], expected["loss"], dtype, scale=2.0, msg=f"loss, rank {rank}")
        assert_close(got["divergence"], expected["divergence"], dtype, scale=2.0, msg=f"divergence, rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., cols], dtype, scale=2.0)
