"""The fused lm_head's options at the op layer: bad values refused with one message by the real op and its fake
kernel, opcheck and torch.compile(fullgraph=True) of the calls that never synchronise (skip_unlabelled=False),
what autograd sees with weight_main_grad, and the upstream gradient that weight_main_grad refuses."""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_fake_rejects_like_real, make_target, requires_cuda
from helpers_linear import leaves, make_linear

_ops = torch.ops.rl_losses
N, H, V = 6, 5, 7


def _call(op, device, **options):
    """The public op `op` on small inputs on `device`, with these fused lm_head options."""
    h, w = torch.randn(N, H, device=device), torch.randn(V, H, device=device)
    t = torch.zeros(N, dtype=torch.long, device=device)
    a, o, d = torch.zeros(N, device=device), torch.zeros(N, device=device), torch.zeros(N, dtype=torch.long,
                                                                                        device=device)
    if op == "linear_cross_entropy":
        return _ops.linear_cross_entropy(h, w, t, **options)
    if op == "linear_grpo":
        return _ops.linear_grpo(h, w, t, a, o, **options)
    if op == "linear_gspo":
        return _ops.linear_gspo(h, w, t, a, o, d, num_documents=1, **options)
    return _ops.linear_token_log_probs(h, w, t, **options)


OPS = ["linear_cross_entropy", "linear_grpo", "linear_gspo", "linear_token_log_probs"]
BAD = {
    "strategy": (lambda d: dict(strategy="quick"), "strategy must be 'fast' or 'lean', got 'quick'"),
    "main_grad_dtype": (lambda d: dict(weight_main_grad=torch.zeros(V, H, dtype=torch.float64, device=d)),
                        r"weight_main_grad must be Float \(the accumulation dtype of a Float weight\), got Double"),
    "main_grad_shape": (lambda d: dict(weight_main_grad=torch.zeros(V, H + 1, device=d)),
                        r"weight_main_grad must have the weight's shape \[7, 5\], got \[7, 6\]"),
    "main_grad_strides": (lambda d: dict(weight_main_grad=torch.zeros(H, V, device=d).t()),
                          r"weight_main_grad must be contiguous, got strides \[1, 7\]"),
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("op", OPS)
def test_bad_option_rejected_by_op_and_fake(op, bad):
    options, message = BAD[bad]
    assert_fake_rejects_like_real(lambda d: _call(op, d, **options(d)), f"{op}: {message}")


@pytest.mark.parametrize("op", OPS)
def test_main_grad_on_another_device(op):
    """The fake (a meta buffer beside CPU tensors) and, with a GPU, the real op (a CPU buffer beside CUDA ones)."""
    with pytest.raises(RuntimeError, match=f"{op}: weight_main_grad is on meta but weight is on cpu"):
        _call(op, "cpu", weight_main_grad=torch.zeros(V, H, device="meta"))
    if torch.cuda.is_available() and rl_losses.cuda_kernels_available():
        with pytest.raises(RuntimeError, match=f"{op}: weight_main_grad is on cpu but weight is on cuda"):
            _call(op, "cuda", weight_main_grad=torch.zeros(V, H))


def _inputs(device, requires_grad=True):
    hidden, weight, bias = make_linear((3, 5), 6, 11, torch.float32, device, bias=True)
    target = make_target((3, 5), 11, device, masked=0.3)
    if requires_grad:
        hidden, weight, bias = (x.requires_grad_() for x in (hidden, weight, bias))
    a, o = torch.randn(3, 5, device=device), torch.randn(3, 5, device=device) - 3
    d = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, -1, -1], [3, 3, 3, 3, 3]], device=device)
    return hidden, weight, bias, target, a, o, d


def _opcheck_cases(device, mode, main_grad):
    h, w, b, t, a, o, d = _inputs(device)
    opts = dict(strategy=mode, chunk_size=4, skip_unlabelled=False,
                weight_main_grad=torch.zeros(11, 6, device=device) if main_grad else None)
    return {
        "linear_cross_entropy": (_ops.linear_cross_entropy, (h, w, t), dict(bias=b, **opts)),
        "linear_grpo": (_ops.linear_grpo, (h, w, t, a, o), dict(bias=b, **opts)),
        "linear_gspo": (_ops.linear_gspo, (h, w, t, a, o, d), dict(bias=b, num_documents=4, **opts)),
        "linear_token_log_probs": (_ops.linear_token_log_probs, (h, w, t), dict(bias=b, compute_entropy=True,
                                                                                 **opts)),
    }


@pytest.mark.parametrize("main_grad", [False, True], ids=["grads", "main_grad"])
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("op", OPS)
def test_opcheck(device, op, mode, main_grad):
    fn, args, kwargs = _opcheck_cases(device, mode, main_grad)[op]
    # test_aot_dispatch_dynamic re-runs backward through one graph, which the losses refuse by design (their
    # gradient is computed in the forward and scaled in place; tests/helpers.py explains).
    torch.library.opcheck(fn, args, kwargs, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))


def _loss(op, h, w, b, t, a, o, d, **options):
    if op == "linear_cross_entropy":
        return rl_losses.linear_cross_entropy(h, w, t, bias=b, **options)
    if op == "linear_grpo":
        return rl_losses.linear_grpo_loss(h, w, t, a, o, bias=b, **options).loss
    if op == "linear_gspo":
        return rl_losses.linear_gspo_loss(h, w, t, a, o, d, bias=b, num_documents=4, **options).loss
    lp, ent = rl_losses.linear_token_log_probs(h, w, t, bias=b, compute_entropy=True, **options)
    return lp.sum() + 0.3 * ent.sum()


