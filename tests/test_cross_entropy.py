"""Tests of the fused cross-entropy op (docs/math.md) and of the z-loss built on it.

Every result is compared with the pure-PyTorch reference (rl_losses.reference) run in float64 on the same
logits, upcast only after they were rounded to the test dtype, so that what is left is the op's own error.
Gradients are compared relative to their largest entry (they scale with s·g/D), so that one tolerance per
dtype means the same thing at every vocabulary size, divisor and upstream gradient.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import TOLERANCES, assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, gradcheck_fresh, make_logits, make_target,
                     param_id as _id, requires_cuda)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCABS = [1, 7, 256, 500, 769, 32000, 50257]
SHAPES = [(64,), (16, 8)]
_ops = torch.ops.rl_losses


# ---- inputs and references --------------------------------------------------------------------------------
def _backward(loss, upstream):
    if loss.dim() == 0:
        (loss * upstream).backward()  # a scalar upstream gradient g != 1 reaches the op as grad_output
    else:
        loss.backward(upstream)


def run_op(fn, logits, target, upstream=1.0, **kwargs):
    """The op's loss and gradient on a fresh leaf copy of `logits` with the same strides."""
    x = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=logits.device)
    x = x.copy_(logits.detach()).requires_grad_()
    assert x.stride() == logits.stride()
    loss = fn(x, target, **kwargs)
    _backward(loss, upstream)
    return loss.detach(), x.grad


def run_reference(fn, logits, target, upstream=1.0, **kwargs):
    """The float64 reference's loss and gradient (cast back to nothing: compared in float64)."""
    x = logits.detach().double().requires_grad_()
    if isinstance(upstream, torch.Tensor):
        upstream = upstream.double()
    loss = fn(x, target.long(), **kwargs)
    _backward(loss, upstream)
    return loss.detach(), x.grad


def natural_grad_scale(target, upstream, *, logits_scale_factor=1.0, reduction="mean", divisor=None, **_):
    """s·max|g|/D: the size of the largest (p - onehot) term of the gradient."""
    g = upstream.abs().max().item() if isinstance(upstream, torch.Tensor) else abs(upstream)
    if divisor is None:
        divisor = max(int((target >= 0).sum()), 1) if reduction == "mean" else 1.0
    return logits_scale_factor * g / divisor


def check_against_reference(logits, target, upstream=1.0, **kwargs):
    dtype = logits.dtype
    loss, grad = run_op(rl_losses.cross_entropy, logits, target, upstream, **kwargs)
    ref_loss, ref_grad = run_reference(reference.cross_entropy, logits, target, upstream, **kwargs)
    expected_loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == expected_loss_dtype
    assert loss.shape == ref_loss.shape
    assert_close(loss, ref_loss, dtype)
    assert_grad_close(grad, ref_grad, dtype, natural_scale=natural_grad_scale(target, upstream, **kwargs))


def rows_for(shape, vocab):
    """Few rows for the large vocabularies, so that the grid stays cheap on a 2-core CPU."""
    if vocab < 32000:
        return shape
    return {(64,): (6,), (16, 8): (2, 3)}[shape]


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


# ---- autograd contract ------------------------------------------------------------------------------------
def test_second_backward_raises(device):
    logits = make_logits((8,), 20, torch.float32, device).requires_grad_()
    target = make_target((8,), 20, device, masked=0.2)
    loss = rl_losses.cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    # A fresh call of the loss works again and gives the same gradient.
    logits.grad = None
    rl_losses.cross_entropy(logits, target).backward()
    assert torch.equal(logits.grad, first)


def test_no_grad_forward(device):
    logits = make_logits((16,), 33, torch.float32, device).requires_grad_()
    target = make_target((16,), 33, device)
    with torch.no_grad():
        loss = rl_losses.cross_entropy(logits, target, label_smoothing=0.1)
    assert not loss.requires_grad
    with torch.inference_mode():
        loss_inf = rl_losses.cross_entropy(logits, target, label_smoothing=0.1)
    expected = reference.cross_entropy(logits.detach().double(), target, label_smoothing=0.1)
    assert_close(loss, expected, torch.float32)
    assert_close(loss_inf, expected, torch.float32)


@pytest.mark.parametrize("case", ["plain", "scaled_smoothed_z", "sum", "none", "divisor", "z_loss"])
def test_gradcheck(case, device):
    shape, vocab = (3, 2), 5
    x = torch.randn(*shape, vocab, dtype=torch.float64, device=device).requires_grad_()
    target = torch.tensor([[1, -100], [4, 0], [-1, 2]], device=device)
    fns = {
        "plain": lambda t: rl_losses.cross_entropy(t, target),
        "scaled_smoothed_z": lambda t: rl_losses.cross_entropy(t, target, logits_scale_factor=1.7,
                                                               label_smoothing=0.2, z_loss_factor=0.05),
        "sum": lambda t: rl_losses.cross_entropy(t, target, reduction="sum", label_smoothing=0.1),
        "none": lambda t: rl_losses.cross_entropy(t, target, reduction="none", z_loss_factor=0.1),
        "divisor": lambda t: rl_losses.cross_entropy(t, target, divisor=3.5, logits_scale_factor=0.6),
        "z_loss": lambda t: rl_losses.z_loss(t, loss_mask=target >= 0, logits_scale_factor=1.3),
    }
    assert gradcheck_fresh(fns[case], x)


