"""Tests of the fused lm_head ops (linear_cross_entropy, linear_grpo, linear_gspo).

Every case compares against the float64 pure-PyTorch reference applied to ``logits = hidden @ weight.T + bias``
computed in float64 from the same (rounded) inputs, differentiated by autograd w.r.t. hidden, weight and bias:
the loss, the three gradients and the metrics. Shapes are odd (H, V prime-ish), chunk sizes do not divide N,
and GSPO's packed documents cross chunk boundaries.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import assert_grad_close, make_target, param_id as _id, requires_cuda
from helpers_linear import check_grads, leaves, make_linear, ref_logits

_ops = torch.ops.rl_losses
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
CHUNKS = [None, 1, 7]  # default (all rows), one row at a time, a size that does not divide N
POLICY_METRICS = ("new_logprobs", "clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean")
# bf16 logits are rounded to bf16 in each chunk (as an unfused bf16 lm_head rounds them) before the loss reads
# them, so their error is that of the GEMM's output rounding, larger than the logits ops' rounding of inputs.
SCALE = {torch.float64: 1.0, torch.float32: 1.0, torch.bfloat16: 2.0}


# ---- cross-entropy ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("bias", [False, True])
def test_cross_entropy_matches_reference(device, dtype, chunk_size, bias):
    hidden, weight, b = make_linear((3, 11), 37, 101, dtype, device, bias=bias)
    target = make_target((3, 11), 101, device, masked=0.3)
    (h, w, bb), (h64, w64, b64) = leaves(hidden, weight, b)
    options = dict(logits_scale_factor=0.7, label_smoothing=0.1, z_loss_factor=1e-3)
    loss = rl_losses.linear_cross_entropy(h, w, target, bias=bb, chunk_size=chunk_size, **options)
    logits64 = ref_logits(h64, w64, b64)
    ref = reference.cross_entropy(logits64, target, **options)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(loss, ref, dtype, scale=SCALE[dtype])
    check_grads((h, w, bb), (h64, w64, b64), loss, ref, logits64, dtype, scale=SCALE[dtype])


@pytest.mark.parametrize("reduction,divisor", [("sum", None), ("mean", 5.0), ("sum", 3.0)])
def test_cross_entropy_reductions(device, reduction, divisor):
    hidden, weight, _ = make_linear((29,), 16, 50, torch.float32, device)
    target = make_target((29,), 50, device)
    (h, w), (h64, w64) = leaves(hidden, weight)
    loss = rl_losses.linear_cross_entropy(h, w, target, reduction=reduction, divisor=divisor, chunk_size=8)
    logits64 = ref_logits(h64, w64, None)
    ref = reference.cross_entropy(logits64, target, reduction=reduction, divisor=divisor)
    assert_close(loss, ref, torch.float32)
    check_grads((h, w, None), (h64, w64, None), loss, ref, logits64, torch.float32)


def test_cross_entropy_matches_logits_op(device):
    """The fused head gives what the logits op gives on the materialised logits (fp32: the same kernels), every
    row's lse included when every row is computed."""
    hidden, weight, b = make_linear((40,), 24, 77, torch.float32, device, bias=True)
    target = make_target((40,), 77, device)
    loss, lse = _ops.linear_cross_entropy(hidden, weight, target, bias=b, chunk_size=9, skip_unlabelled=False)
    loss_l, lse_l = _ops.cross_entropy(torch.addmm(b, hidden, weight.T), target)
    assert_close(loss, loss_l, torch.float32)
    assert_close(lse, lse_l, torch.float32)


def test_reduction_none_without_grad(device):
    hidden, weight, _ = make_linear((2, 9), 8, 30, torch.float32, device)
    target = make_target((2, 9), 30, device)
    loss = rl_losses.linear_cross_entropy(hidden, weight, target, reduction="none", chunk_size=4)
    assert loss.shape == (2, 9)
    assert_close(loss, reference.cross_entropy(hidden.double() @ weight.double().T, target, reduction="none"),
                 torch.float32)


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_only_some_inputs_require_grad(device, which):
    hidden, weight, b = make_linear((13,), 10, 21, torch.float32, device, bias=True)
    target = make_target((13,), 21, device)
    inputs = {"hidden": hidden.clone(), "weight": weight.clone(), "bias": b.clone()}
    inputs[which].requires_grad_()
    loss = rl_losses.linear_cross_entropy(inputs["hidden"], inputs["weight"], target, bias=inputs["bias"],
                                          chunk_size=5)
    loss.backward()
    (h64, w64, b64) = (t.double().requires_grad_() for t in (hidden, weight, b))
    reference.cross_entropy(ref_logits(h64, w64, b64), target).backward()
    expected = {"hidden": h64, "weight": w64, "bias": b64}[which].grad
    assert_grad_close(inputs[which].grad, expected, torch.float32)
    for name, t in inputs.items():
        assert (t.grad is None) == (name != which)


