"""The batch-invariant mode for the ops beyond the log-prob family (docs/consistency.md): distillation (the three
kinds), top-K distillation and the fused head (cross-entropy, z-loss, GRPO and distillation together) give each
row's per-token results and gradient row the same bits whatever the batch around the row, and DPO each pair's.
(The CPU's row loops hold this in either mode; the CUDA cases are where the mode tells.) Same harness and shapes
as test_batch_invariance.py (the CUDA shapes: a part-empty last round of the cluster grid, several CTAs a row,
rows off 16-byte boundaries).
"""
import pytest
import torch

import rl_losses
from rl_losses._schema import ROW_STATS
from conftest import DEVICES
from helpers import make_logits
from helpers_invariance import assert_rows_equal, assert_rows_invariant, case_id, leaf, row_inputs

SHAPES = {"cpu": [(37, 1001), (24, 512)], "cuda": [(1000, 32000), (300, 128256), (200, 50257)]}
CASES = [(d, n, v) for d in DEVICES for n, v in SHAPES[d]]
K = 16  # the sparse teacher's ids per row

pytestmark = pytest.mark.usefixtures("batch_invariant_mode")


def _teacher(logits):
    # A teacher row for each student row: a function of that row alone, so that sub-batches select the same rows.
    return (logits.float() * 0.7 + torch.cos(logits.float())).to(logits.dtype)


def _sparse_teacher(target, vocab):
    # K distinct ids a row and their log-probs, functions of the row's label (topk over tied values could order
    # them differently in another batch).
    ids = (target.clamp_min(0)[:, None] * 7 + torch.arange(K, device=target.device) * 13) % vocab
    return ids, torch.log_softmax(torch.cos(ids.float()), dim=-1)


def distillation_rows(kind):
    def rows(logits, r):
        x = leaf(logits)
        out = rl_losses.distillation_loss(x, _teacher(logits), kind=kind, divisor=1.0, temperature=1.5,
                                          loss_mask=r["target"] >= 0)
        out.loss.backward()
        return {"divergence": out.divergence, "grad": x.grad}
    return rows


def topk_rows(logits, r):
    x = leaf(logits)
    ids, log_probs = _sparse_teacher(r["target"], logits.shape[-1])
    out = rl_losses.topk_distillation_loss(x, r["target"], ids, log_probs, tail="tail", divisor=1.0)
    out.loss.backward()
    return {"divergence": out.divergence, "student_mass": out.student_mass, "grad": x.grad}


def fused_head_rows(logits, r):
    x = leaf(logits)
    out = rl_losses.fused_head_loss(x, r["target"], label_weight=1.0, label_divisor=1.0, z_loss_weight=1e-3,
                                    z_loss_divisor=1.0, grpo_weight=0.5, advantages=r["adv"], old_log_probs=r["old"],
                                    grpo_divisor=1.0, distillation_weight=0.3, teacher_logits=_teacher(logits),
                                    distillation_divisor=1.0)
    out.loss.backward()
    return {"log_probs": out.log_probs, "grad": x.grad}


ROW_OPS = {"forward_kl": distillation_rows("forward_kl"), "reverse_kl": distillation_rows("reverse_kl"),
           "jsd": distillation_rows("jsd"), "topk_distillation": topk_rows, "fused_head": fused_head_rows}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", list(ROW_OPS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rows_do_not_depend_on_the_batch(case, op, dtype):
    device, n, vocab = case
    assert_rows_invariant(ROW_OPS[op], make_logits((n,), vocab, dtype, device), row_inputs(n, vocab, device))