# ---- opcheck ----------------------------------------------------------------------------------------------
def _opcheck_cases(device):
    logits = make_logits((6, 2), 11, torch.float32, device)
    target = make_target((6, 2), 11, device, masked=0.3)
    leaf = logits.clone().requires_grad_()
    ce_positional = (1.3, 0.1, 1e-3, 1.0, "mean", None, None, 0, -1)
    return {
        "cross_entropy": (_ops.cross_entropy.default, (leaf, target),
                          dict(logits_scale_factor=1.3, label_smoothing=0.1, z_loss_factor=1e-3)),
        "cross_entropy_none": (_ops.cross_entropy.default, (leaf, target), dict(reduction="none")),
        "cross_entropy_divisor": (_ops.cross_entropy.default, (leaf, target), dict(reduction="sum", divisor=3.0)),
        "cross_entropy_no_grad": (_ops.cross_entropy.default, (logits, target), {}),
        # inplace_backward refuses leaves that require grad, which opcheck's autograd tests need: the flag is
        # checked here without autograd (the in-place forward op has its own case below).
        "cross_entropy_inplace": (_ops.cross_entropy.default, (logits.clone(), target), dict(inplace_backward=True)),
        "cross_entropy_z_loss": (_ops.cross_entropy.default, (leaf, target), dict(z_loss_factor=1.0,
                                                                                   label_weight=0.0)),
        "_cross_entropy_forward": (_ops._cross_entropy_forward.default,
                                   (logits, target) + ce_positional + (True,), {}),
        "_cross_entropy_forward_no_grad": (_ops._cross_entropy_forward.default,
                                           (logits, target) + ce_positional + (False,), {}),
        "_cross_entropy_forward_inplace": (_ops._cross_entropy_forward_inplace.default,
                                           (logits.clone(), target) + ce_positional, {}),
        "row_stats": (_ops.row_stats.default, (logits, target), dict(logits_scale_factor=0.9, entropy=True,
                                                                     smoothing=True)),
        "_scale_grad_": (_ops._scale_grad_.default,
                         (torch.randn(6, 2, 11, device=device), torch.tensor(1.7, device=device)), {}),
        "_scale_grad_rows": (_ops._scale_grad_.default,
                             (torch.randn(6, 2, 11, device=device), torch.randn(6, 2, device=device)), {}),
    }


OPCHECK_CASES = list(_opcheck_cases("cpu"))


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, device):
    op, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args, kwargs)


# ---- torch.compile ----------------------------------------------------------------------------------------
def _compiled_case(kind):
    if kind == "mean":
        def fn(x, y):
            return rl_losses.cross_entropy(x * 2, y, logits_scale_factor=0.5, label_smoothing=0.1)
    else:
        def fn(x, y, w):
            per_token = rl_losses.cross_entropy(x * 2, y, reduction="none", z_loss_factor=1e-3)
            return (per_token * w).sum() + x.mean()
    return fn


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", ["mean", "none"])
def test_compile_fullgraph(kind, backend, device):
    logits = make_logits((16, 8), 129, torch.float32, device)
    target = make_target((16, 8), 129, device)
    extra = (torch.randn(16, 8, device=device),) if kind == "none" else ()
    assert_compiled_matches_eager(_compiled_case(kind), logits, target, *extra, backend=backend)


# ---- CPU == CUDA ------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab", [7, 769, 50257])
def test_cpu_matches_cuda(vocab, dtype):
    shape = rows_for((16, 8), vocab)
    logits = make_logits(shape, vocab, dtype, "cpu")
    target = make_target(shape, vocab, "cpu")
    kwargs = dict(logits_scale_factor=1.1, label_smoothing=0.1, z_loss_factor=1e-3)
    cpu_loss, cpu_grad = run_op(rl_losses.cross_entropy, logits, target, 1.3, **kwargs)
    gpu_loss, gpu_grad = run_op(rl_losses.cross_entropy, logits.cuda(), target.cuda(), 1.3, **kwargs)
    assert_close(gpu_loss, cpu_loss, dtype)
    assert_grad_close(gpu_grad.cpu(), cpu_grad.double(), dtype)


