"""The fused lm_head's logits precision, `head_dtype` (csrc/linear/linear_source.h; docs/consistency.md, "Logits
precision"): "weight" rounds the logits to the weight's dtype, "float32" keeps GEMM 1's fp32 sums.

The inputs are bf16 values whose products and sums are exact in fp32 (small integers over powers of two), so that
the float64 reference's logits are exactly what any fp32 GEMM computes, in any order: "float32" must then equal
the reference on those logits, and "weight" the reference on them rounded to bf16, each within fp32 tolerances.
The gradients reach hidden and weight through the row pass's gradient rounded to bf16: bf16 tolerances there.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import make_target
from helpers_linear import assert_linear_grad_close, check_grads, leaves, make_linear, ref_logits

HIDDEN, VOCAB = 64, 97
HEAD_DTYPES = ["weight", "float32"]
# Chunks that do not divide the rows, lean mode's two sweeps, every row computed.
LAYOUTS = {"fast": dict(), "chunks": dict(chunk_size=7), "lean": dict(chunk_size=9, strategy="lean"),
           "all_rows": dict(chunk_size=5, skip_unlabelled=False)}


def exact_linear(n, device, vocab=VOCAB):
    """bf16 hidden (n, H) of integers in [-15, 15], weight (V, H) of k/4096 and bias (V,) of k/1024, |k| <= 255:
    every logit is a multiple of 2^-12 below 2^6 in magnitude (std ~2.5), which fp32 sums exactly in any order."""
    def ints(*shape, bound):
        return torch.randint(-bound, bound + 1, shape, device=device).double()
    hidden = ints(n, HIDDEN, bound=15).to(torch.bfloat16)
    weight = (ints(vocab, HIDDEN, bound=255) / 4096).to(torch.bfloat16)
    bias = (ints(vocab, bound=255) / 1024).to(torch.bfloat16)
    return hidden, weight, bias


def reference_logits(h64, w64, b64, head_dtype):
    """(the logits the reference reads, the float64 logits whose .grad check_grads reads): "weight" rounds them to
    bf16 in the forward, with the gradient of the unrounded logits (the op differentiates its rounded logits)."""
    logits = ref_logits(h64, w64, b64)
    if head_dtype == "float32":
        return logits, logits
    return logits + (logits.to(torch.bfloat16).double() - logits).detach(), logits


def policy_inputs(target, logits64, device):
    lp = torch.log_softmax(logits64.detach(), -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    n = target.numel()
    return dict(advantages=torch.randn(n, device=device), old=(lp + 0.3 * torch.randn_like(lp)).float(),
                ref=(lp + 0.2 * torch.randn_like(lp)).float(), doc=torch.arange(n, device=device) * 4 // n)


def run_op(op, h, w, b, target, x, **options):
    """(named outputs, the scalar to differentiate) of the fused op (x: policy_inputs)."""
    if op == "cross_entropy":
        loss = rl_losses.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.1, z_loss_factor=1e-3,
                                              logits_scale_factor=0.7, **options)
        return {"loss": loss}, loss
    if op == "grpo":
        out = rl_losses.linear_grpo_loss(h, w, target, x["advantages"], x["old"], bias=b, beta=0.05,
                                         ref_log_probs=x["ref"], compute_entropy=True, **options)
        return {"loss": out.loss, "log_probs": out.log_probs, "entropy": out.entropy}, out.loss
    if op == "gspo":
        out = rl_losses.linear_gspo_loss(h, w, target, x["advantages"], x["old"], x["doc"], num_documents=4, bias=b,
                                         **options)
        return {"loss": out.loss, "log_probs": out.log_probs, "document_ratios": out.document_ratios}, out.loss
    lp, ent = rl_losses.linear_token_log_probs(h, w, target, bias=b, compute_entropy=True, temperature=1.25,
                                               **options)
    return {"log_probs": lp, "entropy": ent}, (lp * x["advantages"]).sum() + (ent * x["ref"]).sum()


def run_reference(op, logits64, target, x):
    x64 = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
    if op == "cross_entropy":
        loss = reference.cross_entropy(logits64, target, label_smoothing=0.1, z_loss_factor=1e-3,
                                       logits_scale_factor=0.7)
        return {"loss": loss}, loss
    if op == "grpo":
        out = reference.grpo_loss(logits64, target, x64["advantages"], x64["old"], beta=0.05,
                                  ref_log_probs=x64["ref"], compute_entropy=True)
        return {"loss": out.loss, "log_probs": out.log_probs, "entropy": out.entropy}, out.loss
    if op == "gspo":
        out = reference.gspo_loss(logits64, target, x64["advantages"], x64["old"], x["doc"], num_documents=4)
        return {"loss": out.loss, "log_probs": out.log_probs, "document_ratios": out.document_ratios}, out.loss
    lp, ent = reference.token_log_probs(logits64, target, compute_entropy=True, logits_scale_factor=0.8)
    return {"log_probs": lp, "entropy": ent}, (lp * x64["advantages"]).sum() + (ent * x64["ref"]).sum()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("head_dtype", HEAD_DTYPES)
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo", "token_log_probs"])
def test_matches_the_reference_on_its_logits(device, op, head_dtype, layout):
    n = 40
    hidden, weight, bias = exact_linear(n, device)
    target = make_target((n,), VOCAB, device, masked=0.25)
    (h, w, b), (h64, w64, b64) = leaves(hidden, weight, bias)
    logits64, grad_logits64 = reference_logits(h64, w64, b64, head_dtype)
    x = policy_inputs(target, logits64, device)
    ours, loss = run_op(op, h, w, b, target, x, head_dtype=head_dtype, **LAYOUTS[layout])
    ref, ref_loss = run_reference(op, logits64, target, x)
    # The bf16 logits of a CUDA GEMM may sit one bf16 step from the rounded exact sum (its split-K pieces may be
    # reduced in bf16, which PyTorch allows by default): bf16 tolerances there.
    tolerance = torch.bfloat16 if head_dtype == "weight" and device == "cuda" else torch.float32
    for name, value in ours.items():
        assert_close(value, ref[name], tolerance, msg=name)
    check_grads((h, w, b), (h64, w64, b64), loss, ref_loss, grad_logits64, torch.bfloat16)


def test_rounding_the_logits_changes_the_log_probs(device):
    """bf16 logits (spacing 2^-7 to 2^-6 at |z| of 2 to 4) move the log-probs by ~1e-3; fp32 ones by ~1e-6."""
    hidden, weight, _ = exact_linear(64, device, vocab=257)
    target = make_target((64,), 257, device, masked=0.0)
    exact, _ = reference.token_log_probs(hidden.double() @ weight.double().T, target)
    err = {}
    for head_dtype in HEAD_DTYPES:
        lp, _ = rl_losses.linear_token_log_probs(hidden, weight, target, head_dtype=head_dtype)
        err[head_dtype] = (lp.double() - exact).abs().max().item()
    assert err["float32"] < 1e-5, err
    assert err["weight"] > 1e-3 and err["weight"] > 100 * err["float32"], err


@pytest.mark.parametrize("head_dtype", HEAD_DTYPES)
def test_sampler_filters_the_logits_of_its_precision(device, head_dtype):
    """top_k, top_p and min_p select over the logits the passes read: fp32, or rounded to bf16."""
    n = 30
    hidden, weight, bias = exact_linear(n, device)
    target = make_target((n,), VOCAB, device, masked=0.2)
    sampler = dict(top_k=torch.randint(1, VOCAB + 1, (n,), device=device), top_p=torch.tensor(0.9, device=device),
                   min_p=torch.tensor(0.02, device=device))
    (h, w, b), (h64, w64, b64) = leaves(hidden, weight, bias)
    lp, _ = rl_losses.linear_token_log_probs(h, w, target, bias=b, chunk_size=8, head_dtype=head_dtype, **sampler)
    logits64, grad_logits64 = reference_logits(h64, w64, b64, head_dtype)
    ref, _ = reference.token_log_probs(logits64, target, **sampler)
    assert_close(lp, ref, torch.bfloat16 if head_dtype == "weight" and device == "cuda" else torch.float32)
    g = torch.randn(n, device=device)
    check_grads((h, w, b), (h64, w64, b64), (lp * g).sum(), (ref * g.double()).sum(), grad_logits64, torch.bfloat16)


@pytest.mark.parametrize("strategy", ["fast", "lean"])
def test_weight_main_grad_takes_the_rounded_gradient(device, strategy):
    n = 33
    hidden, weight, _ = exact_linear(n, device)
    target = make_target((n,), VOCAB, device, masked=0.2)
    (h, w, _), (h64, w64, _) = leaves(hidden, weight, None)
    main_grad = torch.zeros(weight.shape, device=device)
    loss = rl_losses.linear_cross_entropy(h, w, target, chunk_size=8, strategy=strategy, head_dtype="float32",
                                          weight_main_grad=main_grad)
    logits64 = ref_logits(h64, w64, None)
    ref = reference.cross_entropy(logits64, target)
    assert_close(loss, ref, torch.float32)
    loss.backward()
    ref.backward()
    g = logits64.grad.abs()
    assert w.grad is None
    assert_linear_grad_close("weight", main_grad, w64.grad, g.T @ h64.detach().abs(), torch.bfloat16)
    assert_linear_grad_close("hidden", h.grad, h64.grad, g @ w64.detach().abs(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_wide_weights_ignore_it(device, dtype):
    """A fp32 or fp64 weight's logits are in its dtype already: "float32" changes no bit."""
    hidden, weight, bias = make_linear((21,), 16, 45, dtype, device, bias=True)
    target = make_target((21,), 45, device)
    x = policy_inputs(target, hidden.double() @ weight.double().T, device)
    results = []
    for head_dtype in HEAD_DTYPES:
        (h, w, b), _ = leaves(hidden, weight, bias)
        outputs, loss = run_op("grpo", h, w, b, target, x, head_dtype=head_dtype, chunk_size=8)
        loss.backward()
        results.append([*outputs.values(), h.grad, w.grad, b.grad])
    for weight_head, float32_head in zip(*results):
        assert torch.equal(weight_head, float32_head)


def test_float16_weights_take_it(device):
    """fp16 weights too: fp32 logits, the gradient rounded to fp16 for GEMM 2 and GEMM 3."""
    hidden, weight, bias = (t.to(torch.float16) for t in exact_linear(24, device))
    target = make_target((24,), VOCAB, device, masked=0.2)
    (h, w, b), (h64, w64, b64) = leaves(hidden, weight, bias)
    loss = rl_losses.linear_cross_entropy(h, w, target, bias=b, chunk_size=10, head_dtype="float32")
    logits64 = ref_logits(h64, w64, b64)
    ref = reference.cross_entropy(logits64, target)
    assert_close(loss, ref, torch.float32)
    check_grads((h, w, b), (h64, w64, b64), loss, ref, logits64, torch.float16)
