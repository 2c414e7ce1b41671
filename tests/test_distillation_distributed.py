"""Vocabulary-parallel distillation on gloo: 2 processes (CPU tensors, FileStore rendezvous) each hold a column
shard of the student's and the teacher's logits; every rank's loss must equal the single-process loss on the
whole vocabulary and its gradient the single-process gradient's column block, for every kind. The same for the
sparse teacher (topk_distillation_loss: the teacher's top-K ids spread over both shards), also against the float64
reference."""
import pytest
import torch
import torch.distributed as dist

import rl_losses

from rl_losses import reference_topk

from conftest import assert_close
from helpers import assert_grad_close, gloo_world_results

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
CASES = {  # name: (kind, options, student dtype, vocabulary, column cut)
    "forward_kl": ("forward_kl", dict(temperature=1.5), torch.float64, 24, 12),
    "reverse_kl_uneven_values": ("reverse_kl", dict(logits_scale_factor=0.7), torch.float64, 24, 12),
    "cross_entropy_fp32": ("cross_entropy", dict(), torch.float32, 30, 15),
    "jsd_masked": ("jsd", dict(beta=0.3, mask=True), torch.float64, 26, 13),
    "jsd_divisor_fp32": ("jsd", dict(beta=0.7, divisor=4.0), torch.float32, 32, 16),
}


