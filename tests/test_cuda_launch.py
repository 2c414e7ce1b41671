"""How the ops launch on a GPU (CUDA only): on the device of their tensors, and over more rows than the
persistent cluster kernel takes in one round.

The cluster kernel (csrc/common/row_pass_cuda.cuh) deals rows out to as many clusters as the device holds at
once; when they do not divide the rows, the rows of the last round go to a tail launch with more CTAs per
row. The shapes below have such a remainder on an H100 or H200 (132 SMs, 3 CTAs each): 1200 rows of 32 KB
(one CTA per row, 396 at once: a tail of 12 rows, 2 CTAs each) and 100 bf16 rows of 128256 (4 CTAs per row,
92 clusters: a tail of 8 rows, 16 CTAs each).
"""
import pytest
import torch

from conftest import assert_close
from helpers import assert_grad_close, label_log_probs64, make_logits, make_target, op_loss, op_reference, requires_cuda

OPS = ["cross_entropy", "grpo", "gspo"]
DOCS = 8


def _inputs(n, v, dtype, device):
    logits = make_logits((n,), v, dtype, device)
    target = make_target((n,), v, device, masked=0.25)
    adv = torch.randn(n, device=device)
    old = (label_log_probs64(logits, target) + 0.1 * torch.randn(n, device=device)).float()
    doc = torch.arange(n, device=device) * DOCS // n
    return logits, target, adv, old, doc


def _check(op, dtype, logits, target, adv, old, doc):
    x = logits.clone().requires_grad_()
    loss = op_loss(op, x, target, adv, old, doc, DOCS)
    loss.backward()
    ref_loss, ref_grad = op_reference(op, logits, target, adv, old, doc, DOCS)
    assert loss.device == logits.device and x.grad.device == logits.device
    assert_close(loss.double().cpu(), ref_loss.cpu(), dtype)
    assert_grad_close(x.grad, ref_grad, dtype)


@requires_cuda
@pytest.mark.parametrize("n, v, dtype", [(1200, 16384, torch.bfloat16), (1200, 8192, torch.float32),
                                         (100, 128256, torch.bfloat16)], ids=["bf16-16384", "fp32-8192", "bf16-128256"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo"])
def test_rows_beyond_one_round_match_reference(op, n, v, dtype):
    _check(op, dtype, *_inputs(n, v, dtype, "cuda"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_ops_run_on_their_tensors_device(op):
    """Tensors on the second GPU while the first is current: every kernel must run where the data is."""
    torch.cuda.set_device(0)
    inputs = _inputs(512, 4096, torch.bfloat16, "cuda:1")
    _check(op, torch.bfloat16, *inputs)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
