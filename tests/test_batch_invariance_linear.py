"""The batch-invariant mode of the fused lm_head (linear_* ops; docs/consistency.md): each row's outputs and
grad_hidden row have the same bits whatever the batch, the chunk size and the strategy (every GEMM over rows takes
the same number of rows: linear/linear_source.h, kInvariantGemmRows), with either head_dtype, the no-gradient
log-probs equal the gradient path's, grad_weight repeats bit for bit from run to run, and the results still match
the float64 reference."""
import pytest
import torch

import rl_losses
from conftest import DEVICES, assert_close
from helpers import make_target
from helpers_linear import make_linear
from helpers_invariance import assert_rows_equal, case_id, leaf, row_inputs, same_bits, sub_batches

# (rows, hidden size, vocabulary): odd sizes on the CPU (rows at every alignment); on CUDA a vocabulary whose
# rows are 16-byte aligned and one whose rows are not.
# (1100 rows: GEMMs of several 1024-row pieces, the last padded.)
SHAPES = {"cpu": [(37, 48, 1001), (1100, 16, 72)], "cuda": [(1000, 256, 32000), (300, 128, 50257)]}
CASES = [(d, *shape) for d in DEVICES for shape in SHAPES[d]]
# (dtype, head_dtype): the logits in the weight's dtype, or bf16 operands with fp32 logits.
PRECISIONS = [(torch.float32, "weight"), (torch.bfloat16, "weight"), (torch.bfloat16, "float32")]
# Chunk sizes (None: the strategy's own) and strategies a row's bits must not depend on.
LAYOUTS = [(None, "fast"), (7, "fast"), (16, "fast"), (9, "lean")]

pytestmark = pytest.mark.usefixtures("batch_invariant_mode")


def linear_token_log_probs_rows(hidden, weight, r, **layout):
    h, w = leaf(hidden), leaf(weight)
    lp, ent = rl_losses.linear_token_log_probs(h, w, r["target"], compute_entropy=True, **layout)
    ((lp * r["g_lp"]).sum() + (ent * r["g_h"]).sum()).backward()
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grad_hidden": h.grad}, w.grad


def linear_grpo_rows(hidden, weight, r, **layout):
    h, w = leaf(hidden), leaf(weight)
    out = rl_losses.linear_grpo_loss(h, w, r["target"], r["adv"], r["old"], divisor=1.0, epsilon_high=0.28,
                                     beta=0.04, ref_log_probs=r["ref"], **layout)
    out.loss.backward()
    return {"log_probs": out.log_probs, "grad_hidden": h.grad}, w.grad


def linear_cross_entropy_rows(hidden, weight, r, **layout):
    h, w = leaf(hidden), leaf(weight)
    rl_losses.linear_cross_entropy(h, w, r["target"], reduction="sum", label_smoothing=0.1, **layout).backward()
    with torch.no_grad():
        loss = rl_losses.linear_cross_entropy(hidden, weight, r["target"], reduction="none", label_smoothing=0.1,
                                              **layout)
    return {"loss": loss, "grad_hidden": h.grad}, w.grad


def linear_topk_distillation_rows(hidden, weight, r, **layout):
    # A sparse teacher of 8 ids a row, a function of the row's label (so that sub-batches select the same rows).
    vocab = weight.shape[0]
    ids = (r["target"].clamp_min(0)[:, None] * 7 + torch.arange(8, device=hidden.device) * 13) % vocab
    h, w = leaf(hidden), leaf(weight)
    out = rl_losses.linear_topk_distillation_loss(h, w, r["target"], ids, torch.log_softmax(torch.cos(ids.float()), -1),
                                                  tail="tail", divisor=1.0, **layout)
    out.loss.backward()
    return {"divergence": out.divergence, "student_mass": out.student_mass, "grad_hidden": h.grad}, w.grad


def linear_distillation_rows(hidden, weight, r, chunk_size=None, strategy=None, head_dtype="weight"):
    # Its own chunked GEMMs (no strategy or head_dtype); the teacher's row a function of the row's label.
    if head_dtype != "weight":
        pytest.skip("linear_distillation_loss computes the logits in the weight's dtype")
    columns = torch.arange(weight.shape[0], device=hidden.device)
    teacher = torch.cos(0.01 * columns * (r["target"].clamp_min(0)[:, None] + 1)).to(hidden.dtype)
    h, w = leaf(hidden), leaf(weight)
    rl_losses.linear_distillation_loss(h, w, teacher, kind="jsd", divisor=1.0, loss_mask=r["target"] >= 0,
                                       **({} if chunk_size is None else {"chunk_size": chunk_size})).backward()
    return {"grad_hidden": h.grad}, w.grad


