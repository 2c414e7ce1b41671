"""The ops captured in a CUDA graph and replayed on new inputs (CUDA only).

On sm_90 every kernel of the library is a programmatic dependent launch (csrc/common/dependent_launch.cuh);
under stream capture those launches become programmatic edges of the graph. Each replay here runs on fresh
values copied into the captured buffers and must agree with the float64 reference on those values: a capture
that failed, or a replay that reused the first inputs, fails the test. (A replay that read a buffer before
its producer finished would show only if the race struck: a few replays at this size make that unlikely.)
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_grad_close, label_log_probs64, make_logits, make_target, requires_cuda

N, V = 256, 4096  # one cluster-kernel row pass (bf16 rows of 8 KB) and, for GSPO, the two-pass path


def _loss(op, x, t, adv, old, doc):
    if op == "cross_entropy":
        return rl_losses.cross_entropy(x, t)
    if op == "grpo":
        return rl_losses.grpo_loss(x, t, adv, old).loss
    return rl_losses.gspo_loss(x, t, adv, old, doc, num_documents=8).loss


def _reference(op, x, t, adv, old, doc):
    x = x.detach().double().requires_grad_()
    if op == "cross_entropy":
        loss = reference.cross_entropy(x, t)
    elif op == "grpo":
        loss = reference.grpo_loss(x, t, adv.double(), old.double()).loss
    else:
        loss = reference.gspo_loss(x, t, adv.double(), old.double(), doc, num_documents=8).loss
    loss.backward()
    return loss.detach(), x.grad


def _fresh(dtype):
    logits = make_logits((N,), V, dtype, "cuda")
    target = make_target((N,), V, "cuda", masked=0.25)
    adv = torch.randn(N, device="cuda")
    old = (label_log_probs64(logits, target) + 0.1 * torch.randn(N, device="cuda")).float()
    doc = torch.arange(N, device="cuda") * 8 // N  # 8 documents of 32 tokens
    return logits, target, adv, old, doc


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
def test_cuda_graph_replay_matches_reference(op, dtype):
    logits, target, adv, old, doc = _fresh(dtype)
    x = logits.clone().requires_grad_()

    def step():
        loss = _loss(op, x, target, adv, old, doc)
        (grad,) = torch.autograd.grad(loss, x)
        return loss, grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, grad = step()

    for _ in range(3):
        new = _fresh(dtype)
        with torch.no_grad():
            for buf, value in zip((x, target, adv, old, doc), new):
                buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        ref_loss, ref_grad = _reference(op, x, target, adv, old, doc)
        assert_close(loss.double(), ref_loss, dtype)
        assert_grad_close(grad, ref_grad, dtype)
