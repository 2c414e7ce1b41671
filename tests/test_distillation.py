"""Tests of the distillation op (docs/distillation_dpo.md): loss, per-token divergence and the student's gradient
against the float64 reference (rl_losses.reference.distillation_loss), for every kind and option, every logits
dtype, teacher dtypes other than the student's, masking, odd and large vocabularies; opcheck, gradcheck,
torch.compile, inplace_backward, and bad input."""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import (assert_compiled_matches_eager, assert_grad_close, config_paths, forward_options, gradcheck_fresh,
                     param_id as _id, requires_cuda)

KINDS = ["forward_kl", "reverse_kl", "cross_entropy", "jsd"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_ops = torch.ops.rl_losses


def make_inputs(shape, vocab, dtype, device, *, teacher_dtype=None, masked=0.0, std=2.0):
    """Student and teacher logits (the teacher near the student, so that the divergences are O(1) and the
    gradients not dominated by one side) and a loss mask with a fraction `masked` off (None when 0)."""
    logits = (torch.randn(*shape, vocab, device=device) * std).to(dtype)
    teacher = (logits.float() + torch.randn(*shape, vocab, device=device) * std).to(teacher_dtype or dtype)
    mask = None if masked == 0 else torch.rand(shape, device=device) >= masked
    return logits, teacher, mask


def run_op(logits, teacher, upstream=1.0, **options):
    x = logits.detach().clone().requires_grad_()
    out = rl_losses.distillation_loss(x, teacher, **options)
    (out.loss * upstream).backward()
    return out, x.grad


def run_reference(logits, teacher, upstream=1.0, **options):
    x = logits.detach().double().requires_grad_()
    out = reference.distillation_loss(x, teacher.double(), **options)
    (out.loss * upstream).backward()
    return out, x.grad


def check(logits, teacher, upstream=1.0, scale=1.0, **options):
    dtype = logits.dtype
    out, grad = run_op(logits, teacher, upstream, **options)
    ref, ref_grad = run_reference(logits, teacher, upstream, **options)
    assert out.loss.dim() == 0 and out.loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not out.divergence.requires_grad and out.divergence.shape == logits.shape[:-1]
    assert_close(out.loss.detach(), ref.loss.detach(), dtype, scale=scale, msg="loss")
    assert_close(out.divergence, ref.divergence, dtype, scale=scale, msg="divergence")
    mask = options.get("loss_mask")
    n = int(mask.sum()) if mask is not None else logits[..., 0].numel()
    natural = options.get("logits_scale_factor", 1.0) * abs(upstream) / (options.get("divisor") or max(n, 1))
    assert_grad_close(grad, ref_grad, dtype, natural_scale=natural, scale=scale)
    if mask is not None:
        assert torch.count_nonzero(grad[~mask]) == 0, "masked tokens must get a zero gradient"
    return out, grad


# (options, upstream gradient)
OPTIONS = {
    "plain": ({}, 1.0),
    "scaled_temperature": ({"logits_scale_factor": 0.7, "temperature": 1.6}, -1.3),
    "masked_divisor": ({"mask": 0.4, "divisor": 5.0}, 2.0),
    "masked": ({"mask": 0.5, "temperature": 0.8}, 1.0),
}


def _options(name, shape, device):
    options, upstream = OPTIONS[name]
    options = dict(options)
    masked = options.pop("mask", 0.0)
    mask = None if masked == 0 else torch.rand(shape, device=device) >= masked
    if mask is not None:
        options["loss_mask"] = mask
    return options, upstream


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab", [1, 7, 769])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(kind, vocab, dtype, option, device):
    shape = (5, 3)
    logits, teacher, _ = make_inputs(shape, vocab, dtype, device)
    options, upstream = _options(option, shape, device)
    check(logits, teacher, upstream, kind=kind, beta=0.3, **options)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_betas(beta, device):
    logits, teacher, mask = make_inputs((9,), 300, torch.float32, device, masked=0.3)
    check(logits, teacher, kind="jsd", beta=beta, loss_mask=mask)


@pytest.mark.parametrize("vocab", [769, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_jsd_tiny_probabilities(vocab, dtype, device):
    """Logits spread so far that P and Q are both below ~2^-126 on many tokens: log M is taken by log-add-exp there,
    where M = β·P + (1−β)·Q is subnormal (flushed to 0 by the GPU's log: log Q − log M would be infinite)."""
    logits, teacher, _ = make_inputs((16,), vocab, dtype, device, std=40.0)
    # Logits up to ~200 in magnitude: fp32 rounds x − log Σ to ~2^-16 there, more than the default tolerance.
    out, grad = check(logits, teacher, kind="jsd", beta=0.5, scale=16.0)
    assert torch.isfinite(out.divergence).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_teacher_dtypes(dtype, teacher_dtype, device):
    logits, teacher, _ = make_inputs((6,), 520, dtype, device, teacher_dtype=teacher_dtype)
    for kind in KINDS:
        check(logits, teacher, kind=kind, temperature=1.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab", [32000, 50257])
@pytest.mark.parametrize("kind", KINDS)
def test_large_vocab(kind, vocab, dtype, device):
    logits, teacher, mask = make_inputs((3,), vocab, dtype, device, masked=0.3)
    # fp32 sums over 5e4 terms: a few more ulps than the small-vocabulary cases.
    check(logits, teacher, kind=kind, beta=0.4, loss_mask=mask, logits_scale_factor=1.1, scale=4.0)


@pytest.mark.parametrize("kind", KINDS)
def test_float64_is_exact(kind, device):
    logits, teacher, mask = make_inputs((4, 5), 33, torch.float64, device, masked=0.3)
    check(logits, teacher, 0.7, kind=kind, beta=0.25, loss_mask=mask, temperature=2.0, logits_scale_factor=1.5)


def test_jsd_endpoints_are_the_kls(device):
    """Liger-Kernel's convention: the generalised JSD at β = 0 is the forward KL, at β = 1 the reverse KL."""
    logits, teacher, _ = make_inputs((8,), 40, torch.float64, device)
    for beta, kl in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        jsd, jsd_grad = run_op(logits, teacher, kind="jsd", beta=beta)
        ref, ref_grad = run_op(logits, teacher, kind=kl)
        torch.testing.assert_close(jsd.loss, ref.loss)
        torch.testing.assert_close(jsd_grad, ref_grad)


def test_identical_distributions_give_zero(device):
    logits = torch.randn(6, 50, dtype=torch.float64, device=device)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        out, grad = run_op(logits, logits * 2.0, kind=kind, temperature=2.0)
        assert abs(out.loss.item()) < 1e-12 and grad.abs().max().item() < 1e-12, kind


def test_inplace_backward_matches(device):
    logits, teacher, mask = make_inputs((4, 6), 129, torch.float32, device, masked=0.3)
    for kind in KINDS:
        out, grad = run_op(logits, teacher, kind=kind, loss_mask=mask)
        x = logits.clone().requires_grad_()
        y = x * 1.0  # a non-leaf whose storage may be overwritten
        out_inplace = rl_losses.distillation_loss(y, teacher, kind=kind, loss_mask=mask, inplace_backward=True)
        out_inplace.loss.backward()
        torch.testing.assert_close(out_inplace.loss, out.loss)
        torch.testing.assert_close(x.grad, grad)


def test_strided_rows(device):
    # Rows with a stride (views of a larger tensor), starting off a 16-byte boundary: the element-wise path.
    logits = torch.randn(5, 2, 40, device=device)[:, 1, 3:33]
    teacher = torch.randn(5, 3, 37, device=device, dtype=torch.float64)[:, 2, 1:31]
    for kind in KINDS:
        check(logits, teacher, kind=kind)


def test_no_grad_forward(device):
    logits, teacher, mask = make_inputs((7,), 64, torch.float32, device, masked=0.3)
    with torch.no_grad():
        out = rl_losses.distillation_loss(logits, teacher, kind="reverse_kl", loss_mask=mask)
    ref = reference.distillation_loss(logits.double(), teacher.double(), kind="reverse_kl", loss_mask=mask)
    assert_close(out.loss, ref.loss, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(kind, device):
    logits, teacher, mask = make_inputs((3,), 5, torch.float64, device, masked=0.3)
    gradcheck_fresh(lambda x: rl_losses.distillation_loss(x, teacher, kind=kind, beta=0.3, loss_mask=mask,
                                                          logits_scale_factor=1.2, temperature=0.9).loss,
                    logits.clone().requires_grad_())


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_opcheck(kind, device):
    logits, teacher, mask = make_inputs((4,), 12, torch.float32, device, teacher_dtype=torch.bfloat16, masked=0.3)
    x = logits.clone().requires_grad_()
    kwargs = dict(kind=kind, beta=0.4, temperature=1.5, loss_mask=mask)
    torch.library.opcheck(_ops.distillation, (x, teacher), kwargs)
    torch.library.opcheck(_ops._distillation_forward, (logits, teacher),
                          forward_options("distillation", compute_grad=True, **kwargs))
    stats = _ops.distillation_stats(logits, teacher, temperature=1.5)
    torch.library.opcheck(_ops.distillation_stats, (logits, teacher), dict(temperature=1.5))
    torch.library.opcheck(_ops.distillation_jsd_sums, (logits, teacher, stats), dict(beta=0.4, temperature=1.5))


def test_compile_fullgraph(device):
    logits, teacher, mask = make_inputs((4, 3), 70, torch.float32, device, masked=0.3)

    def fn(x, t, m):
        out = rl_losses.distillation_loss(x, t, kind="jsd", beta=0.3, loss_mask=m)
        return out.loss, out.divergence

    assert_compiled_matches_eager(fn, logits, teacher, mask, backend="aot_eager")


def test_stats_and_sums_hooks_match_the_fused_op(device):
    """The tensor-parallel hooks: the op given its own statistics and JSD sums (one rank's all-reduce) is the op."""
    logits, teacher, mask = make_inputs((6,), 90, torch.float64, device, masked=0.3)
    stats = _ops.distillation_stats(logits, teacher, temperature=1.2)
    sums = _ops.distillation_jsd_sums(logits, teacher, stats, beta=0.3, temperature=1.2)
    for kind in KINDS:
        x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        a, _ = _ops.distillation(x1, teacher, kind=kind, beta=0.3, temperature=1.2, loss_mask=mask)
        b, _ = _ops.distillation(x2, teacher, kind=kind, beta=0.3, temperature=1.2, loss_mask=mask, row_stats=stats,
                                 jsd_sums=sums if kind == "jsd" else None)
        a.backward()
        b.backward()
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(x1.grad, x2.grad)


# ---- bad input ---------------------------------------------------------------------------------------------
def test_bad_input(device):
    logits = torch.randn(4, 10, device=device)
    teacher = torch.randn(4, 10, device=device)
    f = rl_losses.distillation_loss
    with pytest.raises(RuntimeError, match=r"teacher_logits has shape \[4, 11\].*vocabularies differ"):
        f(logits, torch.randn(4, 11, device=device))
    with pytest.raises(RuntimeError, match=r"teacher_logits has shape \[3, 10\] but logits has shape \[4, 10\]"):
        f(logits, torch.randn(3, 10, device=device))
    with pytest.raises(RuntimeError, match="temperature must be finite and > 0, got 0"):
        f(logits, teacher, temperature=0.0)
    with pytest.raises(RuntimeError, match="temperature must be finite and > 0, got -1"):
        f(logits, teacher, temperature=-1.0)
    with pytest.raises(RuntimeError, match=r"beta must be in \[0, 1\], got 1.5"):
        f(logits, teacher, kind="jsd", beta=1.5)
    with pytest.raises(RuntimeError, match=r"beta must be in \[0, 1\], got -0.1"):
        f(logits, teacher, kind="jsd", beta=-0.1)
    with pytest.raises(RuntimeError, match="kind must be 'forward_kl'.*got 'kl'"):
        f(logits, teacher, kind="kl")
    with pytest.raises(RuntimeError, match=r"loss_mask has shape \[3\] but logits has batch shape \[4\]"):
        f(logits, teacher, loss_mask=torch.ones(3, dtype=torch.bool, device=device))
    with pytest.raises(RuntimeError, match="loss_mask must be a bool or integer tensor"):
        f(logits, teacher, loss_mask=torch.ones(4, device=device))
    with pytest.raises(RuntimeError, match="teacher_logits must be a floating-point tensor"):
        f(logits, torch.ones(4, 10, dtype=torch.long, device=device))
    with pytest.raises(RuntimeError, match="logits_scale_factor must be finite and > 0"):
        f(logits, teacher, logits_scale_factor=0.0)
    with pytest.raises(RuntimeError, match="divisor must be finite and > 0"):
        f(logits, teacher, divisor=-2.0)
    with pytest.raises(RuntimeError, match=r"row_stats must hold \(4, 7\) values"):
        _ops.distillation(logits, teacher, row_stats=torch.zeros(4, 5, device=device))
    with pytest.raises(RuntimeError, match="jsd_sums needs row_stats"):
        _ops.distillation(logits, teacher, kind="jsd", jsd_sums=torch.zeros(4, 2, device=device))
    if device == "cpu" and torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="teacher_logits is on"):
            f(logits, teacher.cuda())


# ---- the `distillation` config ------------------------------------------------------------------------------
def test_config_module_matches_the_reference_path(device):
    from rl_losses.config import LanguageModelLossConfig

    logits, teacher, mask = make_inputs((6,), 80, torch.float32, device, masked=0.3)
    batch = {"reference_logits": {"teacher": teacher}, "loss_mask": mask}
    cfg = LanguageModelLossConfig.from_dict({"type": "distillation", "loss_type": "jsd", "beta": 0.4,
                                             "temperature": 1.3, "weight": 0.5})
    assert LanguageModelLossConfig.from_dict(cfg.to_dict()) == cfg
    for kernel, ref in zip(*config_paths(cfg, logits, batch, ["distillation"])):
        assert_close(kernel, ref, torch.float32, scale=4.0)


@pytest.mark.parametrize("loss_type", ["cross_entropy", "forward_kl", "reverse_kl"])
def test_config_reproduces_fast_llm(loss_type):
    """A Fast-LLM distillation config in its older field names, with its head's logits_scale_factor s: Fast-LLM's
    teacher softmax is over s·z'/T and its loss the mean over every token (masked ones included), written out here
    in float64 as its torch path computes it; here that is temperature = T/s and num_labels_in_batch = N."""
    from rl_losses.config import LanguageModelLossConfig

    s, temperature, n, vocab = 0.8, 1.7, 12, 60
    logits = 3 * torch.randn(n, vocab, dtype=torch.float64)
    teacher = 3 * torch.randn(n, vocab, dtype=torch.float64)
    mask = torch.rand(n) > 0.3
    cfg = LanguageModelLossConfig.from_dict({"type": "distillation", "distillation_model": "teacher",
                                             "distillation_loss_implementation": loss_type,
                                             "teacher_softmax_temperature": temperature / s,
                                             "logits_scale_factor": s})
    batch = {"reference_logits": {"teacher": teacher}, "loss_mask": mask, "num_labels_in_batch": n}
    x = logits.clone().requires_grad_()
    student = torch.log_softmax(s * x, -1)
    target = torch.log_softmax(teacher * (s / temperature), -1)
    per_token = {"cross_entropy": -(target.exp() * student).sum(-1),
                 "forward_kl": (target.exp() * (target - student)).sum(-1),
                 "reverse_kl": (student.exp() * (student - target)).sum(-1)}[loss_type]
    expected = (per_token * mask).mean()
    expected_grad, = torch.autograd.grad(expected, x)
    for kernel, ref in zip(*config_paths(cfg, logits, batch)):
        for got in (kernel, ref):
            torch.testing.assert_close(got, expected.detach() if got.dim() == 0 else expected_grad, rtol=1e-9,
                                       atol=1e-12)


def test_config_validation():
    from rl_losses.config import LanguageModelLossConfig

    for bad, match in (({"temperature": 0.0}, "temperature must be a finite number > 0.0"),
                       ({"beta": 1.5}, r"beta must be a finite number >= 0.0 and <= 1.0"),
                       ({"loss_type": "kl"}, "loss_type must be one of")):
        with pytest.raises(ValueError, match=match):
            LanguageModelLossConfig.from_dict({"type": "distillation", **bad})
    module = LanguageModelLossConfig.from_dict({"type": "distillation", "reference_model": "big"}).get_loss()
    with pytest.raises(ValueError, match=r"has no 'big'"):
        module(torch.randn(2, 5), {"reference_logits": {"teacher": torch.randn(2, 5)}})


# ---- from hidden states and the lm_head weight ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_linear_matches_the_logits_op(kind, dtype, device):
    hidden = torch.randn(3, 7, 16, device=device).to(dtype)
    weight = (torch.randn(50, 16, device=device) / 4).to(dtype)
    teacher = torch.randn(3, 7, 50, device=device)
    mask = torch.rand(3, 7, device=device) > 0.3
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = rl_losses.linear_distillation_loss(h1, w1, teacher, kind=kind, beta=0.3, loss_mask=mask,
                                              temperature=1.2, chunk_size=5)
    (loss * 0.8).backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference.distillation_loss(h2 @ w2.t(), teacher.double(), kind=kind, beta=0.3, loss_mask=mask,
                                      temperature=1.2).loss
    (ref * 0.8).backward()
    scale = 1.0 if dtype == torch.float64 else 8.0  # the logits of the GEMM are rounded to the dtype
    assert_close(loss.detach(), ref.detach(), dtype, scale=scale)
    assert_grad_close(h1.grad, h2.grad, dtype, scale=scale)
    assert_grad_close(w1.grad, w2.grad, dtype, scale=scale)


@requires_cuda
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16), (torch.float16, torch.float64)], ids=str)
@pytest.mark.parametrize("vocab", [4096, 4099])  # the 16-byte vector path, and the element path
def test_cpu_equals_cuda(vocab, dtypes):
    dtype, teacher_dtype = dtypes
    logits, teacher, mask = make_inputs((37,), vocab, dtype, "cpu", teacher_dtype=teacher_dtype, masked=0.2)
    for kind in KINDS:
        options = dict(kind=kind, beta=0.3, temperature=1.1, loss_mask=mask)
        cpu, cpu_grad = run_op(logits, teacher, **options)
        gpu, gpu_grad = run_op(logits.cuda(), teacher.cuda(), **{**options, "loss_mask": mask.cuda()})
        assert_close(gpu.loss.cpu(), cpu.loss, torch.float32, scale=4.0, msg=kind)
        assert_grad_close(gpu_grad.cpu(), cpu_grad.double(), dtype, scale=2.0)


@requires_cuda
@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab", [7, 769, 32000, 128256, 151936])
def test_cuda_matches_the_float64_reference(vocab, dtype, layout):
    """Every CUDA path (the vector loads of aligned rows, the element path of rows that start off a 16-byte
    boundary, rows that fit on chip and rows that do not) against the float64 reference, every kind."""
    rows = 6 if vocab > 100000 else 11
    logits, teacher, mask = make_inputs((rows,), vocab, dtype, "cuda", masked=0.25)
    if layout == "unaligned":  # each row one element past a 16-byte boundary
        pad = torch.empty(rows, vocab + 9, dtype=dtype, device="cuda")
        pad[:, 1:vocab + 1] = logits
        logits = pad[:, 1:vocab + 1]
        tpad = torch.empty(rows, vocab + 9, dtype=teacher.dtype, device="cuda")
        tpad[:, 1:vocab + 1] = teacher
        teacher = tpad[:, 1:vocab + 1]
    for kind in KINDS:
        # Sums over up to 1.5e5 terms in fp32: a few more ulps than the small cases.
        check(logits, teacher, 1.3, scale=4.0 if vocab > 1000 else 1.0, kind=kind, beta=0.35, temperature=1.2,
              loss_mask=mask, logits_scale_factor=0.9)