def test_upstream_gradient_scales_every_input(device):
    hidden, weight, b = make_linear((17,), 12, 33, torch.float32, device, bias=True)
    target = make_target((17,), 33, device)
    (h, w, bb), (h64, w64, b64) = leaves(hidden, weight, b)
    loss = rl_losses.linear_cross_entropy(h, w, target, bias=bb, chunk_size=6)
    logits64 = ref_logits(h64, w64, b64)
    ref = reference.cross_entropy(logits64, target)
    check_grads((h, w, bb), (h64, w64, b64), loss * -2.5, ref * -2.5, logits64, torch.float32)


def test_no_grad_computes_no_gradient(device):
    hidden, weight, _ = make_linear((10,), 8, 19, torch.float32, device)
    target = make_target((10,), 19, device)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with torch.no_grad():
        loss = rl_losses.linear_cross_entropy(h, w, target)
    assert not loss.requires_grad
    assert_close(loss, reference.cross_entropy(hidden.detach().double() @ weight.detach().double().T, target),
                 torch.float32)


# ---- GRPO -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_grpo_matches_reference(device, dtype, chunk_size):
    batch, vocab = (4, 9), 53
    hidden, weight, b = make_linear(batch, 31, vocab, dtype, device, bias=True)
    target = make_target(batch, vocab, device, masked=0.25)
    logits64 = ref_logits(hidden.double(), weight.double(), b.double())
    lp = torch.log_softmax(logits64, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    old = (lp + 0.3 * torch.randn(batch, device=device, dtype=torch.float64)).float()
    ref_lp = (lp + 0.2 * torch.randn(batch, device=device, dtype=torch.float64)).float()
    advantages = torch.randn(batch, device=device)
    counts = torch.randint(1, 6, batch, device=device)
    weights = torch.rand(batch, device=device)
    options = dict(epsilon_low=0.2, epsilon_high=0.28, delta=1.6, ref_log_probs=ref_lp, beta=0.05,
                   loss_weights=weights, label_counts=counts, compute_entropy=True)
    (h, w, bb), (h64, w64, b64) = leaves(hidden, weight, b)
    out = rl_losses.linear_grpo_loss(h, w, target, advantages, old, bias=bb, chunk_size=chunk_size, **options)
    logits64 = ref_logits(h64, w64, b64)
    ref = reference.grpo_loss(logits64, target, advantages, old, **options)
    scale = SCALE[dtype]
    assert_close(out.loss, ref.loss, dtype, scale=scale)
    for name in POLICY_METRICS + ("entropy",):
        # Clip indicators of tokens sitting on a clip boundary may flip under bf16 rounding of the logits.
        if dtype == torch.bfloat16 and name.startswith("clipped"):
            continue
        assert_close(getattr(out, name), getattr(ref, name), dtype, scale=scale, msg=name)
    assert_close(out.log_probs, ref.log_probs, dtype, scale=scale)
    check_grads((h, w, bb), (h64, w64, b64), out.loss, ref.loss, logits64, dtype, scale=scale)


# ---- GSPO -------------------------------------------------------------------------------------------------
def packed_documents(lengths, padding, device):
    """document_index for documents of the given lengths laid end to end, then `padding` tokens of -1."""
    ids = [d for d, n in enumerate(lengths) for _ in range(n)] + [-1] * padding
    return torch.tensor(ids, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("chunk_size", [None, 5, 7])
@pytest.mark.parametrize("weighting,token_advantages,delta", [("document", False, None), ("token", False, None),
                                                               ("document", True, None), ("token", False, 1.35)])
def test_gspo_matches_reference(device, dtype, chunk_size, weighting, token_advantages, delta):
    # 4 documents of 7, 9, 4 and 3 tokens and 2 padding tokens: chunks of 5 or 7 rows cut through documents.
    document_index = packed_documents([7, 9, 4, 3], 2, device)
    n, vocab = document_index.numel(), 61
    hidden, weight, b = make_linear((n,), 29, vocab, dtype, device, bias=True)
    target = make_target((n,), vocab, device, masked=0.2)
    logits64 = ref_logits(hidden.double(), weight.double(), b.double())
    lp = torch.log_softmax(logits64, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    old = (lp + 0.1 * torch.randn(n, device=device, dtype=torch.float64)).float()
    advantages = torch.randn(n, device=device)
    if delta is not None:  # documents 0 and 3 above δ with negative advantages: the cap is on
        doc = document_index.clamp_min(0)
        old = old - torch.tensor([1.6, 0.9, 1.1, 1.5], device=device).log()[doc]
        advantages = torch.tensor([-1.0, 1.0, 1.0, -1.0], device=device)[doc] + 0.2 * advantages
    options = dict(num_documents=4, weighting=weighting, token_advantages=token_advantages, compute_entropy=True,
                   epsilon_low=0.2, epsilon_high=0.3, delta=delta)
    (h, w, bb), (h64, w64, b64) = leaves(hidden, weight, b)
    out = rl_losses.linear_gspo_loss(h, w, target, advantages, old, document_index, bias=bb, chunk_size=chunk_size,
                                     **options)
    logits64 = ref_logits(h64, w64, b64)
    ref = reference.gspo_loss(logits64, target, advantages, old, document_index, **options)
    scale = SCALE[dtype]
    assert_close(out.loss, ref.loss, dtype, scale=scale)
    for name in ("new_logprobs", "kl_old", "ratio_mean", "entropy"):
        assert_close(getattr(out, name), getattr(ref, name), dtype, scale=scale, msg=name)
    assert_close(out.document_ratios, ref.document_ratios, dtype, scale=scale)
    assert_close(out.log_probs, ref.log_probs, dtype, scale=scale)
    check_grads((h, w, bb), (h64, w64, b64), out.loss, ref.loss, logits64, dtype, scale=scale)


# ---- bad input ----------------------------------------------------------------------------------------------
def _bad_cases(device):
    h, w, b = make_linear((6,), 8, 10, torch.float32, device, bias=True)
    t = make_target((6,), 10, device)
    ce = rl_losses.linear_cross_entropy
    return {
        "weight hidden size": (lambda: ce(h, w[:, :7], t), "weight has hidden size 7 but hidden has 8"),
        "weight dims": (lambda: ce(h, w[0], t), "weight must be a 2-D"),
        "weight dtype": (lambda: ce(h, w.double(), t), "weight is Double but hidden is Float"),
        "hidden dtype": (lambda: ce(h.long(), w, t), "hidden must be a floating-point tensor"),
        "bias shape": (lambda: ce(h, w, t, bias=b[:9]), r"bias must have shape \(10,\)"),
        "bias dtype": (lambda: ce(h, w, t, bias=b.half()), "bias must be Float"),
        "target shape": (lambda: ce(h, w, t[:5]), "target has shape"),
        "target dtype": (lambda: ce(h, w, t.float()), "target must be an integer tensor"),
        "chunk_size": (lambda: ce(h, w, t, chunk_size=0), "chunk_size must be >= 1, got 0"),
        "reduction none with grad": (lambda: ce(h, w.clone().requires_grad_(), t, reduction="none"),
                                     "reduction='none' cannot be differentiated"),
        "label_smoothing": (lambda: ce(h, w, t, label_smoothing=1.5), "label_smoothing must be in"),
        "epsilon": (lambda: rl_losses.linear_grpo_loss(h, w, t, t.float(), t.float(), epsilon_low=1.5),
                    "linear_grpo: epsilon_low must be in"),
        "advantages shape": (lambda: rl_losses.linear_grpo_loss(h, w, t, t[:3].float(), t.float()),
                             "advantages has shape"),
        "weighting": (lambda: rl_losses.linear_gspo_loss(h, w, t, t.float(), t.float(), t.clamp_min(0),
                                                         weighting="x"), "weighting must be"),
    }


@pytest.mark.parametrize("case", list(_bad_cases("cpu")))
def test_bad_input_raises(device, case):
    fn, message = _bad_cases(device)[case]
    with pytest.raises((RuntimeError, ValueError), match=message):
        fn()


def test_label_out_of_range_raises_on_cpu():
    h, w, _ = make_linear((6,), 8, 10, torch.float32, "cpu")
    t = torch.tensor([0, 1, 10, 2, -100, 3])
    with pytest.raises(RuntimeError, match="label 10 at row 2 is out of range for vocab_size 10"):
        rl_losses.linear_cross_entropy(h, w, t, chunk_size=4)


# ---- the op layer ---------------------------------------------------------------------------------------------
def _opcheck_cases(device):
    h, w, b = make_linear((2, 5), 6, 11, torch.float32, device, bias=True)
    t = make_target((2, 5), 11, device)
    a, o = torch.randn(2, 5, device=device), torch.randn(2, 5, device=device) - 3
    d = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, -1, -1]], device=device)
    req = [x.clone().requires_grad_() for x in (h, w, b)]
    return {
        "linear_cross_entropy": (_ops.linear_cross_entropy, (*req[:2], t), dict(bias=req[2], chunk_size=3)),
        "linear_grpo": (_ops.linear_grpo, (*req[:2], t, a, o), dict(bias=req[2], chunk_size=4)),
        "linear_gspo": (_ops.linear_gspo, (*req[:2], t, a, o, d), dict(num_documents=3, chunk_size=3, delta=1.5)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
def test_opcheck(device, case):
    op, args, kwargs = _opcheck_cases(device)[case]
    # test_aot_dispatch_dynamic re-runs backward through one graph, which these ops refuse by design (their
    # gradient is computed in the forward and scaled in place; tests/helpers.py explains).
    torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))


