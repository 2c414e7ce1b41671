"""The loss step on a GPU without the host: no synchronisation, a CUDA graph, a fixed few launches (CUDA only).

A call whose sizes are known on the host (a `divisor` given, `num_documents` with `document_index`, DPO's pairs
on the device) must not wait for the device: a training step then runs ahead of the GPU, and the whole loss step,
forward and backward, can be captured in a `torch.cuda.CUDAGraph` and replayed. Three checks:
- under `torch.cuda.set_sync_debug_mode("error")`, fwd+bwd of each op with static-size arguments raises no
  synchronisation;
- the step captured in a graph and replayed on fresh values copied into the captured tensors agrees with an
  eager call on those values and with the float64 reference (a capture that failed, or a replay that reused the
  first inputs, fails);
- the kernels of one fwd+bwd call, counted by the profiler, are the fixed few listed in KERNELS.
On sm_90 every kernel of the library is a programmatic dependent launch (csrc/common/dependent_launch.cuh);
under stream capture those launches become programmatic edges of the graph.
"""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import rl_losses
from rl_losses import reference
from conftest import assert_close
from helpers import (assert_grad_close, cuda_kernels, make_logits, op_loss, op_reference, policy_inputs,
                     requires_cuda)

DOCS = 8
H = 128  # hidden size of the fused lm_head cases


