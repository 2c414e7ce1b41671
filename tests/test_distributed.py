"""Distributed losses on gloo (docs/distributed.md): vocabulary-parallel (tp_group) cross-entropy, z-loss, GRPO and GSPO,
sequence-data-parallel (sdp_group) GSPO, and both together. Each world size (2, 3 and 4 processes, CPU tensors, gloo
over loopback, a FileStore rendezvous) is spawned once and runs every case of that size; the tests compare each rank's
loss, gradient and metrics with the single-process op on the concatenated input (TP: the same loss and metrics, the
gradient's column block; SDP: rank losses summing to it, the group's metrics, the gradient's row block). A failing
rank surfaces as a test failure with its traceback, and every wait has a timeout.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rl_losses
from rl_losses import distributed as rl_dist

from conftest import assert_close
from helpers import assert_grad_close, gspo_token_shares, label_log_probs64

# CPU tensors over gloo (CI); RL_LOSSES_DIST_BACKEND=nccl runs the same cases on CUDA tensors, one GPU per rank
# (worlds larger than the GPU count are skipped): RL_LOSSES_DIST_BACKEND=nccl python -m pytest tests/test_distributed.py
BACKEND = os.environ.get("RL_LOSSES_DIST_BACKEND", "gloo")
DEVICE = "cuda" if BACKEND == "nccl" else "cpu"
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not (dist.is_nccl_available() if BACKEND == "nccl" else dist.is_gloo_available()),
    reason=f"needs torch.distributed with {BACKEND}")

INIT_TIMEOUT_S = 60  # init_process_group and every collective
WORLD_TIMEOUT_S = 240  # a whole world: start, all its cases, exit
UPSTREAM = 1.3  # the upstream gradient of every backward


# ---- cases ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """One distributed run and its single-process counterpart.

    Token dims `shape` (the SDP split cuts the last one at `seq_cuts`), vocabulary `vocab` (TP shards: even,
    or cut at `vocab_cuts` and passed to rl_losses.distributed as vocab_start/vocab_size). `documents`: the
    segment lengths of each sequence (negative = that many padding tokens); document ids are global.
    `masked_documents`: documents whose labels are all removed.
    """

    op: str  # cross_entropy | z_loss | grpo | gspo
    tp: int = 1
    sdp: int = 1
    shape: tuple = (29,)
    vocab: int = 24
    dtype: torch.dtype = torch.float64
    options: dict = dataclasses.field(default_factory=dict)
    vocab_cuts: tuple | None = None
    seq_cuts: tuple | None = None
    documents: tuple | None = None
    masked_documents: tuple = ()
    give_label_counts: bool = False
    inplace: bool = False
    compile: bool = False
    error: str | tuple | None = None  # expected error (a regex, or one per rank) instead of a result

    @property
    def world(self) -> int:
        return self.tp * self.sdp


DOCS_29 = ((5, 9, 1, 7, -3, 4),)  # ids 0..4 (doc 2 is one token), 3 padding tokens before the last one
DOCS_2x15 = ((6, 5, -4), (3, 12))  # ids 0, 1 | 2, 3
POLICY = dict(epsilon_low=0.2, epsilon_high=0.25)

CASES = {
    # -- world 2: TP=2 --------------------------------------------------------------------------------------
    "tp2_ce": Case("cross_entropy", tp=2, shape=(3, 9), options=dict(logits_scale_factor=0.7)),
    "tp2_ce_smoothing_zloss": Case("cross_entropy", tp=2, options=dict(label_smoothing=0.1, z_loss_factor=1e-3,
                                                                      divisor=5.0)),
    "tp2_ce_none_fp32": Case("cross_entropy", tp=2, dtype=torch.float32, options=dict(reduction="none")),
    "tp2_ce_sum_inplace_fp32": Case("cross_entropy", tp=2, dtype=torch.float32, inplace=True,
                                    options=dict(reduction="sum", label_smoothing=0.2)),
    "tp2_ce_bf16": Case("cross_entropy", tp=2, dtype=torch.bfloat16, vocab=64, options=dict(z_loss_factor=1e-2)),
    "tp2_z_loss": Case("z_loss", tp=2, options=dict(logits_scale_factor=1.5)),
    "tp2_grpo_beta_entropy": Case("grpo", tp=2, options=dict(beta=0.05, compute_entropy=True, delta=1.6,
                                                             **POLICY)),
    "tp2_grpo_weights_fp32": Case("grpo", tp=2, dtype=torch.float32, documents=DOCS_29, give_label_counts=True,
                                  options=dict(divisor=7.0, logits_scale_factor=1.25, loss_weights=True)),
    "tp2_gspo_document": Case("gspo", tp=2, documents=DOCS_29, masked_documents=(3,),
                              options=dict(compute_entropy=True, delta=1.28, **POLICY)),
    "tp2_gspo_token_inplace_fp32": Case("gspo", tp=2, dtype=torch.float32, documents=DOCS_29, inplace=True,
                                        options=dict(weighting="token", num_documents=6)),
    "tp2_ce_uneven": Case("cross_entropy", tp=2, vocab=25, vocab_cuts=(0, 13, 25),
                          options=dict(label_smoothing=0.1, z_loss_factor=1e-3)),
    "tp2_grpo_uneven_width1": Case("grpo", tp=2, vocab=25, vocab_cuts=(0, 1, 25),
                                   options=dict(beta=0.1, compute_entropy=True)),
    "tp2_gspo_uneven": Case("gspo", tp=2, vocab=25, vocab_cuts=(0, 17, 25), documents=DOCS_29,
                            options=dict(compute_entropy=True)),
    # The policy family (docs/policy_losses.md): CISPO, SAPO, rollout correction, entropy bonus, on-policy.
    "tp2_grpo_cispo_rollout": Case("grpo", tp=2, shape=(3, 9), options=dict(loss_type="cispo", epsilon_high=1.1,
                                                                          rollout_correction="token_truncate")),
    "tp2_grpo_sapo_entropy_on_policy": Case("grpo", tp=2, dtype=torch.float32, options=dict(
        loss_type="sapo", entropy_coefficient=0.05, on_policy=True, beta=0.05, kl_estimator="k2")),
    "tp2_grpo_sequence_mask": Case("grpo", tp=2, shape=(3, 9), options=dict(rollout_correction="sequence_mask")),
    "tp2_gspo_sapo_entropy": Case("gspo", tp=2, documents=DOCS_29, options=dict(
        loss_type="sapo", entropy_coefficient=0.04, rollout_correction="sequence_truncate", rollout_cap=1.1)),
    "sdp2_gspo_sapo_rollout_entropy": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), options=dict(
        loss_type="sapo", rollout_correction="token_truncate", rollout_cap=1.15, entropy_coefficient=0.04)),
    "sdp2_gspo_cispo_on_policy_kl": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 14, 29), options=dict(
        loss_type="cispo", epsilon_high=1.1, on_policy=True, beta=0.05, kl_importance_weighted=True,
        rollout_correction="token_mask", rollout_mask_bounds=(0.8, 1.3))),
    # Sequence-level options (a document's ρ_s, VESPO's φ_s, the importance-weighted KL through R_s) over a
    # document split between the ranks: one all-reduce carries their per-document sums.
    "sdp2_gspo_sequence_truncate": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), options=dict(
        rollout_correction="sequence_truncate", rollout_cap=1.2, compute_entropy=True)),
    "sdp2_gspo_sequence_mask_on_policy_token": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 14, 29),
                                                    options=dict(rollout_correction="sequence_mask", on_policy=True,
                                                                 rollout_mask_bounds=(0.4, 2.5), weighting="token")),
    "sdp2_gspo_vespo_token_mask_iw_kl": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), options=dict(
        loss_type="vespo", rollout_correction="token_mask", rollout_mask_bounds=(0.6, 1.6), beta=0.05,
        kl_importance_weighted=True, entropy_coefficient=0.03, vespo_k_pos=1.5, vespo_lambda_neg=1.2)),
    "sdp2_gspo_vespo_sequence_truncate_counts_fp32": Case(
        "gspo", sdp=2, dtype=torch.float32, documents=DOCS_29, seq_cuts=(0, 6, 29), give_label_counts=True,
        options=dict(loss_type="vespo", rollout_correction="sequence_truncate", rollout_cap=1.5, on_policy=True)),
    # GMPO: each token's log-ratio clipped inside its document's geometric mean, over a split document.
    "sdp2_gspo_geo_mean_kl": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), options=dict(
        loss_type="geo_mean", epsilon_low=0.02, epsilon_high=0.03, beta=0.05)),
    "sdp2_gspo_iw_kl_token_weighting": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), options=dict(
        beta=0.1, kl_importance_weighted=True, kl_estimator="k2", weighting="token")),
    "tp2_grpo_vespo_sequence_mask": Case("grpo", tp=2, shape=(3, 9), options=dict(
        loss_type="vespo", rollout_correction="sequence_mask", rollout_mask_bounds=(0.3, 3.0), beta=0.05,
        entropy_coefficient=0.02)),
    "tp2_gspo_vespo_iw_kl": Case("gspo", tp=2, documents=DOCS_29, options=dict(
        loss_type="vespo", beta=0.05, kl_importance_weighted=True, rollout_correction="token_truncate")),
    # -- world 2: SDP=2 -------------------------------------------------------------------------------------
    "sdp2_gspo_document": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), masked_documents=(2,),
                               options=dict(compute_entropy=True, delta=1.28, **POLICY)),
    "sdp2_gspo_token_fp32": Case("gspo", sdp=2, dtype=torch.float32, documents=DOCS_29, seq_cuts=(0, 14, 29),
                                 options=dict(weighting="token", num_documents=7, divisor=3.0)),
    "sdp2_gspo_token_advantages": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 6, 29),
                                       give_label_counts=True, options=dict(token_advantages=True)),
    "sdp2_gspo_batch_inplace": Case("gspo", sdp=2, shape=(2, 15), documents=DOCS_2x15, seq_cuts=(0, 4, 15),
                                    inplace=True, options=dict(compute_entropy=True, logits_scale_factor=0.8)),
    # -- world 2: torch.compile (fullgraph) over the collectives -----------------------------------------------
    "tp2_ce_compiled": Case("cross_entropy", tp=2, compile=True, options=dict(label_smoothing=0.1)),
    "sdp2_gspo_compiled": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29), compile=True,
                               options=dict(num_documents=5, compute_entropy=True)),
    # -- world 2: bad input, reported on every rank (never a hang), and the group still works after it ----------
    # (Label 24 is out of range for rank 1's assumed shard [12, 24): its statistics pass fails, rank 0's not.)
    "tp2_error_uneven_default": Case("cross_entropy", tp=2, vocab=25, vocab_cuts=(0, 13, 25),
                                     options=dict(implicit_shards=True, labels={0: 24}),
                                     error="shards of tp_group are uneven"),
    "tp2_error_half_shard": Case("cross_entropy", tp=2, options=dict(vocab_start=0),
                                 error="pass both vocab_start and vocab_size"),
    "tp2_error_label_range": Case("cross_entropy", tp=2, options=dict(labels={3: 24}), error="out of range"),
    "sdp2_error_label_range": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29),
                                   options=dict(labels={20: 24}),
                                   error=("another rank of sdp_group failed", "out of range")),
    "sdp2_error_document_range": Case("gspo", sdp=2, documents=DOCS_29, seq_cuts=(0, 11, 29),
                                      options=dict(num_documents=3),
                                      error=("another rank of sdp_group failed", "holds 4 but num_documents is 3")),
    # -- world 3: TP=3 and SDP=3 ----------------------------------------------------------------------------
    "tp3_ce": Case("cross_entropy", tp=3, options=dict(label_smoothing=0.05, z_loss_factor=1e-3)),
    "tp3_grpo": Case("grpo", tp=3, dtype=torch.float32, options=dict(beta=0.02, compute_entropy=True, **POLICY)),
    "tp3_gspo_uneven": Case("gspo", tp=3, vocab=20, vocab_cuts=(0, 10, 11, 20), documents=DOCS_29,
                            options=dict(compute_entropy=True)),
    "tp3_z_loss_fp32": Case("z_loss", tp=3, dtype=torch.float32),
    # A rank holding one token, a document over all three ranks, one with no label at all.
    "sdp3_gspo_document": Case("gspo", sdp=3, documents=DOCS_29, seq_cuts=(0, 6, 7, 29), masked_documents=(2,),
                               options=dict(compute_entropy=True, **POLICY)),
    # A rank with padding and masked labels only, and a rank with no token at all.
    "sdp3_gspo_token_fp32": Case("gspo", sdp=3, dtype=torch.float32, documents=DOCS_29, seq_cuts=(0, 22, 29, 29),
                                 masked_documents=(4,), give_label_counts=True, options=dict(weighting="token")),
    # -- world 4: TP=2 x SDP=2 ------------------------------------------------------------------------------
    "tp2xsdp2_error_label_range": Case("gspo", tp=2, sdp=2, documents=DOCS_29, seq_cuts=(0, 12, 29),
                                       options=dict(labels={20: 24}),
                                       error=("another rank of sdp_group",) * 2 + ("out of range",) * 2),
    "tp2xsdp2_gspo_document": Case("gspo", tp=2, sdp=2, documents=DOCS_29, seq_cuts=(0, 12, 29),
                                   masked_documents=(2,), options=dict(compute_entropy=True, **POLICY)),
    "tp2xsdp2_gspo_token_uneven_fp32": Case("gspo", tp=2, sdp=2, dtype=torch.float32, shape=(2, 15), vocab=23,
                                            vocab_cuts=(0, 9, 23), documents=DOCS_2x15, seq_cuts=(0, 9, 15),
                                            options=dict(weighting="token", token_advantages=True)),
    "tp2xsdp2_gspo_geo_mean": Case("gspo", tp=2, sdp=2, documents=DOCS_29, seq_cuts=(0, 12, 29),
                                   options=dict(loss_type="geo_mean", epsilon_low=0.02, epsilon_high=0.03)),
    "tp2xsdp2_gspo_vespo_sequence_mask": Case("gspo", tp=2, sdp=2, documents=DOCS_29, seq_cuts=(0, 12, 29),
                                              options=dict(loss_type="vespo", rollout_correction="sequence_mask",
                                                           rollout_mask_bounds=(0.3, 3.0), compute_entropy=True)),
}


# ---- inputs (identical in every process: seeded by the case name) ------------------------------------------
def _document_index(case: Case) -> torch.Tensor | None:
    if case.documents is None:
        return None
    rows, next_id = [], 0
    for segments in case.documents:
        row = []
        for length in segments:
            if length < 0:
                row += [-1] * -length
            else:
                row += [next_id] * length
                next_id += 1
        rows.append(row)
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.long).reshape(case.shape)


def make_inputs(name: str, case: Case) -> dict:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    shape, vocab = case.shape, case.vocab
    logits = (2.0 * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)).to(case.dtype)
    target = torch.randint(0, vocab, shape, generator=g)
    target = torch.where(torch.rand(shape, generator=g) < 0.3, -100, target)
    doc = _document_index(case)
    if doc is not None:
        for d in case.masked_documents:
            target = torch.where(doc == d, -100, target)
    for position, label in case.options.get("labels", {}).items():
        target = target.clone().view(-1).index_fill_(0, torch.tensor([position]), label).view(shape)
    inputs = dict(logits=logits, target=target)
    if case.op == "z_loss":
        inputs["loss_mask"] = target >= 0
    if case.op in ("grpo", "gspo"):
        in_range = torch.where(target < vocab, target, 0)  # (the bad-label cases)
        lp = label_log_probs64(logits, in_range, case.options.get("logits_scale_factor", 1.0))
        # Old log-probs off by a per-document (per-token for GRPO) offset: ratios on both sides of the clip.
        key = doc.clamp_min(0) if doc is not None and case.op == "gspo" else torch.arange(target.numel()).view(shape)
        offset = 0.3 * torch.randn(int(key.max()) + 1, generator=g, dtype=torch.float64)[key]
        inputs["old_log_probs"] = (lp - offset + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).float()
        inputs["advantages"] = torch.randn(shape, generator=g)
        if case.options.get("beta"):
            inputs["ref_log_probs"] = (lp + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)).float()
        if case.options.get("rollout_correction"):
            base = lp if case.options.get("on_policy") else inputs["old_log_probs"].double()
            inputs["rollout_log_probs"] = (base + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)).float()
        if case.options.get("loss_weights"):
            inputs["loss_weights"] = torch.rand(shape, generator=g) + 0.5
    if doc is not None:
        inputs["document_index"] = doc
        if case.give_label_counts:
            labelled = ((target >= 0) & (doc >= 0)).double().view(-1)
            per_doc = torch.zeros(int(doc.max()) + 1, dtype=torch.float64).index_add_(0, doc.clamp_min(0).view(-1),
                                                                                      labelled)
            inputs["label_counts"] = per_doc[doc.clamp_min(0)].float()
    return inputs


_OPTIONS_NOT_FOR_THE_OP = ("loss_weights", "labels", "implicit_shards", "vocab_start", "on_policy")


def call_loss(case: Case, inputs: dict, logits: torch.Tensor, **group_kwargs):
    """The op through its public wrapper (rl_losses.distributed directly for explicit vocabulary shards).
    Returns (differentiable loss, dict of detached metrics)."""
    options = {k: v for k, v in case.options.items() if k not in _OPTIONS_NOT_FOR_THE_OP}
    for name in ("loss_weights", "ref_log_probs", "label_counts", "rollout_log_probs"):
        if name in inputs:
            options[name] = inputs[name]
    shards = {k: group_kwargs.pop(k) for k in ("vocab_start", "vocab_size") if k in group_kwargs}
    if case.inplace:
        options["inplace_backward"] = True
    target = inputs["target"]
    if case.op in ("cross_entropy", "z_loss"):
        if case.op == "z_loss":
            options.update(z_loss_factor=1.0, label_weight=0.0)
            if not shards:
                loss = rl_losses.z_loss(logits, loss_mask=inputs["loss_mask"], **{
                    k: v for k, v in options.items() if k not in ("z_loss_factor", "label_weight")}, **group_kwargs)
                return loss, {}
            target = torch.where(inputs["loss_mask"], 0, -1)
        fn = rl_dist.cross_entropy if shards else rl_losses.cross_entropy
        return fn(logits, target, **options, **group_kwargs, **shards), {}
    args = [logits, target, inputs["advantages"], None if case.options.get("on_policy") else inputs["old_log_probs"]]
    if case.op == "grpo":
        fn = rl_dist.grpo_loss if shards else rl_losses.grpo_loss
    else:
        fn = rl_dist.gspo_loss if shards else rl_losses.gspo_loss
        args.append(inputs["document_index"])
    out = fn(*args, **options, **group_kwargs, **shards)
    metrics = {k: v for k, v in out._asdict().items() if k not in ("loss", "loss_type") and v is not None}
    return out.loss, metrics


def run_loss(case: Case, inputs: dict, logits: torch.Tensor, **group_kwargs) -> dict:
    """Forward and backward (upstream UPSTREAM) on a copy of `logits`; loss, gradient and metrics."""
    leaf = logits.detach().clone().requires_grad_()
    x = leaf.clone() if case.inplace else leaf  # inplace_backward may overwrite a non-leaf only
    fn = call_loss
    if case.compile:
        torch._dynamo.reset()
        fn = torch.compile(lambda c, i, t, **kw: call_loss(c, i, t, **kw), fullgraph=True, backend="aot_eager",
                           dynamic=False)
    loss, metrics = fn(case, inputs, x, **group_kwargs)
    loss.backward(torch.full_like(loss, UPSTREAM))
    if case.inplace:  # the gradient was written into the logits' own storage
        assert torch.equal(x.detach(), leaf.grad), "inplace_backward: the logits do not hold the gradient"
    return dict(loss=loss.detach(), grad=leaf.grad, **metrics)


# ---- the worker (one process of a world) -------------------------------------------------------------------
def _local(case: Case, inputs: dict, tp_rank: int, sdp_rank: int) -> tuple[dict, slice, slice]:
    """This rank's part of the inputs: its tokens (the last token dim cut at seq_cuts) and vocabulary shard."""
    seq = case.shape[-1]
    cuts = case.seq_cuts or (0, seq)
    rows = slice(cuts[sdp_rank], cuts[sdp_rank + 1]) if case.sdp > 1 else slice(0, seq)
    vcuts = case.vocab_cuts or tuple(range(0, case.vocab + 1, case.vocab // case.tp))
    cols = slice(vcuts[tp_rank], vcuts[tp_rank + 1]) if case.tp > 1 else slice(0, case.vocab)
    local = {k: v[..., rows].contiguous().to(DEVICE) for k, v in inputs.items() if k != "logits"}
    local["logits"] = inputs["logits"][..., rows, cols].contiguous().to(DEVICE)
    return local, rows, cols


def _groups(world: int, layouts: list) -> dict:
    """(tp_group, sdp_group) per (tp, sdp) layout; rank = sdp_rank·tp + tp_rank. Every rank creates every
    group, in the same order (new_group is collective)."""
    groups = {}
    for tp, sdp in layouts:
        if tp == world:
            groups[tp, sdp] = (dist.group.WORLD, None)
        elif sdp == world:
            groups[tp, sdp] = (None, dist.group.WORLD)
        else:
            rank = dist.get_rank()
            tp_group = sdp_group = None
            for s in range(sdp):
                g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
                tp_group = g if rank // tp == s else tp_group
            for t in range(tp):
                g = dist.new_group(list(range(t, world, tp)))
                sdp_group = g if rank % tp == t else sdp_group
            groups[tp, sdp] = (tp_group, sdp_group)
    return groups


def _worker(rank: int, world: int, workdir: str, names: list) -> None:
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections on the loopback interface only
        torch.set_num_threads(1)
        if DEVICE == "cuda":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            os.environ["RL_LOSSES_CHECK_INPUTS"] = "1"  # the host-side checks that the bad-input cases expect
            torch.cuda.set_device(rank)
        dist.init_process_group(BACKEND, init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
        cases = {name: CASES[name] for name in names}
        groups = _groups(world, sorted({(c.tp, c.sdp) for c in cases.values()}))
        results = {}
        for name, case in cases.items():
            tp_group, sdp_group = groups[case.tp, case.sdp]
            tp_rank, sdp_rank = rank % case.tp, rank // case.tp
            local, _, _ = _local(case, make_inputs(name, case), tp_rank, sdp_rank)
            group_kwargs = {}
            if case.tp > 1:
                group_kwargs["tp_group"] = tp_group
                if case.vocab_cuts and not case.options.get("implicit_shards"):
                    group_kwargs.update(vocab_start=case.vocab_cuts[tp_rank], vocab_size=case.vocab)
            if case.sdp > 1:
                group_kwargs["sdp_group"] = sdp_group
            if "vocab_start" in case.options:
                group_kwargs["vocab_start"] = case.options["vocab_start"]
            if case.error:
                try:
                    run_loss(case, local, local["logits"], **group_kwargs)
                    results[name] = dict(error=None)
                except (ValueError, RuntimeError) as e:
                    results[name] = dict(error=f"{type(e).__name__}: {e}")
                continue
            results[name] = {k: v.cpu() for k, v in run_loss(case, local, local["logits"], **group_kwargs).items()}
        torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(workdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def _run_world(world: int, names: list) -> list:
    """Spawns `world` gloo processes running the cases `names`; their results by rank. Any failing or stuck
    rank fails the run with its traceback, after the others were terminated."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rl_losses_dist_") as workdir:
        procs = [ctx.Process(target=_worker, args=(rank, world, workdir, names), daemon=True)
                 for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + WORLD_TIMEOUT_S
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)
        errors = []
        for rank, p in enumerate(procs):
            path = os.path.join(workdir, f"rank{rank}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"rank {rank}:\n{f.read()}")
            elif p.exitcode != 0:
                errors.append(f"rank {rank}: exit code {p.exitcode}")
        if errors or time.monotonic() > deadline:
            timed_out = f"timed out after {WORLD_TIMEOUT_S} s\n" if time.monotonic() > deadline else ""
            raise RuntimeError(f"world of {world} failed: {timed_out}" + "\n".join(errors))
        return [torch.load(os.path.join(workdir, f"rank{rank}.pt")) for rank in range(world)]


_WORLDS: dict = {}


def world_results(world: int) -> list:
    """Every case of this world size, run once per test session (the first test that needs it)."""
    if DEVICE == "cuda" and world > torch.cuda.device_count():
        pytest.skip(f"a world of {world} needs {world} GPUs, {torch.cuda.device_count()} found")
    if world not in _WORLDS:
        names = [name for name, case in CASES.items() if case.world == world]
        try:
            _WORLDS[world] = _run_world(world, names)
        except RuntimeError as e:
            _WORLDS[world] = e
    if isinstance(_WORLDS[world], Exception):
        pytest.fail(str(_WORLDS[world]), pytrace=False)
    return _WORLDS[world]


# ---- the single-process expectation -----------------------------------------------------------------------
def _tolerance_scale(case: Case) -> float:
    # Sums over ranks round differently from the single pass: a few ulps more in low precision.
    return 4.0 if case.dtype in (torch.bfloat16, torch.float16) else 2.0


# ---- the tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.error is None])
def test_matches_single_process(name):
    case = CASES[name]
    results = world_results(case.world)
    inputs = make_inputs(name, case)
    on_device = {k: v.to(DEVICE) for k, v in inputs.items()}
    expected = {k: v.cpu() for k, v in run_loss(dataclasses.replace(case, compile=False), on_device,
                                                on_device["logits"]).items()}
    dtype, scale = case.dtype, _tolerance_scale(case)
    shares = gspo_token_shares(case, inputs, expected) if case.sdp > 1 else None
    losses = {}
    for rank, per_case in enumerate(results):
        got = per_case[name]
        tp_rank, sdp_rank = rank % case.tp, rank // case.tp
        _, rows, cols = _local(case, inputs, tp_rank, sdp_rank)
        where = f"{name}, rank {rank} (tp {tp_rank}, sdp {sdp_rank})"
        # Gradient: this rank's block of the single-process gradient.
        natural = case.options.get("logits_scale_factor", 1.0) * UPSTREAM
        assert_grad_close(got["grad"], expected["grad"][..., rows, cols], dtype, scale=scale,
                          natural_scale=natural / max(int((inputs["target"] >= 0).sum()), 1))
        if case.sdp == 1:
            assert_close(got["loss"], expected["loss"], dtype, scale=scale, msg=f"loss, {where}")
        else:
            losses.setdefault(tp_rank, []).append(got["loss"])
            assert_close(got["loss"], shares[..., rows].sum(), dtype, scale=scale, msg=f"loss share, {where}")
        for metric, value in expected.items():
            if metric in ("loss", "grad"):
                continue
            assert metric in got, f"{where}: metric {metric} missing"
            want = value[..., rows] if metric == "log_probs" else value
            assert_close(got[metric], want, dtype, scale=scale, msg=f"{metric}, {where}")
    for tp_rank, per_rank in losses.items():
        assert_close(torch.stack(per_rank).sum(), expected["loss"], case.dtype, scale=scale,
                     msg=f"{name}: sum of the SDP rank losses (tp rank {tp_rank})")


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.error is not None])
def test_bad_input_is_reported_on_every_rank(name):
    case = CASES[name]
    for rank, per_case in enumerate(world_results(case.world)):
        error = per_case[name]["error"]
        assert error is not None, f"{name}: rank {rank} raised nothing"
        pattern = case.error if isinstance(case.error, str) else case.error[rank]
        assert re.search(pattern, error), f"{name}, rank {rank}: {error}"


def test_tp_needs_no_gradient_through_the_statistics():
    """The all-reduced statistics are an input without gradient: the gradient comes from the op alone."""
    logits = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, 3, -100, 7, 0])
    stats = torch.ops.rl_losses.row_stats(logits.detach(), target).reshape(-1, 5)
    assert not stats.requires_grad
    loss, _ = torch.ops.rl_losses.cross_entropy(logits, target, row_stats=stats)
    loss.backward()
    expected = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100), logits)[0]
    torch.testing.assert_close(logits.grad, expected)


def test_vocab_shard_arguments_need_a_tp_group():
    logits, target = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="tp_group is None"):
        rl_dist.cross_entropy(logits, target, tp_group=None, vocab_start=0, vocab_size=6)
