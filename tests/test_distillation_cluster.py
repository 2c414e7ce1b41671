"""The CUDA cluster kernel of distillation (csrc/distillation/distillation_cluster.cuh): on sm_90, a forward that
computes the gradient runs every step of a row in one launch, the row split over up to 8 CTAs (JSD: 4; a last
round's tail launch up to 16) that hold the student's and the teacher's slices in shared memory. Against the
float64 reference for each shape (CTAs per row: bf16 + bf16 V = 128256: 8; bf16 + fp32 V = 65536: 7; bf16 + fp32
V = 128256: 12; fp32 + fp32: 16; V = 250000 bf16: 16; small V: 1 and 2), masked rows, the tail launch of a
part-empty last round, inplace_backward; and the kernel launched exactly where it applies (the profiler's kernel
names), the separate passes elsewhere."""
import pytest
import torch

import rl_losses

from helpers import kernel_launches, param_id as _id, requires_cuda
from test_distillation import KINDS, check, make_inputs, run_op

KERNEL = "distill_cluster_kernel"


def _sm90():
    return torch.cuda.get_device_capability()[0] == 9


def launches(fn):
    return kernel_launches(fn, KERNEL)


def check_all_kinds(logits, teacher, mask, scale=4.0):
    for kind in KINDS:
        check(logits, teacher, 1.3, scale=scale, kind=kind, beta=0.35, temperature=1.2, loss_mask=mask,
              logits_scale_factor=0.9)


# (student dtype, teacher dtype, vocab, CTAs per row on sm_90).
SHAPES = [
    (torch.bfloat16, torch.bfloat16, 128256, 8),
    (torch.bfloat16, torch.float32, 65536, 7),
    (torch.bfloat16, torch.float32, 128256, 12),
    (torch.float32, torch.float32, 128256, 16),
    (torch.float16, torch.bfloat16, 151936, 10),
    (torch.bfloat16, torch.bfloat16, 250000, 16),
    (torch.float32, torch.bfloat16, 4096, 1),
    (torch.bfloat16, torch.float16, 32000, 2),
]
# The most CTAs per row the kernel takes (kDistillClusterMaxCtas), by kind.
MAX_CTAS = {"forward_kl": 8, "reverse_kl": 8, "cross_entropy": 8, "jsd": 4}


@requires_cuda
@pytest.mark.parametrize("dtype, teacher_dtype, vocab, ctas", SHAPES, ids=lambda x: _id(x) or str(x))
def test_cluster_kernel_matches_the_float64_reference(dtype, teacher_dtype, vocab, ctas):
    logits, teacher, mask = make_inputs((7,), vocab, dtype, "cuda", teacher_dtype=teacher_dtype, masked=0.25)
    check_all_kinds(logits, teacher, mask)
    if _sm90():
        x = logits.detach().clone().requires_grad_()
        for kind in ("forward_kl", "jsd"):
            n = launches(lambda: rl_losses.distillation_loss(x, teacher, kind=kind, beta=0.35, loss_mask=mask))
            assert n == (1 if ctas <= MAX_CTAS[kind] else 0), (kind, ctas)


@requires_cuda
@pytest.mark.parametrize("rows, masked", [(997, 0.3), (613, 0.0), (200, 0.9)])
def test_many_rows_tail_launch_and_masked_rows(rows, masked):
    """More rows than resident clusters: the persistent grid's rounds, a part-empty last round's tail launch
    (CTAs of another cluster size), and clusters reading different numbers of rows where most rows are masked
    (the barriers' phases follow the rows read)."""
    logits, teacher, mask = make_inputs((rows,), 32000, torch.bfloat16, "cuda", masked=masked)
    check_all_kinds(logits, teacher, mask)
    if _sm90():
        x = logits.detach().clone().requires_grad_()
        n = launches(lambda: rl_losses.distillation_loss(x, teacher, kind="reverse_kl", loss_mask=mask))
        assert n in (1, 2)
        props = torch.cuda.get_device_properties(0)
        if props.multi_processor_count == 132 and rows == 997:
            # 2 CTAs per row, ~198 resident clusters: 997 rows leave a last round of a few rows.
            assert n == 2, "a part-empty last round takes a tail launch"


