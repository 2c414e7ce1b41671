"""Tests of the GRPO op's contract: one backward per forward, gradcheck, opcheck, torch.compile, CPU == CUDA,
and a clear error for each bad input (values and gradients: test_grpo.py)."""
import math

import pytest
import torch

import rl_losses

from helpers import (DTYPES, assert_compiled_matches_eager, assert_grad_close, forward_options, gradcheck_fresh,
                     label_log_probs64, param_id as _id, requires_cuda)
from helpers_grpo import assert_outputs_close, make_inputs, run_op

_ops = torch.ops.rl_losses


# ---- autograd contract, gradcheck, opcheck, compile -------------------------------------------------------
def test_second_backward_raises(device):
    logits, target, advantages, old_log_probs, _ = make_inputs((8,), 20, torch.float32, device, masked=0.2)
    x = logits.clone().requires_grad_()
    out = rl_losses.grpo_loss(x, target, advantages, old_log_probs)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()


def _tiny_inputs(device):
    """Tiny float64 inputs whose ratios sit at least 0.05 away from every clip bound used below, so that the
    finite differences of gradcheck never cross one."""
    shape, vocab = (3, 2), 5
    logits = torch.randn(*shape, vocab, dtype=torch.float64, device=device)
    target = torch.tensor([[1, -100], [4, 0], [2, 3]], device=device)
    lp = label_log_probs64(logits, target, 1.3)
    log_ratio = torch.tensor([[0.6, 0.0], [-0.05, 0.3], [-0.6, 0.05]], dtype=torch.float64, device=device)
    old_log_probs = lp - log_ratio  # ratios 1.82, 0.95, 1.35, 0.55, 1.05 around [0.8, 1.2] and delta = 1.5
    advantages = torch.tensor([[1.0, 0.5], [-0.7, 1.2], [-1.5, 0.8]], dtype=torch.float64, device=device)
    ref_log_probs = lp + 0.3
    return logits, target, advantages, old_log_probs, ref_log_probs


@pytest.mark.parametrize("case", ["plain", "beta_delta", "weights_divisor"])
def test_gradcheck(case, device):
    logits, target, advantages, old, ref = _tiny_inputs(device)
    kwargs = {
        "plain": dict(logits_scale_factor=1.3),
        "beta_delta": dict(logits_scale_factor=1.3, beta=0.1, ref_log_probs=ref, delta=1.5),
        "weights_divisor": dict(logits_scale_factor=1.3, loss_weights=torch.rand_like(advantages), divisor=2.5),
    }[case]
    x = logits.clone().requires_grad_()
    assert gradcheck_fresh(lambda t: rl_losses.grpo_loss(t, target, advantages, old, **kwargs).loss, x)


def _opcheck_cases(device):
    logits, target, advantages, old, ref = make_inputs((6, 2), 11, torch.float32, device, masked=0.3)
    leaf = logits.clone().requires_grad_()
    weights = torch.rand_like(advantages)
    counts = torch.full_like(advantages, 2.0)
    options = forward_options("grpo", ref_log_probs=ref, loss_weights=weights, label_counts=counts,
                              epsilon_high=0.25, delta=1.5, beta=0.04, logits_scale_factor=1.1, compute_entropy=True)
    documents = torch.arange(12, device=device).view(6, 2) // 5
    return {
        "grpo": (_ops.grpo.default, (leaf, target, advantages, old), {}),
        "grpo_options": (_ops.grpo.default, (leaf, target, advantages, old),
                         dict(ref_log_probs=ref, beta=0.04, delta=1.5, loss_weights=weights, label_counts=counts,
                              divisor=3.0, logits_scale_factor=1.1, compute_entropy=True)),
        "grpo_documents": (_ops.grpo.default, (leaf, target, advantages, old),
                           dict(loss_type="vespo", document_index=documents, num_documents=4)),
        "grpo_no_grad": (_ops.grpo.default, (logits, target, advantages, old), {}),
        # Without autograd: inplace_backward refuses the leaves that opcheck's autograd tests need.
        "grpo_inplace": (_ops.grpo.default, (logits.clone(), target, advantages, old), dict(inplace_backward=True)),
        "_grpo_forward": (_ops._grpo_forward.default, (logits, target, advantages, old),
                          dict(options, compute_grad=True)),
        "_grpo_forward_no_grad": (_ops._grpo_forward.default, (logits, target, advantages, old),
                                  dict(options, compute_grad=False)),
        "_grpo_forward_inplace": (_ops._grpo_forward_inplace.default, (logits.clone(), target, advantages, old),
                                  options),
    }


