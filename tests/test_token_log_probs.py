"""token_log_probs and linear_token_log_probs: per-token log-probs and entropies, and their gradients for
arbitrary upstream gradients, against the float64 reference; the op layer (opcheck, torch.compile); bad input."""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_grad_close, make_logits, make_target, param_id

_ops = torch.ops.rl_losses

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _reference(logits, target, temperature, upstream):
    """float64 outputs and the gradient of Σ g_lp·lp + g_H·H w.r.t. the logits."""
    x = logits.detach().double().requires_grad_()
    lp, h = reference.token_log_probs(x, target, logits_scale_factor=1 / temperature, compute_entropy=True)
    ((lp * upstream[0].double()).sum() + (h * upstream[1].double()).sum()).backward()
    return lp.detach(), h.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=param_id)
@pytest.mark.parametrize("shape,vocab", [((7,), 1), ((3, 5), 13), ((37,), 769), ((2, 9), 5125)], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(device, dtype, shape, vocab, temperature):
    logits = make_logits(shape, vocab, dtype, device).requires_grad_()
    target = make_target(shape, vocab, device, masked=0.3)
    upstream = (torch.randn(shape, device=device), torch.randn(shape, device=device))
    lp, h = rl_losses.token_log_probs(logits, target, temperature=temperature, compute_entropy=True)
    ((lp * upstream[0]).sum() + (h * upstream[1]).sum()).backward()
    ref_lp, ref_h, ref_grad = _reference(logits, target, temperature, upstream)
    assert lp.dtype == h.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(lp, ref_lp, dtype, scale=10 if dtype in (torch.bfloat16, torch.float16) else 1)
    assert_close(h, ref_h, dtype, scale=10 if dtype in (torch.bfloat16, torch.float16) else 1)
    # natural_scale: at V = 1 the true gradient is 0, and fp32 rounding of H = lse − Σp·x leaves ~ulp(s·|g|).
    assert_grad_close(logits.grad, ref_grad, dtype, natural_scale=1 / temperature)


@pytest.mark.parametrize("which", ["log_probs", "entropy", "both"])
def test_gradient_through_one_output(device, which):
    """Either output alone may carry the gradient; the entropy without a request has none."""
    logits = make_logits((6, 4), 31, torch.float32, device).requires_grad_()
    target = make_target((6, 4), 31, device)
    g = torch.randn(6, 4, device=device)
    lp, h = rl_losses.token_log_probs(logits, target, compute_entropy=which != "log_probs")
    if which == "log_probs":
        assert h is None
    if which == "log_probs":
        loss = (lp * g).sum()
    elif which == "entropy":
        loss = (h * g).sum()
    else:
        loss = (lp * g).sum() - h.sum()
    loss.backward()
    zero = torch.zeros_like(g)
    upstream = {"log_probs": (g, zero), "entropy": (zero, g), "both": (g, -torch.ones_like(g))}[which]
    assert_grad_close(logits.grad, _reference(logits, target, 1.0, upstream)[2], torch.float32)


def test_no_grad_and_repeated_backward(device):
    """Inference computes no gradient; the backward is an op, so retain_graph backward twice is exact."""
    logits = make_logits((5,), 17, torch.float32, device)
    target = make_target((5,), 17, device)
    with torch.no_grad():
        lp, _ = rl_losses.token_log_probs(logits, target)
    x = logits.clone().requires_grad_()
    lp2, h2 = rl_losses.token_log_probs(x, target, compute_entropy=True)
    torch.testing.assert_close(lp, lp2.detach())
    loss = lp2.sum() + h2.sum()
    (first,) = torch.autograd.grad(loss, x, retain_graph=True)
    (second,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(first, second)


def test_double_backward_raises(device):
    x = make_logits((4,), 9, torch.float64, device).requires_grad_()
    lp, _ = rl_losses.token_log_probs(x, make_target((4,), 9, device, masked=0))
    with pytest.raises(RuntimeError, match="token_log_probs: double backward"):
        torch.autograd.grad(lp.sum(), x, create_graph=True)


def test_gradcheck_float64(device):
    x = make_logits((3, 2), 7, torch.float64, device).requires_grad_()
    t = make_target((3, 2), 7, device, masked=0.3)
    assert torch.autograd.gradcheck(
        lambda z: rl_losses.token_log_probs(z, t, temperature=1.3, compute_entropy=True), (x,), eps=1e-6,
        atol=1e-7, rtol=1e-5)


# ---- fused lm_head --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=param_id)
@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(device, dtype, chunk_size, bias):
    n, hidden_size, vocab = 11, 8, 29
    h = torch.randn(n, hidden_size, device=device).to(dtype)
    w = (torch.randn(vocab, hidden_size, device=device) * 0.7).to(dtype)
    b = (torch.randn(vocab, device=device) * 0.5).to(dtype) if bias else None
    target = make_target((n,), vocab, device, masked=0.2)
    g_lp, g_h = torch.randn(n, device=device), torch.randn(n, device=device)
    ours = [t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b)]
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (h, w, b)]
    lp, ent = rl_losses.linear_token_log_probs(ours[0], ours[1], target, bias=ours[2], temperature=0.8,
                                               compute_entropy=True, chunk_size=chunk_size)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    rlp, rent = reference.linear_token_log_probs(ref[0], ref[1], target, bias=ref[2], logits_scale_factor=1 / 0.8,
                                                 compute_entropy=True)
    ((rlp * g_lp.double()).sum() + (rent * g_h.double()).sum()).backward()
    scale = 10 if dtype == torch.bfloat16 else 1
    assert_close(lp, rlp, dtype, scale=scale)
    assert_close(ent, rent, dtype, scale=scale)
    for a, r in zip(ours, ref):
        if a is not None:
            assert_grad_close(a.grad, r.grad, dtype, scale=scale * 4)


