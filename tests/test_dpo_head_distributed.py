"""Vocabulary-parallel DPO and fused head on gloo: 2 processes (CPU tensors, FileStore rendezvous) each hold a
column shard of the logits (even and uneven cuts); every rank's loss and metrics must equal the float64
reference on the whole vocabulary, and its gradient the reference gradient's column block."""
import pytest
import torch
import torch.distributed as dist

import rl_losses
from rl_losses import reference
from rl_losses.fused_head import fused_head_loss

from conftest import assert_close
from helpers import assert_grad_close, gloo_world_results

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
# name: (op, options, dtype, vocabulary, column cut); a cut off the middle is an uneven shard.
CASES = {
    "dpo": ("dpo", dict(beta=0.5), torch.float64, 24, 12),
    "dpo_uneven_fp32": ("dpo", dict(beta=0.2, logits_scale_factor=0.8, divisor=3.0), torch.float32, 25, 9),
    "head_all_terms": ("head", dict(label_weight=0.7, label_smoothing=0.1, z_loss_weight=0.3, grpo_weight=1.4,
                                    beta=0.05, logits_scale_factor=0.9), torch.float64, 26, 13),
    "head_uneven_fp32": ("head", dict(label_weight=1.0, z_loss_weight=0.5, z_loss_mask=True, grpo_weight=0.6,
                                      grpo_divisor=5.0), torch.float32, 31, 20),
    "head_z_loss_only": ("head", dict(z_loss_weight=1.0), torch.float64, 16, 8),
    "head_gspo": ("head", dict(label_weight=0.7, z_loss_weight=0.3, gspo_weight=1.4, beta=0.05, weighting="token",
                               logits_scale_factor=0.9), torch.float64, 26, 13),
    "head_gspo_uneven_fp32": ("head", dict(label_weight=1.0, label_smoothing=0.1, gspo_weight=0.6, gspo_divisor=3.0),
                              torch.float32, 31, 20),
}


def _inputs(name):
    op, options, dtype, vocab, _ = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 7919 + vocab)
    if op == "dpo":
        lengths = [4, 5, 3, 6]  # 2 pairs, each document a one-token prompt then its response
        doc = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)] + [torch.full((2,), -1)])
        target = torch.randint(0, vocab, doc.shape, generator=g)
        starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
        target[starts] = -100
        target[doc < 0] = -100
        logits = (torch.randn(doc.numel(), vocab, generator=g, dtype=torch.float64) * 2).to(dtype)
        pairs = torch.tensor([[2, 0], [1, 3]])
        ref = torch.randn(2, 2, generator=g) - 8
        return logits, (target, doc, pairs, ref[0], ref[1]), dict(options)
    shape = (3, 5)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 2).to(dtype)
    target = torch.randint(0, vocab, shape, generator=g)
    target[torch.rand(shape, generator=g) < 0.3] = -100
    kwargs = dict(options)
    if kwargs.get("grpo_weight"):
        kwargs.update(advantages=torch.randn(shape, generator=g), old_log_probs=torch.randn(shape, generator=g) - 3)
        if kwargs.get("beta"):
            kwargs["ref_log_probs"] = torch.randn(shape, generator=g) - 3
    if kwargs.get("gspo_weight"):  # 4 documents across the rows, the last token padding
        doc = torch.arange(15) * 4 // 14
        doc[-1] = -1
        # Old log-probs near the current ones, so that the sequence ratios are not all clipped.
        scaled = logits.double() * kwargs.get("logits_scale_factor", 1.0)
        lp = torch.log_softmax(scaled, -1).gather(-1, target.clamp_min(0)[..., None]).squeeze(-1)
        kwargs.update(advantages=torch.randn(shape, generator=g), document_index=doc.view(shape), num_documents=4,
                      old_log_probs=(lp + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)).float())
        if kwargs.get("beta"):
            kwargs["ref_log_probs"] = torch.randn(shape, generator=g) - 3
    if kwargs.get("z_loss_mask"):
        kwargs["z_loss_mask"] = torch.rand(shape, generator=g) > 0.3
    return logits, (target,), kwargs


def _call(name, fn, x, args, kwargs):
    if CASES[name][0] == "dpo":
        out = fn(x, *args, **kwargs)
        return out.loss, {k: getattr(out, k) for k in ("rewards_chosen", "rewards_rejected", "accuracy", "margin",
                                                       "log_probs", "document_log_probs")}
    out = fn(x, *args, **kwargs)
    return out.loss, {k: getattr(out, k) for k in ("label_loss", "z_loss", "grpo_loss", "gspo_loss", "log_probs")}


def _run(name, logits, args, kwargs, **tp):
    fn = rl_losses.dpo_loss if CASES[name][0] == "dpo" else fused_head_loss
    x = logits.detach().clone().requires_grad_()
    loss, metrics = _call(name, fn, x, args, {**kwargs, **tp})
    (loss * 1.3).backward()
    return {"loss": loss.detach(), "grad": x.grad, **metrics}