@pytest.mark.parametrize("case", ["grpo", "grpo_options", "grpo_documents", "grpo_no_grad", "grpo_inplace",
                                  "_grpo_forward", "_grpo_forward_no_grad", "_grpo_forward_inplace"])
def test_opcheck(case, device):
    op, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend, device):
    def fn(x, target, advantages, old, ref):
        out = rl_losses.grpo_loss(x * 2, target, advantages, old, ref_log_probs=ref, beta=0.04, delta=1.5,
                                  logits_scale_factor=0.5)
        return out.loss, out.kl_old, out.log_probs

    logits, target, advantages, old, ref = make_inputs((16, 8), 129, torch.float32, device)
    assert_compiled_matches_eager(fn, logits, target, advantages, old, ref, backend=backend)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_cpu_matches_cuda(dtype):
    logits, target, advantages, old, ref = make_inputs((16, 8), 1000, dtype, "cpu")
    kwargs = dict(ref_log_probs=ref, beta=0.04, delta=1.5, compute_entropy=True, logits_scale_factor=1.1)
    cpu, cpu_grad = run_op(logits, target, advantages, old, 1.3, **kwargs)
    cuda_kwargs = dict(kwargs, ref_log_probs=ref.cuda())
    gpu, gpu_grad = run_op(logits.cuda(), target.cuda(), advantages.cuda(), old.cuda(), 1.3, **cuda_kwargs)
    assert_outputs_close(gpu, cpu, dtype, compute_entropy=True)
    assert_grad_close(gpu_grad.cpu(), cpu_grad.cpu(), dtype)


# ---- bad input --------------------------------------------------------------------------------------------
def _bad_call(case, device):
    """(callable, regex the message must match: the argument and, where there is one, the bad value)."""
    logits, target, advantages, old, ref = make_inputs((4, 3), 7, torch.float32, device, masked=0.0)
    grpo = rl_losses.grpo_loss
    short = torch.zeros(4, 2, device=device)
    cases = {
        "target_shape": (lambda: grpo(logits, target[:, :2], advantages, old), "target has shape"),
        "advantages_shape": (lambda: grpo(logits, target, short, old), "advantages has shape"),
        "old_log_probs_shape": (lambda: grpo(logits, target, advantages, short), "old_log_probs has shape"),
        "ref_log_probs_shape": (lambda: grpo(logits, target, advantages, old, beta=0.1, ref_log_probs=short),
                                "ref_log_probs has shape"),
        "loss_weights_shape": (lambda: grpo(logits, target, advantages, old, loss_weights=short),
                               "loss_weights has shape"),
        "label_counts_shape": (lambda: grpo(logits, target, advantages, old, label_counts=short),
                               r"label_counts.*shape"),
        "advantages_int": (lambda: grpo(logits, target, advantages.long(), old),
                           "advantages must be a floating-point tensor"),
        "old_log_probs_int": (lambda: grpo(logits, target, advantages, old.long()),
                              "old_log_probs must be a floating-point tensor"),
        "delta_zero": (lambda: grpo(logits, target, advantages, old, delta=0.0), r"delta must be > 0 .*got 0"),
        "delta_nan": (lambda: grpo(logits, target, advantages, old, delta=math.nan), "delta must be finite"),
        "epsilon_low_negative": (lambda: grpo(logits, target, advantages, old, epsilon_low=-0.1),
                                 r"epsilon_low.*-0\.1"),
        "epsilon_low_one": (lambda: grpo(logits, target, advantages, old, epsilon_low=1.0), "epsilon_low"),
        "epsilon_high_negative": (lambda: grpo(logits, target, advantages, old, epsilon_high=-0.1),
                                  r"epsilon_high.*-0\.1"),
        "beta_without_ref": (lambda: grpo(logits, target, advantages, old, beta=0.1), "ref_log_probs"),
        "scale_zero": (lambda: grpo(logits, target, advantages, old, logits_scale_factor=0.0),
                       "logits_scale_factor must be finite and > 0, got 0"),
        "divisor_zero": (lambda: grpo(logits, target, advantages, old, divisor=0.0),
                         "divisor must be finite and > 0, got 0"),
        "int_logits": (lambda: grpo(logits.long(), target, advantages, old),
                       "logits must be a floating-point tensor"),
        "target_float": (lambda: grpo(logits, target.float(), advantages, old), "target must be an integer tensor"),
    }
    return cases[case]


