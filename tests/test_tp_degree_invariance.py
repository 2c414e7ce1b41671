"""The batch-invariant mode across tensor-parallel degrees (docs/consistency.md, "Tensor parallelism"): a row's
log-prob, entropy, loss terms and gradient (token_log_probs, cross-entropy, GRPO, GSPO, DPO, the fused head,
distillation, from the teacher's logits and from its top-K ids) have the same bits whether its vocabulary is held
by 1, 2 or 4 ranks (rl_losses.batch_invariance.vocab_blocks: blocks the same at every degree, added as one tree).
Four gloo processes on CPU tensors, which form the groups of each degree; RL_LOSSES_DIST_BACKEND=nccl runs them on
CUDA tensors, one GPU per rank (four ranks where four GPUs are present, else two).
"""
import os

import pytest
import torch
import torch.distributed as dist

from helpers_invariance import join_group, run_ranks

BACKEND = os.environ.get("RL_LOSSES_DIST_BACKEND", "gloo")
WORLD = (4 if torch.cuda.device_count() >= 4 else 2) if BACKEND == "nccl" else 4
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not (dist.is_nccl_available() and torch.cuda.device_count() >= 2 if BACKEND == "nccl"
                                    else dist.is_gloo_available()), reason=f"needs {BACKEND} (and 2 GPUs for nccl)")
DEGREES = [d for d in (1, 2, 4) if d <= WORLD]
N, V = 48, 1344  # 8 blocks of 168 columns (not a multiple of 16: vector tails); 4 ranks hold 2 blocks each
BLOCK = V // 8