def test_compile_fullgraph(device):
    hidden, weight, _ = make_linear((12,), 8, 23, torch.float32, device)
    target = make_target((12,), 23, device)
    (h, w), _ = leaves(hidden, weight)
    compiled = torch.compile(lambda *x: rl_losses.linear_cross_entropy(*x, chunk_size=5), fullgraph=True,
                             backend="aot_eager", dynamic=False)
    loss = compiled(h, w, target)
    loss.backward()
    (h2, w2), _ = leaves(hidden, weight)
    expected = rl_losses.linear_cross_entropy(h2, w2, target, chunk_size=5)
    expected.backward()
    assert_close(loss, expected, torch.float32)
    assert_grad_close(h.grad, h2.grad, torch.float32)
    assert_grad_close(w.grad, w2.grad, torch.float32)


# ---- memory (CUDA) ------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("head_dtype", ["weight", "float32"])
def test_peak_memory_is_one_chunk_not_the_logits(head_dtype):
    """Extra peak memory = one chunk of logits + the fp32 weight-gradient accumulator + O(N), never N x V. fp32
    logits: 4 bytes each, and a sixteenth of the chunk's rows copied while its gradient is rounded to bf16."""
    n, hidden_size, vocab, chunk = 8192, 256, 32768, 512
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, torch.bfloat16, "cuda")
    target = make_target((n,), vocab, "cuda")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rl_losses.linear_cross_entropy(h, w, target, chunk_size=chunk, head_dtype=head_dtype).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = h.grad.nbytes + w.grad.nbytes
    logits = chunk * vocab * 2 if head_dtype == "weight" else chunk * vocab * 4 + chunk // 16 * vocab * 2
    budget = grads + logits + vocab * hidden_size * 4 + 64 * n + (8 << 20)
    assert extra <= budget, f"extra peak {extra / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB"
    assert extra < n * vocab * 2, "the logits were materialised"


