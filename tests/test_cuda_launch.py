"""How the ops launch on a GPU (CUDA only): on the device of their tensors, and over more rows than the
persistent cluster kernel takes in one round.

The cluster kernel (csrc/common/cuda/cluster_kernel.cuh) deals rows out to as many clusters as the device holds at
once; when they do not divide the rows, the rows of the last round go to a tail launch with more CTAs per
row. The shapes below have such a remainder on an H100 or H200 (132 SMs): 1200 rows of 32 KB (one CTA per
row, 396 at once: a tail of 12 rows, 2 CTAs each; fp32 rows may get 4 CTAs per SM, by registers) and 100 bf16
rows of 128256 (4 CTAs per row, 92 clusters: a tail of 8 rows, 16 CTAs each).
"""
import pytest
import torch

import rl_losses
from conftest import assert_close
from helpers import (assert_grad_close, kernel_launches, make_logits, op_loss, op_reference, policy_inputs,
                     requires_cuda)

DOCS = 8
SHAPES = [(1200, 16384, torch.bfloat16), (1200, 16384, torch.float16), (1200, 8192, torch.float32),
          (100, 128256, torch.bfloat16)]


def _check(op, n, v, dtype, layout, device="cuda", masked=0.25):
    """fwd+bwd against the float64 reference. layout: "contiguous"; "sliced", the logits a column slice of a
    wider tensor (row stride V + 16 bytes; the gradient, a new tensor, has stride V); "inplace", the gradient
    written over the logits (inplace_backward)."""
    pad = 16 // torch.empty((), dtype=dtype).element_size() if layout == "sliced" else 0
    base = make_logits((n,), v + pad, dtype, device)
    target, adv, old, doc = policy_inputs(base[:, :v], DOCS, masked)
    leaf = base.clone().requires_grad_()
    work = leaf.clone() if layout == "inplace" else leaf  # a non-leaf copy the op may overwrite
    loss = op_loss(op, work[:, :v], target, adv, old, doc, DOCS, inplace_backward=layout == "inplace")
    loss.backward()
    ref_loss, ref_grad = op_reference(op, base[:, :v], target, adv, old, doc, DOCS)
    assert loss.device == base.device
    assert_close(loss.double().cpu(), ref_loss.cpu(), dtype)
    assert_grad_close(leaf.grad[:, :v], ref_grad, dtype)
    assert not leaf.grad[:, v:].any()


@requires_cuda
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "inplace"])
@pytest.mark.parametrize("n, v, dtype", SHAPES, ids=["bf16-16384", "fp16-16384", "fp32-8192", "bf16-128256"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo"])
def test_rows_beyond_one_round_match_reference(op, n, v, dtype, layout):
    _check(op, n, v, dtype, layout)


@requires_cuda
@pytest.mark.parametrize("masked", [0.9, 1.0])
@pytest.mark.parametrize("n, v, dtype", [SHAPES[0], (1200, 128256, torch.bfloat16)], ids=["bf16-16384", "bf16-128256"])
@pytest.mark.parametrize("op", ["grpo", "gspo"])
def test_mostly_masked_rows_match_reference(op, n, v, dtype, masked):
    """GRPO and GSPO's statistics pass skip unlabelled rows (no read, a zero gradient): the clusters then read
    different numbers of rows, and the barriers' phases must follow the rows read, not the loop. 1200 rows of
    128256 give clusters of 4 CTAs about 13 rows each."""
    _check(op, n, v, dtype, "contiguous", masked=masked)
    _check(op, n, v, dtype, "inplace", masked=masked)


@requires_cuda
def test_a_part_empty_last_round_takes_a_tail_launch():
    """The shape of the first test, on a 132-SM sm_90 device, runs as a main and a tail launch."""
    props = torch.cuda.get_device_properties(0)
    if props.major != 9 or props.multi_processor_count != 132:
        pytest.skip("the expected split is worked out for the 132 SMs of an H100/H200 SXM")
    logits = make_logits((1200,), 16384, torch.bfloat16, "cuda")
    target, *_ = policy_inputs(logits, DOCS)
    x = logits.requires_grad_()  # the forward then computes the gradient: the fused pass
    assert kernel_launches(lambda: rl_losses.cross_entropy(x, target), "row_cluster_kernel") == 2
    # One round: no tail.
    assert kernel_launches(lambda: rl_losses.cross_entropy(x[:300], target[:300]), "row_cluster_kernel") == 1


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@requires_cuda
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
def test_ops_run_on_their_tensors_device(op):
    """Tensors on the second GPU while the first is current: every kernel must run where the data is."""
    torch.cuda.set_device(0)
    _check(op, 512, 4096, torch.bfloat16, "contiguous", device="cuda:1")
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