@requires_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_inplace_backward_matches(kind):
    logits, teacher, mask = make_inputs((9,), 128256, torch.bfloat16, "cuda", masked=0.3)
    out, grad = run_op(logits, teacher, kind=kind, loss_mask=mask, beta=0.4)
    x = logits.clone().requires_grad_()
    y = x * 1.0  # a non-leaf whose storage the gradient overwrites
    out_inplace = rl_losses.distillation_loss(y, teacher, kind=kind, loss_mask=mask, beta=0.4, inplace_backward=True)
    out_inplace.loss.backward()
    torch.testing.assert_close(out_inplace.loss, out.loss, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, grad, rtol=0, atol=0)


@requires_cuda
def test_divisor_and_scale():
    logits, teacher, mask = make_inputs((5,), 65536, torch.bfloat16, "cuda", masked=0.4)
    for kind in KINDS:
        check(logits, teacher, -0.7, scale=4.0, kind=kind, beta=0.6, loss_mask=mask, divisor=3.0,
              logits_scale_factor=1.3, temperature=0.7)


@requires_cuda
def test_where_the_cluster_kernel_does_not_apply():
    """V not a multiple of 8, an fp64 teacher, rows off a 16-byte boundary, no gradient, the batch-invariant mode,
    a row too long for 16 CTAs: the separate passes, still matching the reference."""
    if not _sm90():
        pytest.skip("the cluster kernel runs on sm_90 only")
    def leaf(logits):
        return logits.detach().clone().requires_grad_()

    cases = []
    logits, teacher, mask = make_inputs((3,), 4100, torch.bfloat16, "cuda", masked=0.3)
    cases.append(("vocab % 8", logits, teacher, mask, leaf))
    logits, teacher, mask = make_inputs((3,), 4096, torch.bfloat16, "cuda", teacher_dtype=torch.float64)
    cases.append(("fp64 teacher", logits, teacher, mask, leaf))
    logits, teacher, mask = make_inputs((2,), 151936, torch.float32, "cuda")  # 8 bytes a column: 19 CTAs
    cases.append(("too long", logits, teacher, mask, leaf))

    def unaligned(logits):  # each row one element past a 16-byte boundary (a view: the op keeps its strides)
        pad = torch.zeros(logits.shape[0], logits.shape[1] + 8, dtype=logits.dtype, device="cuda")
        pad[:, 1:logits.shape[1] + 1] = logits
        return pad.requires_grad_()[:, 1:logits.shape[1] + 1]

    logits, teacher, mask = make_inputs((3,), 4096, torch.bfloat16, "cuda", masked=0.3)
    cases.append(("unaligned", logits, teacher, mask, unaligned))
    for name, logits, teacher, mask, student in cases:
        check_all_kinds(logits, teacher, mask)
        x = student(logits)
        assert launches(lambda: rl_losses.distillation_loss(x, teacher, kind="jsd", loss_mask=mask)) == 0, name
    logits, teacher, mask = make_inputs((3,), 4096, torch.bfloat16, "cuda")
    with torch.no_grad():
        assert launches(lambda: rl_losses.distillation_loss(logits, teacher, kind="forward_kl")) == 0
    x = logits.detach().clone().requires_grad_()
    with rl_losses.batch_invariant():
        check_all_kinds(logits, teacher, mask)
        assert launches(lambda: rl_losses.distillation_loss(x, teacher, kind="forward_kl")) == 0


@requires_cuda
def test_infinite_logits_match_the_separate_passes():
    """−inf logits (a masked vocabulary; whole 16-byte groups of both rows, where a thread's maxima are still −inf)
    give what the separate passes give (the batch-invariant mode takes them): the cluster kernel tests the maxima
    for −inf once per group."""
    if not _sm90():
        pytest.skip("the cluster kernel runs on sm_90 only")
    logits, teacher, _ = make_inputs((5,), 32000, torch.bfloat16, "cuda")
    logits[:, :64] = float("-inf")
    teacher[:, :64] = float("-inf")
    teacher[:, 100:3000:7] = float("-inf")
    logits[1, 5000:5100] = float("-inf")  # where the teacher is not: the forward KL and the cross-entropy are inf
    for kind in KINDS:
        fused, fused_grad = run_op(logits, teacher, kind=kind, beta=0.3)
        with rl_losses.batch_invariant():
            split, split_grad = run_op(logits, teacher, kind=kind, beta=0.3)
        torch.testing.assert_close(fused.divergence, split.divergence, rtol=1e-5, atol=1e-6, equal_nan=True,
                                   msg=kind)
        torch.testing.assert_close(fused_grad.float(), split_grad.float(), rtol=2e-2, atol=1e-7, equal_nan=True,
                                   msg=kind)
