"""The TRL drop-in's handling of the options that change how the loss is computed rather than which loss:
``cast_lm_head_to_fp32`` under bf16 autocast (the head, old and reference log-probs and the loss in float32, as
TRL's), and vLLM's importance-sampling correction in its four modes with the batch made by TRL's own generation
step from an engine stand-in (FakeVLLM): the engine log-probs, the old log-probs and the ratio come from TRL's
code, and the loss, every gradient and TRL's metrics agree; and NaN or inf in the batch's padding, never read."""
import pytest
import torch

trl = pytest.importorskip("trl")

from helpers_trl import (FakeVLLM, assert_rel_close, compare_loss_step, make_tokenizer, make_trainer,  # noqa: E402
                         saved_model)
from rl_losses.integrations import trl as rl_trl  # noqa: E402

VOCAB = 97


def _trainers(**options):
    tok = make_tokenizer(VOCAB)
    torch.manual_seed(0)
    model = saved_model(VOCAB)
    return [make_trainer(cls, model, tok, VOCAB, **options) for cls in (trl.GRPOTrainer, rl_trl.GRPOTrainer)]


def _update(theirs, ours, step_size=2.0):
    with torch.no_grad():  # the same update on both, so that the reused batch's ratios move
        for p, q in zip(theirs.model.parameters(), ours.model.parameters()):
            p -= step_size * p.grad
            q.copy_(p)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cast_lm_head_to_fp32_under_bf16_autocast(level):
    """bf16 autocast with cast_lm_head_to_fp32: the old and reference log-probs, the loss and every gradient agree
    with TRL's to float32 rounding (the head left in bf16 is 6e-4 off in the log-probs, 0.4% in the lm_head's
    gradient, 0.9% in the backbone's)."""
    theirs, ours = _trainers(bf16=True, cast_lm_head_to_fp32=True, beta=0.05, num_iterations=2,
                             importance_sampling_level=level, epsilon=0.1)
    assert ours.model.lm_head.weight.dtype == torch.float32
    batch = next(iter(theirs.get_train_dataloader()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inputs = []
        for trainer in (theirs, ours):
            torch.manual_seed(100)
            inputs.append(trainer._generate_and_score_completions(batch))
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            assert inputs[1][key].dtype == torch.float32
            assert_rel_close(inputs[1][key], inputs[0][key], key, rtol=1e-6)
        for step in range(2):
            compare_loss_step(theirs, ours, inputs, step)
            _update(theirs, ours)


VLLM_MODES = {
    "token_truncate": dict(vllm_importance_sampling_clip_max=1.2),
    "token_mask": dict(vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25),
    "sequence_truncate": dict(vllm_importance_sampling_clip_max=1.5),
    "sequence_mask": dict(vllm_importance_sampling_clip_min=0.6, vllm_importance_sampling_clip_max=1.6),
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", list(VLLM_MODES))
def test_vllm_importance_sampling_through_trls_generation(mode, level):
    """Two generation steps of num_iterations=2 each (the reused batch after an update): TRL's ratio truncates
    or masks some tokens or sequences, and both trainers' losses, gradients and metrics agree."""
    theirs, ours = _trainers(num_iterations=2, epsilon=0.1, vllm_importance_sampling_correction=True,
                             vllm_importance_sampling_mode=mode, importance_sampling_level=level,
                             **VLLM_MODES[mode])
    loader = iter(theirs.get_train_dataloader())
    corrected = 0
    for generation in range(2):
        batch = next(loader)
        inputs = []
        for trainer in (theirs, ours):
            trainer.use_vllm, trainer.vllm_generation = True, FakeVLLM(trainer, seed=generation)
            trainer._last_loaded_step = trainer.state.global_step  # (set by TRL when it builds its engine)
            inputs.append(trainer._generate_and_score_completions(batch))
        for key in ("completion_ids", "sampling_per_token_logps", "importance_sampling_ratio"):
            torch.testing.assert_close(inputs[1][key], inputs[0][key], equal_nan=True, rtol=1e-5, atol=1e-6)
        ratio = inputs[0]["importance_sampling_ratio"]
        bound = theirs.vllm_importance_sampling_clip_max
        corrected += int(((ratio == bound) | (ratio == 0)).sum())
        for step in range(2):
            compare_loss_step(theirs, ours, inputs, f"{generation}.{step}")
            _update(theirs, ours)
    assert corrected > 0, "TRL's ratio never truncated or masked anything"


PADDING_CASES = {
    "dapo-masks": dict(loss_type="dapo", top_entropy_quantile=0.6, off_policy_mask_threshold=0.05),
    "vespo": dict(loss_type="vespo"),
}


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("case", list(PADDING_CASES))
def test_padding_is_never_read(case, poison):
    """NaN or inf in the padded positions of the old, reference and engine log-probs TRL's batch carries: the
    loss, every gradient and every metric are those of the batch with zeros there."""
    _, ours = _trainers(beta=0.05, num_iterations=2, vllm_importance_sampling_correction=True,
                        vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.5,
                        **PADDING_CASES[case])
    ours.use_vllm, ours.vllm_generation = True, FakeVLLM(ours, seed=0)
    ours._last_loaded_step = ours.state.global_step
    clean = ours._generate_and_score_completions(next(iter(ours.get_train_dataloader())))
    padded = clean["completion_mask"] == 0
    assert padded.any()
    keys = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
    clean = dict(clean, **{k: clean[k].masked_fill(padded, 0.0) for k in keys})
    dirty = dict(clean, **{k: clean[k].masked_fill(padded, poison) for k in keys})
    results = []
    for x in (clean, dirty):
        ours.model.zero_grad()
        loss = ours.compute_loss(ours.model, x)
        loss.backward()
        metrics = {k: v[-1] for k, v in ours._metrics["train"].items() if v and not k.startswith(("sampling", "num"))}
        results.append((loss.detach(), [p.grad.clone() for p in ours.model.parameters()], metrics))
    (loss, grads, metrics), (dirty_loss, dirty_grads, dirty_metrics) = results
    assert torch.isfinite(dirty_loss) and dirty_loss == loss
    for g, h in zip(grads, dirty_grads):
        assert torch.equal(g, h)
    assert dirty_metrics == metrics