def _dpo_rows(logits, target, lengths, pairs, ref):
    """DPO over documents of ``lengths`` (rows in order): per-token log-probs and gradient rows, per-document sums."""
    x = leaf(logits)
    document_index = torch.repeat_interleave(torch.arange(len(lengths), device=logits.device), lengths)
    out = rl_losses.dpo_loss(x, target, document_index, pairs, ref[:, 0], ref[:, 1], beta=0.1, divisor=1.0)
    out.loss.backward()
    return {"log_probs": out.log_probs, "grad": x.grad}, out.document_log_probs


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dpo_pairs_do_not_depend_on_the_batch(case):
    """DPO's unit is the pair of documents: a pair's tokens and sums have the same bits whatever the other pairs,
    their order and the rows before it."""
    device, n, vocab = case
    n_pairs = max(2, n // 16)
    lengths = torch.randint(3, 10, (2 * n_pairs,), device=device)
    logits = make_logits((int(lengths.sum()),), vocab, torch.bfloat16, device)
    target = row_inputs(len(logits), vocab, device)["target"]
    pairs = torch.arange(2 * n_pairs, device=device).view(n_pairs, 2)
    ref = -8 * torch.rand(n_pairs, 2, device=device)
    whole, whole_docs = _dpo_rows(logits, target, lengths, pairs, ref)
    starts = torch.cumsum(lengths, 0) - lengths
    for what, chosen in (("pairs permuted", torch.randperm(n_pairs, device=device)),
                         ("first pair dropped", torch.arange(1, n_pairs, device=device)),
                         ("one pair", torch.tensor([n_pairs // 2], device=device))):
        docs = pairs[chosen].reshape(-1)  # the pairs' documents, each pair's two side by side
        rows = torch.cat([torch.arange(int(starts[d]), int(starts[d] + lengths[d]), device=device) for d in docs])
        part, part_docs = _dpo_rows(logits[rows], target[rows], lengths[docs],
                                    torch.arange(2 * len(chosen), device=device).view(-1, 2), ref[chosen])
        assert_rows_equal(part, whole, rows, what)
        assert_rows_equal({"document_log_probs": part_docs}, {"document_log_probs": whole_docs}, docs, what)


# `row_stats` with tp_blocks in the mode (the tensor-parallel ops' statistics, each vocabulary block a row of its own):
# on CUDA rows of up to 32768 columns one warp each (cuda/warp_stats.cuh; 4003: the partial last vector and an
# aligned copy), wider ones (32776) the row pass's kernel.
STATS_SHAPES = {"cpu": [(37, 1001)], "cuda": [(700, 4000), (300, 16032), (120, 32768), (100, 4003), (80, 32776)]}
STATS_CASES = [(d, n, v) for d in DEVICES for n, v in STATS_SHAPES[d]]


def _row_stats(logits, target, flags):
    stats = torch.ops.rl_losses.row_stats(logits, target, logits_scale_factor=0.8, entropy=flags, smoothing=flags,
                                          tp_blocks=True)
    return stats.reshape(len(logits), len(ROW_STATS))


@pytest.mark.parametrize("flags", [False, True], ids=["plain", "entropy+smoothing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", STATS_CASES, ids=case_id)
def test_row_stats_rows_and_values(case, dtype, flags):
    device, n, vocab = case
    logits, r = make_logits((n,), vocab, dtype, device), row_inputs(n, vocab, device)
    assert_rows_invariant(lambda x, rr: {"stats": _row_stats(x, rr["target"], flags)}, logits, r)
    got, target = _row_stats(logits, r["target"], flags).double(), r["target"]
    x = 0.8 * logits.double()
    m = x.max(dim=-1).values
    e = torch.exp(x - m[:, None])
    label = torch.where(target >= 0, x.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    expected = {"max": (m, m.abs()), "sum_exp": (e.sum(-1), e.sum(-1)), "label_logit": (label, label.abs())}
    if flags:
        expected["sum_exp_x"] = ((e * x).sum(-1), (e * x.abs()).sum(-1))
        expected["sum_x"] = (x.sum(-1), x.abs().sum(-1))
    for column, (value, magnitude) in expected.items():
        i = ROW_STATS.index(column)
        err = (got[:, i] - value).abs().max().item()
        assert err <= 1e-5 * magnitude.max().item() + 1e-30, (column, err)