def _inputs():
    g = torch.Generator().manual_seed(4321)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64).float() * 4
    target = torch.randint(0, V, (N,), generator=g)
    target[5] = -100
    # Labels at the blocks' and the shards' edges.
    target[6:14] = torch.tensor([0, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 4 * BLOCK, V // 2 - 1, V - 1])
    return logits, target, torch.randn(N, generator=g), -3 * torch.rand(N, generator=g)


PAIRS = torch.arange(N // 8).view(-1, 2)
TOPK = 6  # the sparse teacher's ids per row: spread over the whole vocabulary, the blocks' edges included
_g = torch.Generator().manual_seed(99)
# One per row, first: the blocks' edges and the shards' at degrees 2 and 4.
_EDGES = torch.tensor([0, BLOCK - 1, BLOCK, V // 4, V // 2 - 1, V // 2, 3 * V // 4, V - 1]).repeat(N // 8)
_r = torch.rand(N, V, generator=_g).scatter_(1, _EDGES[:, None], 2.0)  # the edge sorts last: not drawn again
TOPK_IDS = torch.cat([_EDGES[:, None], _r.argsort(-1)[:, :TOPK - 1]], dim=1)
TOPK_LOG_PROBS = torch.log_softmax(torch.randn(N, TOPK + 1, generator=_g, dtype=torch.float64), -1)[:, :TOPK].float()
REF_DPO = -torch.arange(1.0, 1.0 + N // 8).view(-1, 2).t()  # the reference's chosen and rejected sums


def _worker(rank: int, store: str, out: str) -> None:
    import rl_losses
    device = join_group(BACKEND, rank, store, WORLD)
    logits, target, advantages, old = (x.to(device) for x in _inputs())
    documents = torch.arange(N, device=device) // 8
    results = {}
    for degree in DEGREES:
        # Every rank creates every group of the degree (new_group's rule), then joins its own.
        groups = [dist.new_group(list(range(g, g + degree))) for g in range(0, WORLD, degree)]
        group, part = groups[rank // degree], rank % degree
        width = V // degree
        shard = logits[:, part * width:(part + 1) * width]
        teacher = (0.5 * shard + torch.cos(shard)).contiguous()  # each column's teacher a function of the column
        columns = torch.arange(part * width, (part + 1) * width, device=device)
        sparse = torch.where((columns < BLOCK) | (columns // BLOCK == 5), teacher, float("-inf"))
        reversed_documents = torch.arange(N, device=device).view(-1, 8).flip(0).reshape(-1)
        for name, rows in (("all", torch.arange(N, device=device)), ("reversed", reversed_documents)):
            x = shard[rows].contiguous().requires_grad_()
            y = shard[rows].contiguous().requires_grad_()
            z = shard[rows].contiguous().requires_grad_()
            u = shard[rows].contiguous().requires_grad_()
            w = shard[rows].contiguous().requires_grad_()
            students = {kind: shard[rows].contiguous().requires_grad_() for kind in ("forward_kl", "jsd", "sparse")}
            v = shard[rows].contiguous().requires_grad_()
            with rl_losses.batch_invariant():
                grpo = rl_losses.grpo_loss(x, target[rows], advantages[rows], old[rows], tp_group=group, divisor=1.0,
                                           compute_entropy=True)
                grpo.loss.backward()
                ce = rl_losses.cross_entropy(y, target[rows], label_smoothing=0.1, reduction="sum", tp_group=group,
                                             logits_scale_factor=0.75)
                ce.backward()
                gspo = rl_losses.gspo_loss(z, target[rows], advantages[rows], old[rows], documents[rows],
                                           tp_group=group, divisor=1.0)
                gspo.loss.backward()
                log_probs, entropy = rl_losses.token_log_probs(shard[rows].contiguous(), target[rows],
                                                               compute_entropy=True, tp_group=group)
                # DPO: documents 2d and 2d + 1 a pair (reordering the documents keeps the pairs).
                dpo = rl_losses.dpo_loss(u, target[rows], documents[rows], PAIRS.to(device), *REF_DPO.to(device),
                                         beta=0.1, divisor=1.0, tp_group=group)
                dpo.loss.backward()
                head = rl_losses.fused_head_loss(w, target[rows], label_weight=1.0, label_divisor=1.0,
                                                 z_loss_weight=1e-3, z_loss_divisor=1.0, grpo_weight=0.5,
                                                 advantages=advantages[rows], old_log_probs=old[rows], grpo_divisor=1.0,
                                                 tp_group=group)
                head.loss.backward()
                distilled = {}
                for kind, student in students.items():
                    # "sparse": a teacher of -inf outside its top columns, whole blocks of it (-inf - -inf is NaN).
                    out_ = rl_losses.distillation_loss(
                        student, sparse[rows] if kind == "sparse" else teacher[rows],
                        kind="forward_kl" if kind == "sparse" else kind, divisor=1.0, temperature=1.5, tp_group=group)
                    out_.loss.backward()
                    distilled[kind] = out_.divergence
                topk = rl_losses.topk_distillation_loss(v, target[rows], TOPK_IDS.to(device)[rows],
                                                        TOPK_LOG_PROBS.to(device)[rows], kind="jsd", beta=0.3,
                                                        tail="tail", divisor=1.0, tp_group=group)
                topk.loss.backward()
            results[degree, name] = tuple(t.detach().cpu() for t in (
                rows, grpo.log_probs, grpo.entropy, x.grad, ce, y.grad, log_probs, entropy, gspo.log_probs, z.grad,
                dpo.log_probs, u.grad, head.log_probs, w.grad, distilled["forward_kl"], students["forward_kl"].grad,
                distilled["jsd"], students["jsd"].grad, distilled["sparse"], students["sparse"].grad, topk.divergence,
                v.grad))
    if BACKEND == "gloo":  # (the host checks are the CPU's; on CUDA a bad label is a device-side assert)
        bad = target.clone()
        bad[3] = V  # on one rank only: the others learn it through the flag in the MAX all-reduce
        try:
            with rl_losses.batch_invariant():
                rl_losses.token_log_probs(shard.contiguous(), bad if rank == 1 else target, tp_group=group)
        except ValueError as e:
            results["error"] = str(e)
        starts = [0, 300, 672, 1000, V]  # uneven shards, which the mode refuses on every rank
        uneven = logits[:, starts[rank]:starts[rank + 1]].contiguous()
        try:
            with rl_losses.batch_invariant():
                rl_losses.distillation_loss(uneven, uneven.cos(), tp_group=dist.group.WORLD)
        except ValueError as e:
            results["uneven"] = str(e)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, WORLD)


def _whole(ranks, degree, name):
    """The first group's results at ``degree``, its gradient shards put side by side (rows in the run's order)."""
    rows, *results = ranks[0][degree, name]
    for i in (2, 4, 8, 10, 12, 14, 16, 18, 20):  # the gradients
        results[i] = torch.cat([ranks[r][degree, name][i + 1] for r in range(degree)], dim=1)
    return rows, results


WHAT = ("grpo log_probs", "grpo entropy", "grpo gradient", "cross_entropy", "cross_entropy gradient",
        "token_log_probs", "token_log_probs entropy", "gspo log_probs", "gspo gradient", "dpo log_probs",
        "dpo gradient", "fused_head log_probs", "fused_head gradient", "forward_kl divergence", "forward_kl gradient",
        "jsd divergence", "jsd gradient", "sparse teacher divergence", "sparse teacher gradient",
        "top-K teacher divergence", "top-K teacher gradient")


@pytest.mark.parametrize("degree", DEGREES[1:])
def test_rows_do_not_depend_on_the_degree(ranks, degree):
    """Every output and gradient row at 2 and 4 ranks has the bits of one rank's (a group of one)."""
    _, one = _whole(ranks, 1, "all")
    _, many = _whole(ranks, degree, "all")
    for a, b, what in zip(one, many, WHAT):
        assert torch.equal(a, b), f"degree {degree}: {what} differs from degree 1's"


@pytest.mark.parametrize("degree", DEGREES)
def test_rows_do_not_depend_on_the_batch(ranks, degree):
    """Reversing the order of the documents (of 8 rows each) leaves each row's bits; every rank of a group holds the
    same log-probs."""
    rows, full = _whole(ranks, degree, "all")
    sub_rows, sub = _whole(ranks, degree, "reversed")
    for a, b, what in zip(full, sub, WHAT):
        if a.dim():  # (the entropy metric and the loss: sums over the rows, in the batch's order)
            assert torch.equal(a[sub_rows], b), f"degree {degree}: {what}"
    for r in range(degree):
        assert torch.equal(ranks[r][degree, "all"][1], full[0])
    assert torch.equal(full[0], full[5]), "token_log_probs differs from grpo_loss's log_probs"


def test_matches_the_float64_reference(ranks):
    from rl_losses import reference
    logits, target, advantages, old = _inputs()
    x = logits.double().requires_grad_()
    ref = reference.grpo_loss(x, target, advantages.double(), old.double(), divisor=1.0, compute_entropy=True)
    ref.loss.backward()
    y = logits.double().requires_grad_()
    ref_ce = reference.cross_entropy(y, target, label_smoothing=0.1, reduction="sum", logits_scale_factor=0.75)
    ref_ce.backward()
    ref_lp, ref_ent = reference.token_log_probs(logits.double(), target, compute_entropy=True)
    z = logits.double().requires_grad_()
    ref_gspo = reference.gspo_loss(z, target, advantages.double(), old.double(), torch.arange(N) // 8, divisor=1.0)
    ref_gspo.loss.backward()
    for degree in DEGREES:
        _, (lp, ent, grad, ce, ce_grad, tlp, tent, glp, ggrad, *_) = _whole(ranks, degree, "all")
        for got, want, what in ((lp, ref.log_probs, "log_probs"), (ent, ref.entropy, "entropy"), (grad, x.grad, "grad"),
                                (ce, ref_ce, "cross_entropy"), (ce_grad, y.grad, "ce grad"), (tlp, ref_lp, "tlp"),
                                (tent, ref_ent, "token entropy"), (glp, ref_gspo.log_probs, "gspo log_probs"),
                                (ggrad, z.grad, "gspo grad")):
            torch.testing.assert_close(got.double(), want.detach(), rtol=2e-5, atol=2e-5,
                                       msg=lambda m: f"degree {degree}, {what}: {m}")


@pytest.mark.skipif(BACKEND != "gloo", reason="the host checks run on CPU tensors")
def test_a_bad_label_fails_every_rank(ranks):
    """In the mode's block path a label out of range is named as the caller gave it (not as a block's row), and the
    other ranks of the group stop too (no hang)."""
    assert ranks[1]["error"] == f"token_log_probs: target holds label {V}, out of range for vocab_size {V}"
    for r in (0, 2, 3):
        assert "another rank of tp_group failed" in ranks[r]["error"]


@pytest.mark.skipif(BACKEND != "gloo", reason="the host checks run on CPU tensors")
def test_distillation_refuses_uneven_shards_in_the_mode(ranks):
    """Each rank would count its blocks from its own width: every rank raises, none waits in a collective."""
    for r in range(WORLD):
        assert ranks[r]["uneven"] == ("distillation_loss: in the batch-invariant mode the vocabulary shards of "
                                      "tp_group must be even (from 300 to 372 columns)")


def test_sparse_teacher_is_finite(ranks):
    """Blocks where the teacher is -inf throughout add nothing (their own sums are NaN)."""
    _, results = _whole(ranks, 1, "all")
    assert torch.isfinite(results[17]).all() and torch.isfinite(results[18]).all()


def test_blocks():
    """The blocks each rank reduces: B (the largest power of two up to 8 leaving blocks of a multiple of 8
    columns) over the degree, 0 where a shard is not whole blocks or the mode is off (the shards' sums then merge
    in rank order)."""
    import rl_losses
    from rl_losses.batch_invariance import vocab_blocks
    assert vocab_blocks(128256, 1) == 0
    with rl_losses.batch_invariant():
        assert [vocab_blocks(128256, d) for d in (1, 2, 4, 8, 3, 16)] == [8, 4, 2, 1, 0, 0]
        assert [vocab_blocks(151936, d) for d in (1, 8, 16)] == [8, 1, 0]
        assert [vocab_blocks(50257, d) for d in (1, 2)] == [1, 0]
        assert [vocab_blocks(96, d) for d in (1, 4, 3)] == [4, 1, 0]  # 96 = 8 * 12: blocks of 24