def test_linear_only_weight_requires_grad(device):
    h = torch.randn(6, 5, device=device)
    w = torch.randn(13, 5, device=device, requires_grad=True)
    target = make_target((6,), 13, device)
    lp, _ = rl_losses.linear_token_log_probs(h, w, target, chunk_size=4)
    lp.sum().backward()
    w64 = w.detach().double().requires_grad_()
    reference.linear_token_log_probs(h.double(), w64, target)[0].sum().backward()
    assert_grad_close(w.grad, w64.grad, torch.float32)


# ---- the op layer ---------------------------------------------------------------------------------------------
def _opcheck_cases(device):
    logits = make_logits((2, 5), 11, torch.float32, device).requires_grad_()
    t = make_target((2, 5), 11, device)
    h = torch.randn(2, 5, 6, device=device, requires_grad=True)
    w = torch.randn(11, 6, device=device, requires_grad=True)
    b = torch.randn(11, device=device, requires_grad=True)
    return {
        "token_log_probs": (_ops.token_log_probs, (logits, t), dict(logits_scale_factor=0.5, compute_entropy=True)),
        "token_log_probs_lp_only": (_ops.token_log_probs, (logits, t), {}),
        "linear_token_log_probs": (_ops.linear_token_log_probs, (h, w, t),
                                   dict(bias=b, compute_entropy=True, chunk_size=3)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
def test_opcheck(device, case):
    op, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args, kwargs)


def test_compile_fullgraph(device):
    logits = make_logits((4, 6), 19, torch.float32, device)
    target = make_target((4, 6), 19, device)
    g = torch.randn(4, 6, device=device)

    def fn(x):
        lp, h = rl_losses.token_log_probs(x, target, temperature=0.9, compute_entropy=True)
        return (lp * g).sum() + h.mean()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)
    grads = []
    for f in (fn, compiled):
        x = logits.clone().requires_grad_()
        f(x).backward()
        grads.append(x.grad)
    assert_close(grads[1], grads[0], torch.float32)


def test_linear_compile_fullgraph(device):
    h0, w0 = torch.randn(9, 4, device=device), torch.randn(21, 4, device=device)
    target = make_target((9,), 21, device)

    def fn(h, w):
        lp, ent = rl_losses.linear_token_log_probs(h, w, target, compute_entropy=True, chunk_size=4)
        return lp.sum() + 0.1 * ent.sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)
    grads = []
    for f in (fn, compiled):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        f(h, w).backward()
        grads.append((h.grad, w.grad))
    for a, e in zip(*grads):
        assert_close(a, e, torch.float32)


def _bad_cases(device):
    x = make_logits((4,), 6, torch.float32, device)
    t = make_target((4,), 6, device)
    h, w = torch.randn(4, 3, device=device), torch.randn(6, 3, device=device)
    return {
        "temperature": (lambda: rl_losses.token_log_probs(x, t, temperature=0.0), "temperature must be > 0, got 0.0"),
        "target shape": (lambda: rl_losses.token_log_probs(x, t[:3]), "target has shape"),
        "target dtype": (lambda: rl_losses.token_log_probs(x, t.float()), "target must be an integer tensor"),
        "row_stats": (lambda: _ops.token_log_probs(x, t, row_stats=torch.zeros(3, 5, device=device)),
                      r"row_stats must have shape \(4, 5\)"),
        "grad shape": (lambda: _ops._token_log_probs_backward(
            x, t, stats=torch.zeros(4, 5, device=device), grad_log_probs=torch.zeros(3, device=device),
            grad_entropy=None, logits_scale_factor=1.0, top_k=None, top_p=None, min_p=None, vocab_start=0,
            vocab_size=-1), "grad_log_probs has shape"),
        "linear weight": (lambda: rl_losses.linear_token_log_probs(h, w[:, :2], t), "weight has hidden size 2"),
        "linear chunk": (lambda: rl_losses.linear_token_log_probs(h, w, t, chunk_size=0), "chunk_size must be >= 1"),
        "linear temperature": (lambda: rl_losses.linear_token_log_probs(h, w, t, temperature=-1.0),
                               "temperature must be > 0"),
    }


@pytest.mark.parametrize("case", list(_bad_cases("cpu")))
def test_bad_input_raises(device, case):
    fn, message = _bad_cases(device)[case]
    with pytest.raises((RuntimeError, ValueError), match=message):
        fn()


def test_label_out_of_range_raises_on_cpu():
    x = make_logits((3,), 5, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="label 5 at row 1 is out of range for vocab_size 5"):
        rl_losses.token_log_probs(x, torch.tensor([0, 5, -100]))