@requires_cuda
@pytest.mark.parametrize("head_dtype", ["weight", "float32"])
def test_lean_peak_memory_is_within_its_budget(head_dtype):
    """Lean mode: at most 256 MiB beyond the gradients where the logits alone would be 1 GiB (2 GiB in fp32)."""
    n, hidden_size, vocab = 16384, 512, 32768
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, torch.bfloat16, "cuda")
    target = make_target((n,), vocab, "cuda")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    rl_losses.linear_cross_entropy(h, w, target, strategy="lean", head_dtype=head_dtype).backward()  # warm-up
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rl_losses.linear_cross_entropy(h, w, target, strategy="lean", head_dtype=head_dtype).backward()
    torch.cuda.synchronize()
    beyond = torch.cuda.max_memory_allocated() - base - h.grad.nbytes - w.grad.nbytes
    assert beyond <= (256 << 20) + (4 << 20), f"{beyond / 2**20:.0f} MiB beyond the gradients"


@requires_cuda
@pytest.mark.parametrize("op", ["ce", "grpo", "gspo"])
def test_label_out_of_range_cuda_opt_in_check(monkeypatch, op):
    """RL_LOSSES_CHECK_INPUTS=1: a label >= weight.shape[0] is a Python error, not a device-side assert."""
    monkeypatch.setenv("RL_LOSSES_CHECK_INPUTS", "1")
    hidden, weight, _ = make_linear((4,), 8, 7, torch.float32, "cuda")
    target = torch.tensor([0, 7, -100, 6], device="cuda")
    advantages, old = torch.randn(4, device="cuda"), torch.randn(4, device="cuda")
    calls = {
        "ce": lambda: rl_losses.linear_cross_entropy(hidden, weight, target),
        "grpo": lambda: rl_losses.linear_grpo_loss(hidden, weight, target, advantages, old),
        "gspo": lambda: rl_losses.linear_gspo_loss(hidden, weight, target, advantages, old,
                                                   torch.zeros(4, dtype=torch.long, device="cuda"), num_documents=1),
    }
    with pytest.raises(ValueError, match="target holds label 7, out of range for vocab_size 7"):
        calls[op]()