def _inputs(name):
    kind, options, dtype, vocab, _ = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 7919 + vocab)
    logits = (torch.randn(3, 5, vocab, generator=g) * 2).to(dtype)
    teacher = logits.double() + torch.randn(3, 5, vocab, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3 if options.get("mask") else None
    kwargs = {k: v for k, v in options.items() if k != "mask"}
    return logits, teacher, mask, dict(kind=kind, loss_mask=mask, **kwargs)


def _run(logits, teacher, kwargs, tp_group=None):
    x = logits.clone().requires_grad_()
    out = rl_losses.distillation_loss(x, teacher, tp_group=tp_group, **kwargs)
    (out.loss * 1.3).backward()
    return {"loss": out.loss.detach(), "divergence": out.divergence, "grad": x.grad}


TOPK_CASES = {  # name: (options, student dtype, vocabulary, column cut, K)
    "topk_forward_kl_none": (dict(kind="forward_kl"), torch.float64, 24, 12, 5),
    "topk_reverse_kl_tail_scaled": (dict(kind="reverse_kl", tail="tail", logits_scale_factor=0.7), torch.float64,
                                    26, 13, 6),
    "topk_jsd_renormalize": (dict(kind="jsd", beta=0.3, tail="renormalize"), torch.float64, 24, 12, 4),
    "topk_forward_kl_tail_fp32": (dict(kind="forward_kl", tail="tail", divisor=5.0), torch.float32, 32, 16, 8),
    "topk_reverse_kl_bf16": (dict(kind="reverse_kl", tail="renormalize"), torch.bfloat16, 32, 16, 6),
    "topk_jsd_fp16": (dict(kind="jsd", beta=0.5, tail="tail"), torch.float16, 24, 12, 4),  # pre-scaled gradient rows
}


def _topk_inputs(name):
    options, dtype, vocab, _, k = TOPK_CASES[name]
    g = torch.Generator().manual_seed(len(name) * 104729 + vocab)
    logits = (torch.randn(3, 5, vocab, generator=g) * 2).to(dtype)
    target = torch.randint(0, vocab, (3, 5), generator=g)
    target[torch.rand(3, 5, generator=g) < 0.25] = -100
    ids = torch.rand(3, 5, vocab, generator=g).argsort(-1)[..., :k]  # distinct ids, over both shards
    teacher = torch.log_softmax(logits.double() + torch.randn(3, 5, vocab, generator=g, dtype=torch.float64), -1)
    return logits, target, ids, teacher.gather(-1, ids), options


def _run_topk(logits, target, ids, lp, options, fn=rl_losses.topk_distillation_loss, **group):
    x = logits.clone().requires_grad_()
    out = fn(x, target, ids, lp, **options, **group)
    (out.loss * 1.3).backward()
    return {"loss": out.loss.detach(), "divergence": out.divergence, "student_mass": out.student_mass,
            "teacher_mass": out.teacher_mass, "grad": x.grad}


def _rank_results(rank):
    results = {}
    for name, (_, _, _, vocab, cut) in CASES.items():
        logits, teacher, _, kwargs = _inputs(name)
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        results[name] = _run(logits[..., cols].contiguous(), teacher[..., cols].contiguous(), kwargs,
                             tp_group=dist.group.WORLD)
    for name, (_, _, vocab, cut, _) in TOPK_CASES.items():
        logits, target, ids, lp, options = _topk_inputs(name)
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        results[name] = _run_topk(logits[..., cols].contiguous(), target, ids, lp, options, tp_group=dist.group.WORLD)
    results["topk_config"] = _topk_config(rank, tp_group=dist.group.WORLD)
    for bad, bad_ids in (("int32", ids.int()), ("shape", ids[:2])):  # the op's message on every rank, no hang
        try:
            rl_losses.topk_distillation_loss(logits[..., :cut].contiguous(), target, bad_ids, lp,
                                             tp_group=dist.group.WORLD)
        except RuntimeError as e:
            results[f"topk_{bad}_ids"] = str(e)
    results["sampled_kl"] = _sampled_kl(rank, tp_group=dist.group.WORLD)
    name = "topk_jsd_renormalize"  # under torch.compile(fullgraph=True): the collective and the hooks traced
    _, _, vocab, cut, _ = TOPK_CASES[name]
    logits, target, ids, lp, options = _topk_inputs(name)
    fn = torch.compile(rl_losses.topk_distillation_loss, fullgraph=True, backend="aot_eager")
    results["topk_compiled"] = _run_topk(logits[..., slice(0, cut) if rank == 0 else slice(cut, vocab)].contiguous(),
                                         target, ids, lp, options, fn=fn, tp_group=dist.group.WORLD)
    return results


def _sampled_kl(rank=None, fn=rl_losses.sampled_kl_loss, dtype=None, **group):
    """sampled_kl_loss (k3, T = 1.3) on the first TOPK case's inputs: this rank's shard under tp_group."""
    name = "topk_forward_kl_none"
    _, _, vocab, cut, _ = TOPK_CASES[name]
    logits, target, _, _, _ = _topk_inputs(name)
    teacher = torch.linspace(-3.0, -0.5, target.numel(), dtype=torch.float64).view(target.shape)
    if group:
        logits = logits[..., slice(0, cut) if rank == 0 else slice(cut, vocab)].contiguous()
    x = logits.to(dtype or logits.dtype).clone().requires_grad_()
    out = fn(x, target, teacher.to(x.dtype), estimator="k3", temperature=1.3, **group)
    out.loss.backward()
    return {"loss": out.loss.detach(), "kl": out.kl.detach(), "advantages": out.advantages, "grad": x.grad}


def _topk_config(rank=None, **group):
    """The topk_distillation config's module (weight 0.5, the "tail" bucket) on the first TOPK case's inputs: this
    rank's shard under tp_group, else the whole vocabulary."""
    from rl_losses.config import LanguageModelLossConfig

    name = "topk_forward_kl_none"
    _, _, vocab, cut, _ = TOPK_CASES[name]
    logits, target, ids, lp, _ = _topk_inputs(name)
    if group:
        logits = logits[..., slice(0, cut) if rank == 0 else slice(cut, vocab)].contiguous()
    cfg = LanguageModelLossConfig.from_dict({"type": "topk_distillation", "tail": "tail", "weight": 0.5})
    batch = {"labels": target, "reference_topk_ids": {"teacher": ids}, "reference_topk_log_probs": {"teacher": lp}}
    x = logits.clone().requires_grad_()
    loss, metrics = cfg.get_loss(**group)(x, batch)
    loss.backward()
    return {"loss": loss.detach(), "grad": x.grad, **{k: v.detach() for k, v in metrics.items()}}


@pytest.fixture(scope="module")
def world_results():
    return gloo_world_results(_rank_results, WORLD)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name, world_results):
    _, _, dtype, vocab, cut = CASES[name]
    logits, teacher, mask, kwargs = _inputs(name)
    expected = _run(logits, teacher, kwargs)
    for rank, results in enumerate(world_results):
        got = results[name]
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        assert_close(got["loss"], expected["loss"], dtype, scale=2.0, msg=f"loss, rank {rank}")
        assert_close(got["divergence"], expected["divergence"], dtype, scale=2.0, msg=f"divergence, rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., cols], dtype, scale=2.0)


@pytest.mark.parametrize("name", list(TOPK_CASES))
def test_topk_matches_single_process_and_reference(name, world_results):
    _, dtype, vocab, cut, _ = TOPK_CASES[name]
    logits, target, ids, lp, options = _topk_inputs(name)
    expected = _run_topk(logits, target, ids, lp, options)
    reference = _run_topk(logits.double(), target, ids, lp, options, fn=reference_topk.topk_distillation_loss)
    for rank, results in enumerate(world_results):
        got = results[name]
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        for key in ("loss", "divergence", "student_mass", "teacher_mass"):
            assert_close(got[key], expected[key], dtype, scale=2.0, msg=f"{key}, rank {rank}")
            assert_close(got[key].double(), reference[key], dtype, scale=4.0, msg=f"{key} (float64), rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., cols], dtype, scale=2.0)
        assert_grad_close(got["grad"], reference["grad"][..., cols], dtype, scale=4.0)


def test_topk_config_under_tp_group(world_results):
    """The config's module passes its tp_group to the op: each rank's loss and metrics are the whole vocabulary's."""
    _, dtype, vocab, cut, _ = TOPK_CASES["topk_forward_kl_none"]
    expected = _topk_config()
    for rank, results in enumerate(world_results):
        got = results["topk_config"]
        assert set(got) == set(expected)
        for key in expected:
            if key != "grad":
                assert_close(got[key], expected[key], dtype, scale=2.0, msg=f"{key}, rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., slice(0, cut) if rank == 0 else slice(cut, vocab)], dtype,
                          scale=2.0)


def test_topk_compiled_under_tp_group(world_results):
    """torch.compile(fullgraph=True) of the sparse teacher under tp_group gives the eager call's bits."""
    for rank, results in enumerate(world_results):
        for key, value in results["topk_compiled"].items():
            assert torch.equal(value, results["topk_jsd_renormalize"][key]), f"{key}, rank {rank}"


def test_topk_bad_ids_under_tp_group(world_results):
    for rank, results in enumerate(world_results):
        assert "topk_distillation: teacher_ids must be int64, got Int" in results["topk_int32_ids"], rank
        assert "teacher_ids must have shape (batch..., K) with batch shape [3, 5], got [2, 5, " in \
            results["topk_shape_ids"], rank


def test_sampled_kl_under_tp_group(world_results):
    """The sampled-token KL under tp_group: every rank's loss, estimates and advantages are the whole vocabulary's
    (the single-process op's, and a float64 composition of the reference log-probs), its gradient the column block."""
    from rl_losses import reference
    from rl_losses.topk_distillation import sampled_kl

    _, dtype, vocab, cut, _ = TOPK_CASES["topk_forward_kl_none"]
    expected = _sampled_kl()
    logits, target, _, _, _ = _topk_inputs("topk_forward_kl_none")
    teacher = torch.linspace(-3.0, -0.5, target.numel(), dtype=torch.float64).view(target.shape)
    log_q, _ = reference.token_log_probs(logits.double() / 1.3, target)
    ref_kl = torch.where(target >= 0, sampled_kl(log_q, teacher, "k3"), 0.0)
    for rank, results in enumerate(world_results):
        got = results["sampled_kl"]
        for key in ("loss", "kl", "advantages"):
            assert_close(got[key], expected[key], dtype, scale=2.0, msg=f"{key}, rank {rank}")
        assert_close(got["kl"], ref_kl, dtype, scale=4.0, msg=f"kl (float64), rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., slice(0, cut) if rank == 0 else slice(cut, vocab)], dtype,
                          scale=2.0)
