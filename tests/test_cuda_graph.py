"""The ops captured in a CUDA graph and replayed on new inputs (CUDA only).

On sm_90 every kernel of the library is a programmatic dependent launch (csrc/common/dependent_launch.cuh);
under stream capture those launches become programmatic edges of the graph. Each replay here runs on fresh
values copied into the captured buffers and must agree with the float64 reference on those values: a capture
that failed, or a replay that reused the first inputs, fails the test. (A replay that read a buffer before
its producer finished would show only if the race struck: a few replays at this size make that unlikely.)
"""
import pytest
import torch

from conftest import assert_close
from helpers import assert_grad_close, make_logits, op_loss, op_reference, policy_inputs, requires_cuda

# 256 rows: one round of the cluster kernel (bf16 rows of 8 KB) and, for GSPO, the two-pass path; 1200 rows of
# 16384: a main and a tail launch of the cluster kernel on an H100/H200 (test_cuda_launch.py).
SHAPES = [(256, 4096), (1200, 16384)]
DOCS = 8


def _fresh(n, v, dtype):
    logits = make_logits((n,), v, dtype, "cuda")
    return (logits, *policy_inputs(logits, DOCS))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
@pytest.mark.parametrize("n, v", SHAPES, ids=["256x4096", "1200x16384"])
def test_cuda_graph_replay_matches_reference(op, dtype, n, v):
    logits, target, adv, old, doc = _fresh(n, v, dtype)
    x = logits.clone().requires_grad_()

    def step():
        loss = op_loss(op, x, target, adv, old, doc, DOCS)
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
        new = _fresh(n, v, dtype)
        with torch.no_grad():
            for buf, value in zip((x, target, adv, old, doc), new):
                buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        ref_loss, ref_grad = op_reference(op, x, target, adv, old, doc, DOCS)
        assert_close(loss.double(), ref_loss, dtype)
        assert_grad_close(grad, ref_grad, dtype)
