"""The batch-invariant mode (rl_losses.batch_invariant, docs/consistency.md): each row's outputs and gradient row have
the same bits whatever the batch around the row (its size, the row's position, the other rows), the log-probs of
the no-gradient path equal the gradient path's, and the mode is still correct (the float64 reference); under
the sampler's options too (token_log_probs and GRPO with each row's own top_k, top_p and min_p). The fused
lm_head's forms, their chunk sizes and grad_weight's run-to-run bits: test_batch_invariance_linear.py.

The CUDA cases run where a GPU is present; their shapes are those where the default mode's kernels reduce a row in
another order depending on the batch: a part-empty last round of the persistent cluster grid (N = 1000 at
V = 32000), clusters of several CTAs per row (V = 128256), rows that do not start on 16-byte boundaries (V = 50257).
"""
import pytest
import torch

import rl_losses
from conftest import DEVICES, assert_close
from helpers import make_logits, make_target, op_loss, op_reference, policy_inputs
from helpers_invariance import assert_rows_equal, assert_rows_invariant, case_id, leaf, row_inputs, same_bits

SHAPES = {"cpu": [(37, 1001), (24, 512)], "cuda": [(1000, 32000), (300, 128256), (200, 50257)]}
CASES = [(d, n, v) for d in DEVICES for n, v in SHAPES[d]]
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.usefixtures("batch_invariant_mode")


# Each op over a batch of rows: its per-row results (first dimension: the rows) and gradient rows, from per-row
# inputs `r` (target, advantages, old log-probs, upstream gradients); divisor 1 where a loss has one, so that a
# row's gradient is its own term's.
def token_log_probs_rows(logits, r, compute_entropy=True, **sampler):
    x = leaf(logits)
    lp, h = rl_losses.token_log_probs(x, r["target"], compute_entropy=compute_entropy, **sampler)
    upstream = (lp * r["g_lp"]).sum() + ((h * r["g_h"]).sum() if compute_entropy else 0)
    upstream.backward()
    out = {"log_probs": lp.detach(), "grad": x.grad}
    if compute_entropy:
        out["entropy"] = h.detach()
    return out


def grpo_rows(logits, r, compute_entropy=False, **sampler):
    x = leaf(logits)
    out = rl_losses.grpo_loss(x, r["target"], r["adv"], r["old"], divisor=1.0, epsilon_high=0.28, beta=0.04,
                              ref_log_probs=r["ref"], compute_entropy=compute_entropy, **sampler)
    out.loss.backward()
    return {"log_probs": out.log_probs, "grad": x.grad}


def cross_entropy_rows(logits, r):
    options = {"label_smoothing": 0.1, "z_loss_factor": 1e-3}
    x = leaf(logits)
    rl_losses.cross_entropy(x, r["target"], reduction="sum", **options).backward()
    with torch.no_grad():
        loss = rl_losses.cross_entropy(logits, r["target"], reduction="none", **options)
    return {"loss": loss, "grad": x.grad}


def sampled(run):
    """`run` over the sampler's distribution: each row's own top_k, top_p and min_p."""
    def rows(logits, r, **options):
        return run(logits, r, **options, top_k=r["top_k"], top_p=r["top_p"], min_p=r["min_p"])
    return rows