@pytest.mark.parametrize("main_grad", [False, True], ids=["grads", "main_grad"])
@pytest.mark.parametrize("mode", ["fast", "lean"])
@pytest.mark.parametrize("op", OPS)
def test_compile_fullgraph(device, op, mode, main_grad):
    """The calls that never synchronise trace whole and give what the eager call gives."""
    torch._dynamo.reset()  # one traced function for every case: each case is a fresh trace, not a recompile
    h, w, b, t, a, o, d = _inputs(device, requires_grad=False)
    results = []
    for compiled in (False, True):
        (hh, ww, bb), _ = leaves(h, w, b)
        buffer = torch.ones(11, 6, device=device) if main_grad else None
        fn = lambda *x: _loss(op, *x, strategy=mode, chunk_size=4, skip_unlabelled=False,  # noqa: E731
                              weight_main_grad=buffer)
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)
        loss = fn(hh, ww, bb, t, a, o, d)
        loss.backward()
        results.append((loss, hh.grad, buffer if main_grad else ww.grad, bb.grad))
    for eager, compiled in zip(*results):
        assert_close(compiled, eager, torch.float32)


@pytest.mark.parametrize("op", OPS[:3])
def test_main_grad_refuses_another_upstream_gradient(op):
    """The losses add the weight's gradient in the forward, for an upstream gradient of 1 (CPU: the device-side
    assert of CUDA raises here)."""
    h, w, b, t, a, o, d = _inputs("cpu")
    loss = _loss(op, h, w, b, t, a, o, d, weight_main_grad=torch.zeros(11, 6))
    with pytest.raises(RuntimeError, match=f"{op}: with weight_main_grad, the weight's gradient is added"):
        (2.0 * loss).backward()


def test_main_grad_without_autograd_is_untouched():
    """No gradient is computed without grad mode (nor when the weight needs none): the buffer keeps its values."""
    h, w, b, t, a, o, d = _inputs("cpu")
    buffer = torch.randn(11, 6)
    start = buffer.clone()
    with torch.no_grad():
        rl_losses.linear_grpo_loss(h, w, t, a, o, bias=b, weight_main_grad=buffer)
    rl_losses.linear_grpo_loss(h, w.detach(), t, a, o, bias=b, weight_main_grad=buffer).loss.backward()
    assert torch.equal(buffer, start)
    assert h.grad is not None and w.grad is None


def test_main_grad_token_log_probs_takes_the_upstream_gradients():
    """linear_token_log_probs adds into the buffer in its backward, with whatever upstream gradients arrive."""
    h, w, b, t, *_ = _inputs("cpu")
    buffer = torch.randn(11, 6)
    start = buffer.clone()
    lp, ent = rl_losses.linear_token_log_probs(h, w, t, bias=b, compute_entropy=True, weight_main_grad=buffer,
                                               strategy="lean", chunk_size=4)
    g_lp, g_h = torch.randn_like(lp), torch.randn_like(ent)
    ((g_lp * lp).sum() + (g_h * ent).sum()).backward()
    _, (h64, w64, b64) = leaves(h, w, b)
    rlp, rent = reference.linear_token_log_probs(h64, w64, t, bias=b64, compute_entropy=True)
    ((g_lp.double() * rlp).sum() + (g_h.double() * rent).sum()).backward()
    assert w.grad is None
    assert_close(buffer - start, w64.grad, torch.float32, scale=10.0)
    assert_close(h.grad, h64.grad, torch.float32, scale=10.0)


@requires_cuda
def test_graph_capture_needs_skip_unlabelled_false():
    """Counting the labelled rows needs the host: under a CUDA graph capture skip_unlabelled=True says so."""
    h, w, b, t, a, o, d = _inputs("cuda", requires_grad=False)
    rl_losses.linear_cross_entropy(h, w, t, skip_unlabelled=True)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="skip_unlabelled=True counts the labelled rows on the host"):
        with torch.cuda.graph(graph):
            rl_losses.linear_cross_entropy(h, w, t, skip_unlabelled=True)


def _large_inputs(device):
    """_inputs' layout at N·V·H = 1024 · 32768 · 128 = 2^32 (kCountLabelledMinMacs), where a default call on a GPU
    counts the labelled rows; half of them unlabelled."""
    n, v = 1024, 32768
    hidden, weight, bias = make_linear((n,), 128, v, torch.float32, device, bias=True)
    target = make_target((n,), v, device, masked=0.5)
    return (hidden, weight, bias, target, torch.randn(n, device=device), torch.randn(n, device=device) - 3,
            torch.arange(n, device=device) * 4 // n)


def _default_call(op, h, w, b, t, a, o, d):
    """`op`'s results with every fused lm_head option at its default."""
    if op == "linear_cross_entropy":
        return _ops.linear_cross_entropy(h, w, t, bias=b)
    if op == "linear_grpo":
        return _ops.linear_grpo(h, w, t, a, o, bias=b)
    if op == "linear_gspo":
        return _ops.linear_gspo(h, w, t, a, o, d, bias=b, num_documents=4)
    return _ops.linear_token_log_probs(h, w, t, bias=b)


@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_graph_capture_with_the_default_runs_every_row(op):
    """The default (skip_unlabelled=None) counts no rows under a capture: it runs every row, and the replay gives
    what an eager call gives (which counts them at the large shape), unlabelled rows' outputs included."""
    for x in _inputs("cuda", requires_grad=False), _large_inputs("cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
            _default_call(op, *x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _default_call(op, *x)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, _default_call(op, *x)):
            if want is not None:
                assert_close(got, want, torch.float32)