BAD_CASES = ["target_shape", "advantages_shape", "old_log_probs_shape", "ref_log_probs_shape",
             "loss_weights_shape", "label_counts_shape", "advantages_int", "old_log_probs_int", "delta_zero",
             "delta_nan", "epsilon_low_negative", "epsilon_low_one", "epsilon_high_negative",
             "beta_without_ref", "scale_zero", "divisor_zero", "int_logits", "target_float"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input(case, device):
    call, message = _bad_call(case, device)
    with pytest.raises((RuntimeError, ValueError), match=message):
        call()


def test_label_out_of_range_cpu():
    logits, target, advantages, old, _ = make_inputs((4,), 7, torch.float32, "cpu", masked=0.0)
    target[2] = 7
    with pytest.raises(RuntimeError, match="label 7 .*out of range for vocab_size 7"):
        rl_losses.grpo_loss(logits.requires_grad_(), target, advantages, old)


@requires_cuda
def test_device_mismatch():
    logits, target, advantages, old, _ = make_inputs((4,), 7, torch.float32, "cuda", masked=0.0)
    with pytest.raises((RuntimeError, ValueError), match="advantages is on cpu"):
        rl_losses.grpo_loss(logits, target, advantages.cpu(), old)


# ---- the metrics of an option that is off are not made ---------------------------------------------------------
_OPTION_METRICS = ("entropy", "kl", "rollout_ratio_mean", "rollout_weight_mean", "rollout_corrected_fraction",
                   "vespo_phi_seq_mean")


def _metric_calls(op, device, meta):
    """`call(logits, **options)` of the raw op `op` and the options that turn every option metric but vespo's on
    (on meta tensors: the fake kernel)."""
    logits, target, advantages, old, ref = make_inputs((8,), 20, torch.float32, device, masked=0.2)
    doc = torch.arange(8, device=device) // 4
    move = (lambda t: t.to("meta")) if meta else (lambda t: t)
    logits, target, advantages, old, ref, doc = map(move, (logits, target, advantages, old, ref, doc))
    tail = (doc,) if op == "gspo" else ()
    known = dict(num_documents=2) if op == "gspo" else {}  # (meta tensors: no data-dependent document count)
    on = dict(compute_entropy=True, ref_log_probs=ref, beta=0.05, rollout_correction="token_truncate",
              rollout_log_probs=old - 0.1)
    return logits, (lambda x, **o: getattr(_ops, op)(x, target, advantages, old, *tail, **known, **o)), on


@pytest.mark.parametrize("op", ["grpo", "gspo"])
@pytest.mark.parametrize("path", ["no_grad", "autograd", "inplace", "meta"])
def test_option_metrics_are_none_where_the_option_is_off(op, path, device):
    logits, call, on = _metric_calls(op, device, path == "meta")
    names = rl_losses._schema.results(op)

    def run(**options):
        if path in ("no_grad", "meta"):
            return call(logits, **options)
        x = logits.clone().requires_grad_()
        if path == "inplace":
            return call(x * 1, inplace_backward=True, **options)
        return call(x, **options)

    off, all_on = dict(zip(names, run())), dict(zip(names, run(**on)))
    for name in names:
        if name in _OPTION_METRICS:
            assert off[name] is None, (name, off[name])
            assert (all_on[name] is None) == (name == "vespo_phi_seq_mean"), (name, all_on[name])
        else:
            assert isinstance(off[name], torch.Tensor) and isinstance(all_on[name], torch.Tensor), name
    for name in _OPTION_METRICS[:-1]:
        assert all_on[name].dim() == 0 and (path == "meta" or torch.isfinite(all_on[name]))


def test_lm_head_ops_return_empty_tensors_for_off_metrics(device):
    # linear_grpo may write weight_main_grad: its results stay plain tensors (torch.compile's functionalisation),
    # and the wrapper still says None.
    _, target, advantages, old, _ = make_inputs((8,), 20, torch.float32, device, masked=0.2)
    hidden = torch.randn(8, 16, device=device, requires_grad=True)
    weight = torch.randn(20, 16, device=device, requires_grad=True)
    out = dict(zip(rl_losses._schema.results("linear_grpo"), _ops.linear_grpo(hidden, weight, target, advantages, old)))
    for name in _OPTION_METRICS:
        assert out[name].shape == (0,), (name, out[name])
    wrapped = rl_losses.linear_grpo_loss(hidden, weight, target, advantages, old)
    assert all(getattr(wrapped, name) is None for name in _OPTION_METRICS)