LINEAR_OPS = {"linear_token_log_probs": linear_token_log_probs_rows, "linear_grpo": linear_grpo_rows,
              "linear_cross_entropy": linear_cross_entropy_rows,
              "linear_topk_distillation": linear_topk_distillation_rows, "linear_distillation": linear_distillation_rows}


def layout_options(chunk_size, strategy, head_dtype="weight"):
    return {"chunk_size": chunk_size, "strategy": strategy, "head_dtype": head_dtype}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("op", list(LINEAR_OPS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rows_do_not_depend_on_the_batch_or_the_chunks(case, op, precision):
    device, n, hidden_size, vocab = case
    dtype, head_dtype = precision
    run = LINEAR_OPS[op]
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, dtype, device)
    r = row_inputs(n, vocab, device)
    whole, _ = run(hidden, weight, r, head_dtype=head_dtype)
    for layout in LAYOUTS[1:]:
        assert_rows_equal(run(hidden, weight, r, **layout_options(*layout, head_dtype))[0], whole,
                          torch.arange(n, device=device), f"chunk size {layout}")
    for (what, rows), layout in zip(sub_batches(n, device), LAYOUTS * 2):
        part, _ = run(hidden[rows], weight, {k: v[rows] for k, v in r.items()},
                      **layout_options(*layout, head_dtype))
        assert_rows_equal(part, whole, rows, f"{what}, chunk size {layout}")


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gspo_rows_do_not_depend_on_the_chunks(case, precision):
    device, n, hidden_size, vocab = case
    dtype, head_dtype = precision
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, dtype, device)
    target = make_target((n,), vocab, device, masked=0.2)
    doc = torch.arange(n, device=device) * 5 // n
    adv, old = torch.randn(5, device=device), -torch.rand(n, device=device) * 8
    results = []
    for layout in LAYOUTS:
        h = leaf(hidden)
        out = rl_losses.linear_gspo_loss(h, weight, target, adv, old, doc, num_documents=5, divisor=1.0,
                                         **layout_options(*layout, head_dtype))
        out.loss.backward()
        results.append((layout, out.log_probs, out.document_ratios, h.grad))
    for layout, *got in results[1:]:
        for name, a, b in zip(("log_probs", "document_ratios", "grad_hidden"), got, results[0][1:]):
            assert same_bits(a, b), f"chunk size {layout}: {name}"


@pytest.mark.parametrize("head_dtype", ["weight", "float32"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_no_gradient_log_probs_equal_the_gradient_path(case, head_dtype):
    device, n, hidden_size, vocab = case
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, torch.bfloat16, device)
    r = row_inputs(n, vocab, device)
    with torch.no_grad():
        lp, _ = rl_losses.linear_token_log_probs(hidden, weight, r["target"], head_dtype=head_dtype)
    for layout in LAYOUTS:
        trained, _ = linear_grpo_rows(hidden, weight, r, **layout_options(*layout, head_dtype))
        assert same_bits(lp, trained["log_probs"]), f"chunk size {layout}"


@pytest.mark.parametrize("head_dtype", ["weight", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=str)
@pytest.mark.parametrize("op", list(LINEAR_OPS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grad_weight_repeats_bit_for_bit(case, op, layout, head_dtype):
    device, n, hidden_size, vocab = case
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, torch.bfloat16, device)
    r = row_inputs(n, vocab, device)
    runs = [LINEAR_OPS[op](hidden, weight, r, **layout_options(*layout, head_dtype)) for _ in range(2)]
    assert same_bits(runs[0][1], runs[1][1]), "grad_weight"
    assert_rows_equal(runs[1][0], runs[0][0], torch.arange(n, device=device), "second run")


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_the_mode_is_correct(device, layout):
    n, hidden_size, vocab = SHAPES[device][0]
    hidden, weight, _ = make_linear((n,), hidden_size, vocab, torch.float32, device)
    r = row_inputs(n, vocab, device)
    h, w = leaf(hidden), leaf(weight)
    out = rl_losses.linear_grpo_loss(h, w, r["target"], r["adv"], r["old"], **layout_options(*layout))
    out.loss.backward()
    h64, w64 = leaf(hidden.double()), leaf(weight.double())
    ref = rl_losses.reference.grpo_loss(h64 @ w64.T, r["target"], r["adv"].double(), r["old"].double())
    ref.loss.backward()
    assert_close(out.loss, ref.loss, torch.float32, scale=10)
    assert_close(out.log_probs, ref.log_probs, torch.float32, scale=10)
    for ours, theirs in ((h.grad, h64.grad), (w.grad, w64.grad)):
        norm = theirs.abs().max()
        assert_close(ours / norm, theirs / norm, torch.float32, scale=10)
