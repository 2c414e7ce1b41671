"""Tests of the fused cross-entropy op (docs/math.md) and of the z-loss built on it: values and gradients
against the float64 reference over the option grid, memory layouts, numerics and masked input.

The autograd contract, opcheck, torch.compile, CPU == CUDA and bad input are in test_cross_entropy_contract.py;
the runs and comparisons both use are in helpers_cross_entropy.py.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import TOLERANCES, assert_close
from helpers import DTYPES, assert_grad_close, make_logits, make_target, param_id as _id
from helpers_cross_entropy import check_against_reference, rows_for, run_op, run_reference

VOCABS = [1, 7, 256, 500, 769, 32000, 50257]
SHAPES = [(64,), (16, 8)]


# ---- parity with the float64 reference --------------------------------------------------------------------
# (options, upstream gradient g). "plain" keeps g = 1: the path where the backward skips the rescale.
OPTIONS = {
    "plain": ({}, 1.0),
    "scaled": ({"logits_scale_factor": 0.37}, 1.7),
    "smoothing": ({"label_smoothing": 0.1}, -0.6),
    "z_loss": ({"z_loss_factor": 1e-3}, 2.5),
    "combined": ({"logits_scale_factor": 2.5, "label_smoothing": 0.2, "z_loss_factor": 1e-2}, 0.3),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("vocab", VOCABS)
def test_matches_reference(vocab, shape, dtype, option, device):
    kwargs, upstream = OPTIONS[option]
    shape = rows_for(shape, vocab)
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device)
    check_against_reference(logits, target, upstream, **kwargs)


REDUCTIONS = {
    "mean": {"reduction": "mean"},
    "mean_divisor": {"reduction": "mean", "divisor": 37.5},
    "sum": {"reduction": "sum"},
    "sum_divisor": {"reduction": "sum", "divisor": 5.0},
    "none": {"reduction": "none"},
}


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=_id)
@pytest.mark.parametrize("vocab", [7, 769])
def test_reductions(vocab, dtype, reduction, device):
    shape = (16, 8)
    kwargs = dict(REDUCTIONS[reduction], logits_scale_factor=1.3, label_smoothing=0.05, z_loss_factor=1e-3)
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device)
    # reduction="none": a random upstream gradient per token; otherwise a scalar g != 1.
    upstream = torch.randn(shape, device=device) if reduction == "none" else 0.8
    check_against_reference(logits, target, upstream, **kwargs)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("vocab", [1, 7, 769, 32000])
def test_float64(vocab, option, device):
    kwargs, upstream = OPTIONS[option]
    shape = rows_for((16, 8), vocab)
    check_against_reference(make_logits(shape, vocab, torch.float64, device), make_target(shape, vocab, device),
                            upstream, **kwargs)


def test_divisor_default_is_labelled_count(device):
    # docs/math.md: with ε = ζ = 0 and reduction "mean" the op is F.cross_entropy(s·z, y) over labelled tokens.
    logits = make_logits((64,), 300, torch.float64, device)
    target = make_target((64,), 300, device)
    loss = rl_losses.cross_entropy(logits, target, logits_scale_factor=0.7)
    expected = torch.nn.functional.cross_entropy(logits * 0.7, torch.where(target < 0, -100, target),
                                                 ignore_index=-100)
    assert_close(loss, expected, torch.float64)
    explicit = rl_losses.cross_entropy(logits, target, logits_scale_factor=0.7, divisor=11.0)
    summed = rl_losses.cross_entropy(logits, target, logits_scale_factor=0.7, reduction="sum")
    assert_close(explicit, summed / 11.0, torch.float64)
    assert_close(loss, summed / (target >= 0).sum(), torch.float64)


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32], ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("vocab", [7, 769, 50257])
def test_label_dtypes(vocab, dtype, label_dtype, device):
    shape = rows_for((16, 8), vocab)
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, dtype=label_dtype)
    check_against_reference(logits, target, 1.4, label_smoothing=0.1)


@pytest.mark.parametrize(("vocab", "scale"), [(32000, 1.0), (32000, 2.5), (262144, 1.0)])
def test_large_vocab_float32_accuracy(vocab, scale, device):
    """The fp32 log-sum-exp must stay accurate over long rows.

    Each p_j = exp(x_j - lse) carries the absolute error of lse as a relative error, so every entry of the
    gradient s·p_j (reduction "sum", no smoothing) is compared relatively, without an absolute floor that
    would hide it. (F.cross_entropy in fp32 stays within 7e-6 of float64 on these cases.)
    """
    shape = (4,)
    logits = make_logits(shape, vocab, torch.float32, device)
    target = make_target(shape, vocab, device, masked=0.0)
    loss, grad = run_op(rl_losses.cross_entropy, logits, target, reduction="sum", logits_scale_factor=scale)
    ref_loss, ref_grad = run_reference(reference.cross_entropy, logits, target, reduction="sum",
                                       logits_scale_factor=scale)
    rtol = TOLERANCES[torch.float32][0]
    torch.testing.assert_close(loss.double().cpu(), ref_loss.cpu(), rtol=rtol, atol=0)
    torch.testing.assert_close(grad.double().cpu(), ref_grad.cpu(), rtol=rtol, atol=1e-30)


# ---- memory layouts ---------------------------------------------------------------------------------------
def _layout(name, shape, vocab, dtype, device):
    """Logits of shape (*shape, vocab) that are not plainly contiguous."""
    if name == "sliced":  # row stride V + 13: a view of a wider tensor
        return make_logits(shape, vocab + 13, dtype, device)[..., :vocab]
    if name == "offset":  # same, starting at column 5
        return make_logits(shape, vocab + 13, dtype, device)[..., 5:5 + vocab]
    if name == "every_other_row":  # 2-D, row stride 2V
        n_rows = shape[0] * shape[1]
        return make_logits((2 * n_rows,), vocab, dtype, device)[::2]
    if name == "transposed_batch":  # batch dims that cannot be merged into one row stride (the copy path)
        return make_logits(shape[::-1], vocab, dtype, device).transpose(0, 1)
    raise ValueError(name)


@pytest.mark.parametrize("layout", ["sliced", "offset", "every_other_row", "transposed_batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("vocab", [7, 769])
def test_non_contiguous_rows(vocab, dtype, layout, device):
    logits = _layout(layout, (16, 8), vocab, dtype, device)
    assert not logits.is_contiguous()
    target = make_target(tuple(logits.shape[:-1]), vocab, device)
    check_against_reference(logits, target, 1.9, logits_scale_factor=0.8, label_smoothing=0.1)


@pytest.mark.parametrize("upstream", [1.0, 2.3])
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "every_other_row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_inplace_backward(dtype, layout, upstream, device):
    vocab, shape = 300, (16, 8)
    if layout == "contiguous":
        base = make_logits(shape, vocab, dtype, device)
        columns = slice(None)
    elif layout == "sliced":  # row stride V + 9
        base = make_logits(shape, vocab + 9, dtype, device)
        columns = slice(0, vocab)
    else:  # 2-D logits with row stride 2V (a 3-D every-other-row view would not flatten to one row stride)
        shape = (128,)
        base = make_logits((256,), vocab, dtype, device)
        columns = slice(None)
    target = make_target(shape, vocab, device)
    original = base.detach().clone()
    leaf = base.clone().requires_grad_()
    work = leaf.clone()  # a non-leaf copy that the op is allowed to overwrite
    logits = work[..., columns] if layout != "every_other_row" else work[::2]
    before = logits.detach().clone()
    kwargs = dict(logits_scale_factor=1.2, label_smoothing=0.1, z_loss_factor=1e-3)
    loss = rl_losses.cross_entropy(logits, target, inplace_backward=True, **kwargs)
    (loss * upstream).backward()
    assert leaf.grad is not None

    ref_loss, ref_grad = run_reference(reference.cross_entropy, before, target, upstream, **kwargs)
    assert_close(loss.detach(), ref_loss, dtype)
    grad = leaf.grad[..., columns] if layout != "every_other_row" else leaf.grad[::2]
    assert_grad_close(grad, ref_grad, dtype)
    # The gradient was written into the logits' own storage (and scaled there by g) ...
    assert torch.equal(logits.detach(), grad)
    # ... and nothing outside the logits view was touched.
    untouched = torch.ones_like(original, dtype=torch.bool)
    if layout == "every_other_row":
        untouched[::2] = False
    else:
        untouched[..., columns] = False
    assert torch.equal(work.detach()[untouched], original[untouched])
    assert torch.count_nonzero(leaf.grad[untouched]) == 0


def test_inplace_backward_without_grad_leaves_logits(device):
    logits = make_logits((16,), 50, torch.float32, device)
    target = make_target((16,), 50, device)
    before = logits.clone()
    loss = rl_losses.cross_entropy(logits, target, inplace_backward=True)
    assert torch.equal(logits, before)
    assert_close(loss, reference.cross_entropy(before.double(), target), torch.float32)


# ---- numerics ---------------------------------------------------------------------------------------------
def test_confident_prediction_bf16(device):
    """p_y -> 1: the label's gradient (p_y - 1)·s/D is tiny. A bf16 softmax rounds p_y to 1 (or to the
    nearest multiple of 2^-9) and loses it; the op must keep it to bf16's relative precision."""
    n_rows, vocab = 32, 256
    target = torch.randint(0, vocab, (n_rows,), device=device)
    logits = torch.randn(n_rows, vocab, device=device) * 0.5
    # 1 - p_y from about 4e-2 down to 2e-4 over the rows.
    gaps = torch.linspace(9.0, 14.0, n_rows, device=device)
    logits[torch.arange(n_rows, device=device), target] += gaps
    logits = logits.to(torch.bfloat16)
    loss, grad = run_op(rl_losses.cross_entropy, logits, target)
    ref_loss, ref_grad = run_reference(reference.cross_entropy, logits, target)
    rtol = TOLERANCES[torch.bfloat16][0]
    torch.testing.assert_close(loss.double().cpu(), ref_loss.cpu(), rtol=rtol, atol=0)
    # Relative comparison of every entry (no absolute floor: the entries are all far below bf16's atol).
    torch.testing.assert_close(grad.double().cpu(), ref_grad.cpu(), rtol=rtol, atol=0)
    # The case is hard: the naive bf16 gradient misses the label entries by more than the tolerance.
    naive = (torch.softmax(logits, dim=-1) - torch.nn.functional.one_hot(target, vocab).to(logits.dtype)) / n_rows
    rows = torch.arange(n_rows, device=device)
    naive_err = ((naive[rows, target].double() - ref_grad[rows, target]).abs() / ref_grad[rows, target].abs())
    assert (naive_err > rtol).any()


