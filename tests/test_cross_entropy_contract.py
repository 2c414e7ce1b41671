"""Tests of the cross-entropy op's contract: one backward per forward, gradcheck, opcheck, torch.compile,
CPU == CUDA, and a clear error for each bad input (values and gradients: test_cross_entropy.py)."""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import (DTYPES, assert_compiled_matches_eager, assert_grad_close, forward_options, gradcheck_fresh,
                     make_logits, make_target, param_id as _id, requires_cuda)
from helpers_cross_entropy import check_against_reference, rows_for, run_op

_ops = torch.ops.rl_losses


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
    options = forward_options("cross_entropy", logits_scale_factor=1.3, label_smoothing=0.1, z_loss_factor=1e-3)
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
        "_cross_entropy_forward": (_ops._cross_entropy_forward.default, (logits, target),
                                   dict(options, compute_grad=True)),
        "_cross_entropy_forward_no_grad": (_ops._cross_entropy_forward.default, (logits, target),
                                           dict(options, compute_grad=False)),
        "_cross_entropy_forward_inplace": (_ops._cross_entropy_forward_inplace.default, (logits.clone(), target),
                                           options),
        "row_stats": (_ops.row_stats.default, (logits, target), dict(logits_scale_factor=0.9, entropy=True,
                                                                     smoothing=True)),
        "_scale_grad_": (_ops._scale_grad_.default,
                         (torch.randn(6, 2, 11, device=device), torch.tensor(1.7, device=device)), {}),
        "_scale_grad_rows": (_ops._scale_grad_.default,
                             (torch.randn(6, 2, 11, device=device), torch.randn(6, 2, device=device)), {}),
        # fp16: the forward also returns each row's 2^-k (grad_row_unscale), which _scale_grad_ applies.
        "cross_entropy_fp16": (_ops.cross_entropy.default, (logits.half().requires_grad_(), target), {}),
        "_cross_entropy_forward_fp16": (_ops._cross_entropy_forward.default, (logits.half(), target),
                                        dict(options, compute_grad=True)),
        "_cross_entropy_forward_inplace_fp16": (_ops._cross_entropy_forward_inplace.default,
                                                (logits.half(), target), options),
        "_scale_grad_prescaled": (_ops._scale_grad_.default,
                                  (torch.randn(6, 2, 11, device=device).half(), torch.tensor(1.7, device=device)),
                                  dict(row_unscale=torch.rand(12, device=device))),
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