def _reference(name, logits, args, kwargs):
    fn = reference.dpo_loss if CASES[name][0] == "dpo" else reference.fused_head_loss
    x = logits.detach().double().requires_grad_()
    loss, metrics = _call(name, fn, x, args, kwargs)
    (loss * 1.3).backward()
    return {"loss": loss.detach(), "grad": x.grad, **metrics}


HEAD_LOSSES = {"ce": {"type": "label", "weight": 0.5, "label_smoothing": 0.1}, "z": {"type": "z_loss", "weight": 0.1},
               "pg": {"type": "grpo", "weight": 2.0, "epsilon_high": 0.3}}
CONFIG_VOCAB, CONFIG_CUT = 22, 11


def _config_inputs():
    g = torch.Generator().manual_seed(4242)
    shape = (2, 7)
    logits = torch.randn(*shape, CONFIG_VOCAB, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, CONFIG_VOCAB, shape, generator=g)
    target[torch.rand(shape, generator=g) < 0.3] = -100
    batch = {"labels": target, "advantages": torch.randn(shape, generator=g),
             "old_log_probabilities": torch.randn(shape, generator=g) - 3,
             "loss_mask": torch.rand(shape, generator=g) > 0.2}
    return logits, batch


def _run_config(logits, batch, tp_group=None):
    from rl_losses.config import LanguageModelLossConfig

    head = LanguageModelLossConfig.from_dict({"type": "fused_head", "losses": HEAD_LOSSES}).get_loss(name="head",
                                                                                               tp_group=tp_group)
    x = logits.detach().clone().requires_grad_()
    loss, metrics = head(x, batch)
    loss.backward()
    return {"loss": loss.detach(), "grad": x.grad, **{k: v.detach() for k, v in metrics.items()}}


def _rank_results(rank):
    results = {}
    for name, (_, _, _, vocab, cut) in CASES.items():
        logits, args, kwargs = _inputs(name)
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        shard = dict(vocab_start=cols.start, vocab_size=vocab) if 2 * cut != vocab else {}
        results[name] = _run(name, logits[..., cols].contiguous(), args, kwargs, tp_group=dist.group.WORLD,
                             **shard)
    logits, batch = _config_inputs()
    cols = slice(0, CONFIG_CUT) if rank == 0 else slice(CONFIG_CUT, CONFIG_VOCAB)
    import rl_losses.fused_head

    calls, fused = [], rl_losses.fused_head.fused_head_loss
    rl_losses.fused_head.fused_head_loss = lambda *a, **k: calls.append(k) or fused(*a, **k)
    results["head_config"] = _run_config(logits[..., cols].contiguous(), batch, tp_group=dist.group.WORLD)
    results["head_config"]["fused_calls"] = torch.tensor(len(calls))
    return results


@pytest.fixture(scope="module")
def world_results():
    return gloo_world_results(_rank_results, WORLD)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_float64_reference(name, world_results):
    _, _, dtype, vocab, cut = CASES[name]
    logits, args, kwargs = _inputs(name)
    expected = _reference(name, logits, args, kwargs)
    for rank, results in enumerate(world_results):
        got = results[name]
        cols = slice(0, cut) if rank == 0 else slice(cut, vocab)
        for key, value in expected.items():
            if value is None:  # the fused head's terms of weight 0
                assert got[key] is None, f"{key}, rank {rank}"
            elif key != "grad":
                assert_close(got[key], value, dtype, scale=4.0, msg=f"{key}, rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., cols], dtype, natural_scale=1.3 / logits[..., 0].numel(),
                          scale=2.0)
        assert torch.count_nonzero(got["grad"]) > 0


def test_head_config_under_tp_group_matches_one_process(world_results, monkeypatch):
    """The head config fuses under tp_group too (one call of the op) and equals the one-process head (itself
    tested against the separate modules and the reference in tests/test_fused_head.py), in float64."""
    logits, batch = _config_inputs()
    expected = _run_config(logits, batch)
    for rank, results in enumerate(world_results):
        got = results["head_config"]
        cols = slice(0, CONFIG_CUT) if rank == 0 else slice(CONFIG_CUT, CONFIG_VOCAB)
        assert got.pop("fused_calls") == 1, "the three losses must run as one fused call"
        assert set(got) == set(expected)
        for key, value in expected.items():
            if key != "grad":
                assert_close(got[key], value, torch.float64, scale=4.0, msg=f"{key}, rank {rank}")
        assert_grad_close(got["grad"], expected["grad"][..., cols], torch.float64, scale=2.0)


def test_tp_group_shard_arguments_are_checked():
    logits = torch.randn(4, 6)
    target = torch.tensor([1, 2, -100, 3])
    with pytest.raises(ValueError, match="fused_head_loss: vocab_start/vocab_size describe a tp_group shard"):
        fused_head_loss(logits, target, label_weight=1.0, vocab_start=0, vocab_size=6)
    with pytest.raises(ValueError, match="dpo: vocab_start/vocab_size describe a tp_group shard"):
        rl_losses.dpo_loss(logits, target, torch.tensor([0, 0, 1, 1]), torch.tensor([[0, 1]]), torch.zeros(1),
                           torch.zeros(1), vocab_size=6)