# ---- z-loss alone -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("divisor", [None, 20.0])
@pytest.mark.parametrize("mask", ["no_mask", "bool", "int"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=_id)
def test_z_loss(dtype, mask, divisor, device):
    shape, vocab = (16, 8), 500
    logits = make_logits(shape, vocab, dtype, device)
    loss_mask = None
    if mask != "no_mask":
        loss_mask = torch.rand(shape, device=device) < 0.6
        loss_mask = loss_mask if mask == "bool" else loss_mask.to(torch.int64)
    kwargs = dict(loss_mask=loss_mask, logits_scale_factor=0.8, divisor=divisor)

    x = logits.detach().clone().requires_grad_()
    loss = rl_losses.z_loss(x, **kwargs)
    (loss * 1.3).backward()
    xr = logits.detach().double().requires_grad_()
    ref = reference.z_loss(xr, **kwargs)
    (ref * 1.3).backward()
    assert_close(loss.detach(), ref.detach(), dtype)
    assert_grad_close(x.grad, xr.grad, dtype)
    if loss_mask is not None:
        assert torch.count_nonzero(x.grad[~loss_mask.bool()]) == 0


# ---- masked and empty input -------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=_id)
def test_all_masked(dtype, reduction, device):
    shape, vocab = (16, 8), 100
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device, masked=1.0)
    assert (target < 0).all()
    upstream = torch.randn(shape, device=device) if reduction == "none" else 1.5
    loss, grad = run_op(rl_losses.cross_entropy, logits, target, upstream, reduction=reduction,
                        label_smoothing=0.1, z_loss_factor=1e-3)
    assert torch.equal(loss, torch.zeros_like(loss)), loss
    assert grad.shape == logits.shape
    assert torch.equal(grad, torch.zeros_like(grad))  # exactly zero, and hence no NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_masked_rows_get_exact_zero_gradient(dtype, device):
    shape, vocab = (16, 8), 257
    logits = make_logits(shape, vocab, dtype, device)
    target = make_target(shape, vocab, device)
    target[3] = -100  # a whole sequence without labels
    _, grad = run_op(rl_losses.cross_entropy, logits, target, 0.7, label_smoothing=0.2, z_loss_factor=1e-2)
    assert torch.count_nonzero(grad[target < 0]) == 0
    assert (grad[target >= 0].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(0,), (3, 0)], ids=_id)
def test_empty_input(shape, reduction, device):
    vocab = 7
    logits = make_logits(shape, vocab, torch.float32, device).requires_grad_()
    target = torch.zeros(shape, dtype=torch.long, device=device)
    loss = rl_losses.cross_entropy(logits, target, reduction=reduction)
    if reduction == "none":
        assert loss.shape == shape
        loss.sum().backward()
    else:
        assert loss.shape == ()
        assert loss.item() == 0.0
        loss.backward()
    assert logits.grad.shape == logits.shape
