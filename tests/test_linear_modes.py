"""The fused lm_head's modes (docs/performance.md) for every linear op, against the float64 reference applied to
``hidden @ weight.T + bias``: strategy "fast" and "lean", each with the weight's gradient returned or added into a
caller's buffer (weight_main_grad), with the unlabelled rows skipped or not.

Chunk sizes 5 and 7 cut the N = 23 rows unevenly, and lean mode's vocabulary blocks (chunk · V / M columns) the
V = 61 columns; None is the default chunk, every row at once at this size. Every output and every gradient is
compared. The buffer starts from random values: what it gains is the weight's gradient, and autograd gives the
weight none. Ops: CE (smoothing and z-loss), GRPO (KL, entropy metric), GRPO with loss_type vespo (a statistics
pass before the gradient pass, whose statistics the source is then given), GSPO (packed documents with padding)
and token_log_probs with random upstream gradients, without and with the entropy.
"""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from helpers import label_log_probs64, make_target, param_id as _id
from helpers_linear import assert_linear_grad_close, grad_magnitudes, leaves, make_linear, ref_logits

N, H, V, DOCS = 23, 13, 61, 4
DOCUMENTS = [0] * 6 + [1] * 7 + [2] * 3 + [3] * 5 + [-1] * 2  # N tokens, padding last
OPS = ["ce", "grpo", "grpo_vespo", "gspo", "token_log_probs", "token_log_probs_entropy"]
MODES = {"fast": ("fast", False), "lean": ("lean", False), "fast+main_grad": ("fast", True),
         "lean+main_grad": ("lean", True)}
POLICY_METRICS = ("new_logprobs", "clipped_fraction_low", "clipped_fraction_high", "kl_old", "ratio_mean",
                  "entropy", "kl", "vespo_phi_seq_mean")
SCALE = {torch.float64: 1.0, torch.float32: 1.0, torch.bfloat16: 2.0}  # as tests/test_linear.py
CE = dict(logits_scale_factor=0.7, label_smoothing=0.1, z_loss_factor=1e-3)
TEMPERATURE = 0.8


def make_case(device, dtype, masked):
    """The op's inputs: hidden, weight, bias, labels, and per-token inputs near the current log-probs."""
    hidden, weight, bias = make_linear((N,), H, V, dtype, device, bias=True)
    target = make_target((N,), V, device, masked=masked)
    lp = label_log_probs64(hidden.double() @ weight.double().T + bias.double(), target)
    noise = torch.randn(3, N, device=device, dtype=torch.float64)
    return dict(hidden=hidden, weight=weight, bias=bias, target=target, advantages=torch.randn(N, device=device),
                old=(lp + 0.3 * noise[0]).float(), ref=(lp + 0.2 * noise[1]).float(), g_lp=noise[2].float(),
                g_h=torch.randn(N, device=device), doc=torch.tensor(DOCUMENTS, device=device))


def run_op(op, h, w, b, x, mod, **options):
    """(loss, outputs) of `op` through rl_losses (mod=None: the linear op with `options`) or, given the float64
    logits as `h`, through the reference (mod=reference)."""
    t, adv, old, doc = x["target"], x["advantages"], x["old"], x["doc"]
    if mod is reference:
        logits, to = h, (lambda v: v.double())
    else:
        to = (lambda v: v)
    if op == "ce":
        if mod is reference:
            lse = torch.logsumexp(CE["logits_scale_factor"] * logits.detach(), -1)
            return reference.cross_entropy(logits, t, **CE), {"lse": lse}
        loss, lse = torch.ops.rl_losses.linear_cross_entropy(h, w, t, bias=b, **CE, **options)
        return loss, {"lse": lse}
    if op.startswith("token_log_probs"):
        entropy = op.endswith("entropy")
        if mod is reference:
            lp, ent = reference.token_log_probs(logits, t, logits_scale_factor=1 / TEMPERATURE,
                                                compute_entropy=entropy)
        else:
            lp, ent = rl_losses.linear_token_log_probs(h, w, t, bias=b, temperature=TEMPERATURE,
                                                       compute_entropy=entropy, **options)
        loss = (to(x["g_lp"]) * lp).sum() + ((to(x["g_h"]) * ent).sum() if entropy else 0)
        return loss, {"log_probs": lp, **({"entropy": ent} if entropy else {})}
    if op == "gspo":
        kw = dict(num_documents=DOCS, compute_entropy=True, epsilon_high=0.3)
        out = (reference.gspo_loss(logits, t, to(adv), to(old), doc, **kw) if mod is reference else
               rl_losses.linear_gspo_loss(h, w, t, adv, old, doc, bias=b, **kw, **options))
    else:
        kw = dict(ref_log_probs=to(x["ref"]), beta=0.05, compute_entropy=True, epsilon_high=0.28)
        if op == "grpo_vespo":  # its sequences: the documents, the padding joined to the last one
            kw.update(loss_type="vespo", document_index=doc.where(doc >= 0, DOCS - 1), num_documents=DOCS)
        out = (reference.grpo_loss(logits, t, to(adv), to(old), **kw) if mod is reference else
               rl_losses.linear_grpo_loss(h, w, t, adv, old, bias=b, **kw, **options))
    named = {k: getattr(out, k) for k in POLICY_METRICS + ("log_probs", "document_ratios")
             if getattr(out, k) is not None}
    return out.loss, named