ROW_OPS = {"token_log_probs": token_log_probs_rows, "grpo": grpo_rows, "cross_entropy": cross_entropy_rows,
           "token_log_probs sampled": sampled(token_log_probs_rows), "grpo sampled": sampled(grpo_rows)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ROW_OPS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rows_do_not_depend_on_the_batch(case, op, dtype):
    device, n, vocab = case
    assert_rows_invariant(ROW_OPS[op], make_logits((n,), vocab, dtype, device), row_inputs(n, vocab, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_no_gradient_log_probs_equal_the_gradient_path(case, dtype):
    device, n, vocab = case
    logits = make_logits((n,), vocab, dtype, device)
    r = row_inputs(n, vocab, device)
    with torch.no_grad():
        plain, _ = rl_losses.token_log_probs(logits, r["target"])
        with_entropy, _ = rl_losses.token_log_probs(logits, r["target"], compute_entropy=True)
        grpo_no_grad = rl_losses.grpo_loss(logits, r["target"], r["adv"], r["old"]).log_probs
    for compute_entropy in (False, True):
        trained = grpo_rows(logits, r, compute_entropy=compute_entropy)["log_probs"]
        for name, lp in (("token_log_probs", plain), ("token_log_probs with entropy", with_entropy),
                         ("grpo without gradient", grpo_no_grad)):
            assert same_bits(lp, trained), f"{name} vs grpo's gradient path (entropy {compute_entropy})"
    # The on-policy ratio of the gradient path against those log-probs is exactly 1.
    on_policy = rl_losses.grpo_loss(leaf(logits), r["target"], r["adv"], plain)
    assert on_policy.ratio_mean.item() == 1.0


@pytest.mark.skipif("cuda" not in DEVICES, reason="the CUDA kernels' choice by the rows' size")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_sliced_from_padded_logits(dtype):
    """Rows that start on 16-byte boundaries but whose size is not a multiple of 16 bytes (logits sliced from a
    padded tensor): the statistics-only passes cannot follow the cluster kernel's order there, so the mode splits the
    fused pass, and the no-gradient log-probs still equal the gradient path's."""
    n, vocab = 300, 32001
    logits = make_logits((n,), vocab + 15, dtype, "cuda")[:, :vocab]
    r = row_inputs(n, vocab, "cuda")
    with torch.no_grad():
        plain, _ = rl_losses.token_log_probs(logits, r["target"])
    assert same_bits(plain, grpo_rows(logits, r)["log_probs"])
    assert same_bits(plain, grpo_rows(logits, r, compute_entropy=True)["log_probs"])


def gspo_documents(n_docs, vocab, dtype, device):
    lengths = torch.randint(1, 9, (n_docs,)).tolist()
    docs = [{"logits": make_logits((k,), vocab, dtype, device), "target": make_target((k,), vocab, device, masked=0.2),
             "old": -torch.rand(k, device=device) * 8} for k in lengths]
    return docs, torch.randn(n_docs, device=device)


def gspo_rows(docs, adv, order):
    """GSPO over the documents `order` packed in that order: each token's log-prob and gradient row and each
    document's ratio, by document."""
    order = order.tolist()
    cat = lambda key: torch.cat([docs[d][key] for d in order])  # noqa: E731
    index = torch.cat([torch.full((len(docs[d]["target"]),), i, device=adv.device) for i, d in enumerate(order)])
    x = leaf(cat("logits"))
    out = rl_losses.gspo_loss(x, cat("target"), adv[order], cat("old"), index, num_documents=len(order),
                              divisor=1.0, epsilon_high=0.28)
    out.loss.backward()
    per_doc = {}
    for i, d in enumerate(order):
        at = index == i
        per_doc[d] = (out.log_probs[at], x.grad[at], out.document_ratios[i])
    return per_doc


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gspo_documents_do_not_depend_on_the_batch(case, dtype):
    device, n, vocab = case
    docs, adv = gspo_documents(max(n // 5, 4), vocab, dtype, device)
    s = len(docs)
    whole = gspo_rows(docs, adv, torch.arange(s, device=device))
    for what, order in (("permuted", torch.randperm(s, device=device)), ("dropped", torch.arange(1, s, device=device)),
                        ("half", torch.randperm(s, device=device)[: s // 2])):
        part = gspo_rows(docs, adv, order)
        for d, got in part.items():
            for name, a, b in zip(("log_probs", "grad", "ratio"), got, whole[d]):
                assert same_bits(a, b), f"{what}: document {d}'s {name} differs"


@pytest.mark.skipif("cuda" not in DEVICES, reason="the CUDA runner's two ordered sums")
def test_gspo_document_sums_scanned_or_sorted():
    """CUDA's ordered per-document sums scan the index where tokens x documents are few (2^24) and sort the tokens
    where they are many (csrc/common/row_pass_cuda.cuh): ~2000 documents of ~9000 tokens take the sort, half of them
    the scan, and every document's results keep their bits."""
    docs, adv = gspo_documents(2000, 256, torch.float32, torch.device("cuda"))
    s = len(docs)
    assert sum(len(d["target"]) for d in docs) * s > 1 << 24 > sum(len(d["target"]) for d in docs[: s // 2]) * (s // 2)
    whole = gspo_rows(docs, adv, torch.arange(s, device="cuda"))
    part = gspo_rows(docs, adv, torch.arange(s // 2, device="cuda"))
    for d, got in part.items():
        for name, a, b in zip(("log_probs", "grad", "ratio"), got, whole[d]):
            assert same_bits(a, b), f"document {d}'s {name} differs"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_runs_repeat_bit_for_bit(case):
    device, n, vocab = case
    logits = make_logits((n,), vocab, torch.bfloat16, device)
    target, adv, old, doc = policy_inputs(logits, num_documents=7)
    runs = []
    for _ in range(2):
        x = leaf(logits)
        out = rl_losses.gspo_loss(x, target, adv, old, doc, num_documents=7)
        out.loss.backward()
        runs.append((out.loss, out.document_ratios, x.grad))
    for a, b in zip(*runs):
        assert same_bits(a, b)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_pass_repeats_bit_for_bit(case):
    """GRPO's one pass, three runs: every CTA of a row's cluster writes the row's outputs from its own combined
    state, so the states must have the same bits in every CTA (a combine whose products were fused asymmetrically
    left ~1% of the rows' log-probs an ulp apart from run to run at V = 128256)."""
    device, n, vocab = case
    logits = make_logits((n,), vocab, torch.bfloat16, device)
    r = row_inputs(n, vocab, device)
    runs = [grpo_rows(logits, r) for _ in range(3)]
    for other in runs[1:]:
        for name in ("log_probs", "grad"):
            assert same_bits(runs[0][name], other[name]), f"{name} differs between runs"


@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_mode_is_correct(op, device):
    n, vocab = SHAPES[device][0]
    logits = make_logits((n,), vocab, torch.float32, device)
    target, adv, old, doc = policy_inputs(logits, num_documents=5)
    x = leaf(logits)
    loss = op_loss(op, x, target, adv, old, doc, 5)
    loss.backward()
    ref_loss, ref_grad = op_reference(op, logits, target, adv, old, doc, 5)
    assert_close(loss, ref_loss, torch.float32)
    assert_close(x.grad / ref_grad.abs().max(), ref_grad / ref_grad.abs().max(), torch.float32)
    lp, _ = rl_losses.token_log_probs(logits, target)
    ref_lp = rl_losses.reference.token_log_probs(logits.double(), target)[0]
    assert_close(lp, ref_lp, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_wrappers_follow_the_mode(device):
    n, vocab = SHAPES[device][0]
    logits = make_logits((n,), vocab, torch.bfloat16, device)
    r = row_inputs(n, vocab, device)

    def fn(x, target, adv, old):
        out = rl_losses.grpo_loss(x, target, adv, old, divisor=1.0)
        return out.loss, out.log_probs

    # The mode is read by the op when it runs, not traced: the compiled wrapper's rows are eager's in the mode.
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    whole = {"log_probs": fn(logits, r["target"], r["adv"], r["old"])[1]}
    for rows in (torch.arange(n, device=device), torch.arange(1, n, device=device)):
        got = compiled(logits[rows[0]:], *(r[k][rows[0]:] for k in ("target", "adv", "old")))[1]
        assert_rows_equal({"log_probs": got}, whole, rows, f"compiled, from row {rows[0].item()}")


def test_the_switch():
    assert rl_losses.is_batch_invariant()  # the module's fixture
    with rl_losses.batch_invariant(False):
        assert not rl_losses.is_batch_invariant()
        with rl_losses.batch_invariant():
            assert rl_losses.is_batch_invariant()
        assert not rl_losses.is_batch_invariant()
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            assert rl_losses.is_batch_invariant()
        finally:
            torch.use_deterministic_algorithms(deterministic)
        assert not rl_losses.is_batch_invariant()

        @rl_losses.batch_invariant()
        def inside():
            return rl_losses.is_batch_invariant()

        assert inside() and inside()
        assert not rl_losses.is_batch_invariant()
    assert rl_losses.is_batch_invariant()