def _inputs(n, v, dtype, hidden=False):
    """Fresh inputs of every case on the GPU: logits (or hidden states and a weight), labels with some
    unlabelled, advantages, old/ref/rollout log-probs near the current ones, DOCS documents."""
    if hidden:
        h = torch.randn(n, H, device="cuda", dtype=dtype)
        w = (torch.randn(v, H, device="cuda", dtype=dtype) * H ** -0.5).to(dtype)
        logits = (h.double() @ w.double().T).to(dtype)
        main = {"hidden": h, "weight": w}
    else:
        logits = make_logits((n,), v, dtype, "cuda")
        main = {"logits": logits}
    target, adv, old, doc = policy_inputs(logits, DOCS)
    ref = old + 0.05 * torch.randn_like(old)
    rollout = old + 0.1 * torch.randn_like(old)
    # DPO: the DOCS documents as DOCS / 2 pairs (on the device: checked there, without a synchronisation).
    pairs = torch.arange(DOCS, device="cuda").view(-1, 2).flip(0)
    ref_pairs = torch.randn(2, DOCS // 2, device="cuda") - 20
    return {**main, "target": target, "adv": adv, "old": old, "ref": ref, "rollout": rollout, "doc": doc,
            "pairs": pairs, "ref_chosen": ref_pairs[0], "ref_rejected": ref_pairs[1]}


@dataclass
class Case:
    """`ours(x..., d)` and `ref(x..., d)` give the loss of the differentiable inputs `xs` ("logits", or "hidden"
    and "weight") with the other inputs `d`; `ref` gets float64 tensors and rl_losses.reference."""
    name: str
    ours: Callable
    ref: Callable
    hidden: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def xs(self):
        return ("hidden", "weight") if self.hidden else ("logits",)


def _grpo(options):
    def ours(x, d):
        return rl_losses.grpo_loss(x, d["target"], d["adv"], d["old"], divisor=150.0, **_policy(options, d)).loss

    def ref(x, d):
        return reference.grpo_loss(x, d["target"], d["adv"], d["old"], divisor=150.0, **_policy(options, d)).loss

    return ours, ref


def _policy(options, d):
    """Options that name an input ("ref", "rollout", "doc") get that tensor of `d`."""
    out = dict(options)
    if out.pop("with_ref", False):
        out["ref_log_probs"] = d["ref"]
    if out.pop("with_rollout", False):
        out["rollout_log_probs"] = d["rollout"]
    if out.pop("with_doc", False):
        out["document_index"] = d["doc"]
    return out


def _grpo_documents(options):
    """grpo_loss over the DOCS documents, their count given (ours; the reference needs none)."""
    _, ref = _grpo({**options, "with_doc": True})
    return (lambda x, d: rl_losses.grpo_loss(x, d["target"], d["adv"], d["old"], divisor=150.0, num_documents=DOCS,
                                             **_policy({**options, "with_doc": True}, d)).loss), ref


def _gspo(mod, x, d):
    return mod.gspo_loss(x, d["target"], d["adv"], d["old"], d["doc"], num_documents=DOCS, divisor=float(DOCS)).loss


def _dpo(mod, x, d):
    return mod.dpo_loss(x, d["target"], d["doc"], d["pairs"], d["ref_chosen"], d["ref_rejected"], beta=0.1).loss


def _linear_ref(h, w, d):
    return h @ w.T


def _linear_options(mode):
    """3 chunks of rows (lean: vocabulary blocks of as many logits), every row computed: counting the labelled
    rows (skip_unlabelled=True) would read a number on the host."""
    return dict(strategy=mode, chunk_size=96, skip_unlabelled=False)


CASES = [
    Case("ce", lambda x, d: rl_losses.cross_entropy(x, d["target"], divisor=150.0),
         lambda x, d: reference.cross_entropy(x, d["target"], divisor=150.0)),
    Case("ce_smoothing_zloss",
         lambda x, d: rl_losses.cross_entropy(x, d["target"], label_smoothing=0.1, z_loss_factor=1e-3, divisor=150.0),
         lambda x, d: reference.cross_entropy(x, d["target"], label_smoothing=0.1, z_loss_factor=1e-3, divisor=150.0)),
    Case("ce_sum", lambda x, d: rl_losses.cross_entropy(x, d["target"], reduction="sum"),
         lambda x, d: reference.cross_entropy(x, d["target"], reduction="sum")),
    Case("z_loss", lambda x, d: rl_losses.z_loss(x, loss_mask=d["target"] >= 0, divisor=150.0),
         lambda x, d: reference.z_loss(x, loss_mask=d["target"] >= 0, divisor=150.0)),
    Case("grpo", *_grpo({})),
    Case("grpo_kl", *_grpo({"with_ref": True, "beta": 0.04})),
    Case("grpo_cispo", *_grpo({"loss_type": "cispo", "epsilon_high": 4.0})),
    Case("grpo_sapo_entropy", *_grpo({"loss_type": "sapo", "entropy_coefficient": 0.01})),
    Case("grpo_token_truncate", *_grpo({"with_rollout": True, "rollout_correction": "token_truncate"})),
    Case("grpo_sequence_truncate", *_grpo_documents({"with_rollout": True, "rollout_correction": "sequence_truncate"})),
    Case("grpo_vespo", *_grpo_documents({"loss_type": "vespo"})),
    # clip_cov and kl_cov: their subsets' sizes and ranks stay on the device. clip_cov takes every candidate here
    # (k >= N), so that the replays' fresh draws and the reference's agree.
    Case("grpo_kl_cov", *_grpo({"loss_type": "kl_cov", "kl_cov_ratio": 0.05})),
    Case("grpo_clip_cov", *_grpo({"loss_type": "clip_cov", "clip_cov_ratio": 1.0, "clip_cov_lb": -1e3,
                                  "clip_cov_ub": 1e3})),
    Case("gspo", lambda x, d: _gspo(rl_losses, x, d), lambda x, d: _gspo(reference, x, d)),
    Case("dpo", lambda x, d: _dpo(rl_losses, x, d), lambda x, d: _dpo(reference, x, d)),
    *(Case(f"linear_ce_{mode}",
           lambda h, w, d, mode=mode: rl_losses.linear_cross_entropy(h, w, d["target"], divisor=150.0,
                                                                     **_linear_options(mode)),
           lambda h, w, d: reference.cross_entropy(_linear_ref(h, w, d), d["target"], divisor=150.0),
           hidden=True, dtype=torch.float32) for mode in ("fast", "lean")),
    *(Case(f"linear_grpo_{mode}",
           lambda h, w, d, mode=mode: rl_losses.linear_grpo_loss(h, w, d["target"], d["adv"], d["old"], divisor=150.0,
                                                                 **_linear_options(mode)).loss,
           lambda h, w, d: reference.grpo_loss(_linear_ref(h, w, d), d["target"], d["adv"], d["old"],
                                               divisor=150.0).loss,
           hidden=True, dtype=torch.float32) for mode in ("fast", "lean")),
    # kl_cov's few rows revisited by the fused lm_head (csrc/linear/linear_source.h, RowRevisit): after 3 chunks
    # (fast), between lean mode's sweeps, and in one chunk of every row.
    *(Case(f"linear_grpo_kl_cov_{layout}",
           lambda h, w, d, options=options: rl_losses.linear_grpo_loss(
               h, w, d["target"], d["adv"], d["old"], divisor=150.0, loss_type="kl_cov", kl_cov_ratio=0.05,
               **options).loss,
           lambda h, w, d: reference.grpo_loss(_linear_ref(h, w, d), d["target"], d["adv"], d["old"], divisor=150.0,
                                               loss_type="kl_cov", kl_cov_ratio=0.05).loss,
           hidden=True, dtype=torch.float32)
      for layout, options in (("fast", _linear_options("fast")), ("lean", _linear_options("lean")),
                              ("one_chunk", dict(skip_unlabelled=False)))),
    Case("linear_gspo",
         lambda h, w, d: rl_losses.linear_gspo_loss(h, w, d["target"], d["adv"], d["old"], d["doc"],
                                                    num_documents=DOCS, divisor=float(DOCS),
                                                    **_linear_options("fast")).loss,
         lambda h, w, d: _gspo(reference, _linear_ref(h, w, d), d), hidden=True, dtype=torch.float32),
    # The default skip_unlabelled (None) counts no rows at N·V·H = 256 · 4096 · 128 = 2^27, below
    # kCountLabelledMinMacs (csrc/linear/linear_source.h), nor under a capture: one chunk of every row.
    Case("linear_ce_default", lambda h, w, d: rl_losses.linear_cross_entropy(h, w, d["target"], divisor=150.0),
         lambda h, w, d: reference.cross_entropy(_linear_ref(h, w, d), d["target"], divisor=150.0),
         hidden=True, dtype=torch.float32),
    Case("linear_grpo_default",
         lambda h, w, d: rl_losses.linear_grpo_loss(h, w, d["target"], d["adv"], d["old"], divisor=150.0).loss,
         lambda h, w, d: reference.grpo_loss(_linear_ref(h, w, d), d["target"], d["adv"], d["old"],
                                             divisor=150.0).loss,
         hidden=True, dtype=torch.float32),
]
N, V = 256, 4096  # one round of the cluster kernel (bf16 rows of 8 KB: one CTA each); 3 chunks for linear_*


def _step(case, leaves, d):
    """fwd+bwd as a training step runs it: the loss, then the gradients of the differentiable inputs."""
    loss = case.ours(*leaves, d)
    return (loss, *torch.autograd.grad(loss, leaves))


def _split(case, inputs):
    leaves = [inputs[k].clone().requires_grad_() for k in case.xs]
    return leaves, {k: v for k, v in inputs.items() if k not in case.xs}


@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_static_size_call_does_not_synchronise(case, monkeypatch):
    monkeypatch.delenv("RL_LOSSES_CHECK_INPUTS", raising=False)  # the opt-in host checks synchronise by design
    leaves, d = _split(case, _inputs(N, V, case.dtype, case.hidden))
    _step(case, leaves, d)  # first call: one-time work (occupancy queries, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(case, leaves, d)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_cov_subsets_do_not_synchronise(name, monkeypatch):
    """clip_cov's and kl_cov's subsets as they run (k a few of many candidates; the CASES' clip_cov takes them all),
    in grpo, policy_token_loss and linear_grpo, fwd+bwd: verl's own functions read their counts on the host."""
    monkeypatch.delenv("RL_LOSSES_CHECK_INPUTS", raising=False)
    d = _inputs(N, V, torch.bfloat16)
    x = d["logits"].clone().requires_grad_()
    y = (d["old"] + 0.1 * torch.randn_like(d["old"])).requires_grad_()
    options = dict(loss_type=name, clip_cov_ratio=0.05, clip_cov_lb=-1e3, clip_cov_ub=1e3, kl_cov_ratio=0.05)

    e = _inputs(N, V, torch.bfloat16, hidden=True)  # linear_grpo, its selected rows revisited after 3 chunks
    h, w = e["hidden"].clone().requires_grad_(), e["weight"].clone().requires_grad_()

    def step():
        loss = rl_losses.grpo_loss(x, d["target"], d["adv"], d["old"], divisor=150.0, **options).loss
        per_token = rl_losses.policy_token_loss(y, d["old"], d["adv"], loss_mask=d["target"] >= 0, **options).loss
        linear = rl_losses.linear_grpo_loss(h, w, e["target"], e["adv"], e["old"], divisor=150.0,
                                            **_linear_options("fast"), **options).loss
        return torch.autograd.grad(loss + per_token.sum() + linear, (x, y, h, w))

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_captured_step_replays_like_eager_and_reference(case):
    static = _inputs(N, V, case.dtype, case.hidden)
    leaves, d = _split(case, static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            _step(case, leaves, d)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(case, leaves, d)

    for _ in range(2):
        fresh = _inputs(N, V, case.dtype, case.hidden)
        with torch.no_grad():
            for leaf, k in zip(leaves, case.xs):
                leaf.copy_(fresh[k])
            for k, t in d.items():
                t.copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        eager = _step(case, *_split(case, fresh))
        x64 = [fresh[k].double().requires_grad_() for k in case.xs]
        d64 = {k: t.double() if t.is_floating_point() else t for k, t in fresh.items() if k not in case.xs}
        ref_loss = case.ref(*x64, d64)
        ref_grads = torch.autograd.grad(ref_loss, x64)
        assert_close(captured[0], eager[0], case.dtype)
        assert_close(captured[0], ref_loss.detach(), case.dtype)
        for got, same, want in zip(captured[1:], eager[1:], ref_grads):
            assert_grad_close(got, same.double(), case.dtype)
            assert_grad_close(got, want, case.dtype)


# Default arguments (the divisor counted on the device, GSPO's documents given): 256 rows, one round of the
# cluster kernel; 1200 rows of 16384, a main and a tail launch on an H100/H200 (test_cuda_launch.py).
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "gspo"])
@pytest.mark.parametrize("n, v", [(256, 4096), (1200, 16384)], ids=["256x4096", "1200x16384"])
def test_default_arguments_replay_matches_reference(op, dtype, n, v):
    def fresh():
        logits = make_logits((n,), v, dtype, "cuda")
        return (logits, *policy_inputs(logits, DOCS))

    logits, target, adv, old, doc = fresh()
    x = logits.clone().requires_grad_()

    def step():
        loss = op_loss(op, x, target, adv, old, doc, DOCS)
        (grad,) = torch.autograd.grad(loss, x)
        return loss, grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, grad = step()

    for _ in range(3):
        new = fresh()
        with torch.no_grad():
            for buf, value in zip((x, target, adv, old, doc), new):
                buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        ref_loss, ref_grad = op_reference(op, x, target, adv, old, doc, DOCS)
        assert_close(loss.double(), ref_loss, dtype)
        assert_grad_close(grad, ref_grad, dtype)