# ---- bad input --------------------------------------------------------------------------------------------
def _bad_call(case, device):
    """(callable, expected message regex) for each invalid input."""
    logits = make_logits((4,), 7, torch.float32, device)
    target = make_target((4,), 7, device, masked=0.0)
    ce = rl_losses.cross_entropy
    cases = {
        "int_logits": (lambda: ce(torch.randint(0, 5, (4, 7), device=device), target),
                       "logits must be a floating-point tensor"),
        "0d_logits": (lambda: ce(torch.tensor(1.0, device=device), torch.tensor(0, device=device)),
                      "at least 1 dimension"),
        "0d_logits_op": (lambda: _ops.cross_entropy(torch.tensor(1.0, device=device), torch.tensor(0, device=device)),
                         "at least 1 dimension"),
        "vocab_stride": (lambda: ce(make_logits((7,), 4, torch.float32, device).t(), target),
                         "unit stride in the vocabulary .*got stride 4"),
        "target_shape": (lambda: ce(logits, target[:3]), r"target has shape \[3\] but logits has batch shape \[4\]"),
        "target_float": (lambda: ce(logits, target.float()), "target must be an integer tensor"),
        "target_int16": (lambda: ce(logits, target.to(torch.int16)), "target must be int32 or int64"),
        "scale_zero": (lambda: ce(logits, target, logits_scale_factor=0.0),
                       "logits_scale_factor must be finite and > 0, got 0"),
        "scale_negative": (lambda: ce(logits, target, logits_scale_factor=-1.5),
                           "logits_scale_factor must be finite and > 0, got -1.5"),
        "scale_nan": (lambda: ce(logits, target, logits_scale_factor=float("nan")),
                      "logits_scale_factor must be finite and > 0, got nan"),
        "smoothing_negative": (lambda: ce(logits, target, label_smoothing=-0.1),
                               r"label_smoothing must be in \[0, 1\), got -0.1"),
        "smoothing_one": (lambda: ce(logits, target, label_smoothing=1.0),
                          r"label_smoothing must be in \[0, 1\), got 1"),
        "z_loss_negative": (lambda: ce(logits, target, z_loss_factor=-1e-3), "z_loss_factor must be >= 0"),
        "reduction": (lambda: ce(logits, target, reduction="average"),
                      "reduction must be 'mean', 'sum' or 'none', got 'average'"),
        "divisor_zero": (lambda: ce(logits, target, divisor=0.0), "divisor must be finite and > 0, got 0"),
        "divisor_negative": (lambda: ce(logits, target, reduction="sum", divisor=-3.0),
                             "divisor must be finite and > 0, got -3"),
        "divisor_with_none": (lambda: ce(logits, target, reduction="none", divisor=2.0),
                              "divisor has no meaning with reduction='none'"),
    }
    return cases[case]


BAD_CASES = ["int_logits", "0d_logits", "0d_logits_op", "vocab_stride", "target_shape", "target_float", "target_int16",
             "scale_zero", "scale_negative", "scale_nan", "smoothing_negative", "smoothing_one", "z_loss_negative",
             "reduction", "divisor_zero", "divisor_negative", "divisor_with_none"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input(case, device):
    call, message = _bad_call(case, device)
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("label", [7, 1000])
def test_label_out_of_range_cpu(label):
    logits = make_logits((4,), 7, torch.float32, "cpu").requires_grad_()
    target = torch.tensor([0, label, -100, 6])
    with pytest.raises(RuntimeError, match=f"label {label} at row 1 is out of range for vocab_size 7"):
        rl_losses.cross_entropy(logits, target)


@requires_cuda
def test_label_out_of_range_cuda_opt_in_check(monkeypatch):
    monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
    logits = make_logits((4,), 7, torch.float32, "cuda")
    target = torch.tensor([0, 7, -100, 6], device="cuda")
    with pytest.raises(ValueError, match="target holds label 7, out of range for vocab_size 7"):
        rl_losses.cross_entropy(logits, target)


@requires_cuda
def test_device_mismatch():
    logits = make_logits((4,), 7, torch.float32, "cuda")
    target = make_target((4,), 7, "cpu")
    with pytest.raises(RuntimeError, match="target is on cpu but logits is on cuda"):
        rl_losses.cross_entropy(logits, target)
    # The other way round the call still reaches the CUDA kernel (a CUDA argument decides), with the logits
    # on the CPU: the same check, not a device-guard error.
    with pytest.raises(RuntimeError, match="target is on cuda:0 but logits is on cpu"):
        rl_losses.cross_entropy(logits.cpu(), target.cuda())


def test_inplace_backward_needs_one_row_stride(device):
    leaf = make_logits((8, 16), 9, torch.float32, device).requires_grad_()
    logits = (leaf * 1).transpose(0, 1)  # (16, 8, 9): the batch dims do not flatten to one row stride
    target = make_target((16, 8), 9, device)
    with pytest.raises(RuntimeError, match="inplace_backward needs logits whose batch dimensions flatten"):
        rl_losses.cross_entropy(logits, target, inplace_backward=True)
    # Without inplace_backward the same layout works (through a copy).
    check_against_reference(logits.detach(), target, 1.0)


def test_z_loss_mask_shape(device):
    logits = make_logits((4, 3), 7, torch.float32, device)
    with pytest.raises(ValueError, match=r"loss_mask has shape \(4,\) but logits has batch shape \(4, 3\)"):
        rl_losses.z_loss(logits, loss_mask=torch.ones(4, dtype=torch.bool, device=device))