def check_mode(device, dtype, op, mode, chunk_size, skip, masked=0.3):
    """One call of `op` in `mode` against the reference: every output, then every gradient."""
    x = make_case(device, dtype, masked)
    name, into_buffer = MODES[mode]
    (h, w, b), (h64, w64, b64) = leaves(x["hidden"], x["weight"], x["bias"])
    # Values below the gradient's scale: the buffer's own rounding of what it gains stays under the tolerance.
    buffer = 1e-3 * torch.randn(V, H, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    start = buffer.clone()
    options = dict(strategy=name, chunk_size=chunk_size, skip_unlabelled=skip,
                   weight_main_grad=buffer if into_buffer else None)
    loss, outputs = run_op(op, h, w, b, x, None, **options)
    logits64 = ref_logits(h64, w64, b64)
    # The op's logits are GEMM outputs in the input dtype: the reference reads the same rounded values (its
    # gradient passes the rounding unchanged), so that a ratio on a clip boundary is on the same side in both.
    rounded = logits64 + (logits64.to(dtype).double() - logits64).detach()
    ref_loss, ref_outputs = run_op(op, rounded, None, None, x, reference)
    scale = SCALE[dtype]
    assert_close(loss, ref_loss.detach(), dtype, scale=scale, msg="loss")
    unlabelled = x["target"] < 0
    for key, expected in ref_outputs.items():
        # Clip indicators of tokens on a clip boundary may flip under bf16 rounding of the logits.
        if dtype == torch.bfloat16 and key.startswith("clipped"):
            continue
        expected = expected.detach()
        if key == "lse" and skip is not False:  # an unlabelled row's outputs are zeros unless every row is asked for
            expected = torch.where(unlabelled, 0.0, expected)
        assert_close(outputs[key], expected, dtype, scale=scale, msg=key)
    loss.backward()
    ref_loss.backward()
    magnitudes = grad_magnitudes(logits64, h64, w64)
    assert_linear_grad_close("hidden", h.grad, h64.grad, magnitudes[0], dtype, scale=scale)
    assert_linear_grad_close("bias", b.grad, b64.grad, magnitudes[2], dtype, scale=scale)
    if into_buffer:
        assert w.grad is None, "with weight_main_grad autograd gets no gradient for the weight"
        assert_linear_grad_close("weight", buffer - start, w64.grad, magnitudes[1], dtype, scale=scale)
    else:
        assert w.grad.dtype == dtype
        assert_linear_grad_close("weight", w.grad, w64.grad, magnitudes[1], dtype, scale=scale)
        assert torch.equal(buffer, start)


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "all_rows"])
@pytest.mark.parametrize("chunk_size", [None, 5, 7])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", OPS)
def test_mode_matches_reference(device, op, mode, chunk_size, skip):
    check_mode(device, torch.float64, op, mode, chunk_size, skip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", OPS)
def test_mode_matches_reference_low_precision(device, dtype, op, mode):
    check_mode(device, dtype, op, mode, 7, True)


@pytest.mark.parametrize("masked", [0.0, 1.0], ids=["every_row_labelled", "no_row_labelled"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", OPS)
def test_mode_with_every_or_no_row_labelled(device, op, mode, masked):
    check_mode(device, torch.float64, op, mode, 5, True, masked=masked)


def test_gemm_pieces_beyond_4096_rows(device):
    """Fast mode's default chunk holds all 4500 rows; GEMM 1 and 2 go in pieces of 3072 and 1428 rows."""
    n = 4500
    hidden, weight, bias = make_linear((n,), 8, 11, torch.float64, device, bias=True)
    target = make_target((n,), 11, device, masked=0.2)
    (h, w, b), (h64, w64, b64) = leaves(hidden, weight, bias)
    loss = rl_losses.linear_cross_entropy(h, w, target, bias=b)
    logits64 = ref_logits(h64, w64, b64)
    ref = reference.cross_entropy(logits64, target)
    assert_close(loss, ref.detach(), torch.float64)
    loss.backward()
    ref.backward()
    for name, ours, want, m in zip(("hidden", "weight", "bias"), (h, w, b), (h64, w64, b64),
                                   grad_magnitudes(logits64, h64, w64)):
        assert_linear_grad_close(name, ours.grad, want.grad, m, torch.float64)


@pytest.mark.parametrize("mode,chunk_size", [("fast", None), ("lean", 10)])
def test_unlabelled_rows_take_no_gemm_work(mode, chunk_size):
    """With half the 48 rows unlabelled, the GEMMs of a fwd+bwd see the 24 labelled rows, never 48 (fast: one
    chunk of every row; lean: the vocabulary blocks take every row at once); on the CPU the default (None) counts
    them as True does."""
    n, m = 48, 24
    hidden, weight, _ = make_linear((n,), 10, 37, torch.float32, "cpu")
    target = torch.randint(0, 37, (n,))
    target[torch.randperm(n)[:n - m]] = -100
    adv, old = torch.randn(n), torch.randn(n) - 3
    rows = {}
    for skip in (True, False, None):
        (h, w), _ = leaves(hidden, weight)
        with torch.profiler.profile(record_shapes=True) as prof:
            rl_losses.linear_grpo_loss(h, w, target, adv, old, strategy=mode, chunk_size=chunk_size,
                                       skip_unlabelled=skip).loss.backward()
        dims = {d for e in prof.events() if e.name in ("aten::mm", "aten::addmm")
                for shape in e.input_shapes for d in shape}
        rows[skip] = dims
    assert n not in rows[True] and m in rows[True], rows[True]
    assert n in rows[False], rows[False]
    assert rows[None] == rows[True], rows[None]