# The kernels of one fwd+bwd call at N x V = 256 x 4096 bf16, one round of the cluster
# kernel, on sm_90. Every call has the row pass, the scaling of the saved gradient by the upstream gradient
# (`scale_rows_kernel`, which returns at once when it is 1) and the fill of that upstream gradient by autograd
# (`torch.ones_like(loss)` in `loss.backward()` or `torch.autograd.grad`); then per op:
#   ce (divisor given): + the loss sum                                                           = 4
#   ce (default token mean): + the labelled count                                                = 5
#   grpo (divisor given or not): + the labelled count (with the given divisor written by the same
#     launch), the metrics reduction                                                             = 5
#   gspo (num_documents and divisor given): the statistics pass, the gradient pass and between them one chain
#     of steps (the per-token terms, their sums per document, the document step, the totals, the token step,
#     the metrics: one single-block launch at this N, CudaRunner::chain)                            = 3 + 2 = 5
# A row count that leaves the cluster kernel's last round part-empty adds its tail launch (one more).
KERNELS = {
    "ce": (4, lambda x, d: rl_losses.cross_entropy(x, d["target"], divisor=150.0)),
    "ce_default": (5, lambda x, d: rl_losses.cross_entropy(x, d["target"])),
    "grpo": (5, lambda x, d: rl_losses.grpo_loss(x, d["target"], d["adv"], d["old"], divisor=150.0).loss),
    "grpo_default": (5, lambda x, d: rl_losses.grpo_loss(x, d["target"], d["adv"], d["old"]).loss),
    "gspo": (5, lambda x, d: _gspo(rl_losses, x, d)),
}


@requires_cuda
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_per_call(name):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the counts are those of sm_90, where the fused row pass is one cluster-kernel launch")
    expected, fn = KERNELS[name]
    inputs = _inputs(N, V, torch.bfloat16)
    x = inputs.pop("logits").requires_grad_()

    def call():  # autograd.grad: no AccumulateGrad, which may copy a gradient it cannot take over
        torch.autograd.grad(fn(x, inputs), x)

    kernels = cuda_kernels(call)
    assert len(kernels) == expected, "\n".join(kernels)
