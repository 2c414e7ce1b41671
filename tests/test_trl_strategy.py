"""The TRL drop-in's ``lm_head_strategy`` ("fast", "lean"): with either, the loss, every gradient and TRL's
metrics agree with TRL's trainer, on-policy (no old log-probs in the batch: the op takes old_log_probs=None and
no other lm_head pass runs) and off-policy, at both importance-sampling levels; each lm_head op of the trainer
runs with the chosen strategy; a bad value is refused on construction."""
import functools

import pytest
import torch

trl = pytest.importorskip("trl")

import rl_losses  # noqa: E402
from helpers_trl import compare_loss_step, make_tokenizer, make_trainer, saved_model  # noqa: E402
from rl_losses.integrations import trl as rl_trl  # noqa: E402

VOCAB = 89


def _trainers(strategy, **options):
    tok = make_tokenizer(VOCAB)
    torch.manual_seed(0)
    model = saved_model(VOCAB)
    ours = functools.partial(rl_trl.GRPOTrainer, lm_head_strategy=strategy)
    return [make_trainer(cls, model, tok, VOCAB, **options) for cls in (trl.GRPOTrainer, ours)]


def _strategies_of(monkeypatch):
    """Records (op name, strategy) of every rl_losses lm_head op call made through the drop-in."""
    calls = []
    for name in ("linear_grpo_loss", "linear_gspo_loss", "linear_token_log_probs"):
        op = getattr(rl_losses, name)

        def recorded(*args, _op=op, _name=name, **kwargs):
            calls.append((_name, kwargs.get("strategy", "fast")))
            return _op(*args, **kwargs)

        monkeypatch.setattr(rl_losses, name, recorded)
    return calls


@pytest.mark.parametrize("strategy", ["fast", "lean"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_strategy_matches_trl(strategy, level, num_iterations, monkeypatch):
    theirs, ours = _trainers(strategy, num_iterations=num_iterations, importance_sampling_level=level,
                             loss_type="grpo" if level == "sequence" else "dapo", beta=0.0)
    batch = next(iter(theirs.get_train_dataloader()))
    inputs = []
    for trainer in (theirs, ours):
        torch.manual_seed(100)
        inputs.append(trainer._generate_and_score_completions(batch))
    assert ("old_per_token_logps" in inputs[0] and inputs[0]["old_per_token_logps"] is not None) == \
        (num_iterations > 1)
    calls = _strategies_of(monkeypatch)
    compare_loss_step(theirs, ours, inputs)
    op = "linear_gspo_loss" if level == "sequence" else "linear_grpo_loss"
    # One lm_head op per loss step, with the chosen strategy: on-policy there is no pre-pass for the old log-probs.
    assert calls == [(op, strategy)]


@pytest.mark.parametrize("strategy", ["fast", "lean"])
def test_strategy_reaches_every_head_op(strategy, monkeypatch):
    """The old-policy log-probs (num_iterations > 1) and the on-policy masks' pre-pass use the strategy too."""
    theirs, ours = _trainers(strategy, num_iterations=2, top_entropy_quantile=0.5)
    batch = next(iter(theirs.get_train_dataloader()))
    calls = _strategies_of(monkeypatch)
    inputs = []
    for trainer in (theirs, ours):
        torch.manual_seed(100)
        inputs.append(trainer._generate_and_score_completions(batch))
    compare_loss_step(theirs, ours, inputs)
    assert [name for name, _ in calls] == ["linear_token_log_probs", "linear_token_log_probs", "linear_grpo_loss"]
    assert {s for _, s in calls} == {strategy}


def test_bad_strategy_is_refused():
    tok = make_tokenizer(VOCAB)
    with pytest.raises(ValueError, match=r"lm_head_strategy must be one of \('fast', 'lean'\), got 'quick'"):
        make_trainer(functools.partial(rl_trl.GRPOTrainer, lm_head_strategy="quick"), saved_model(VOCAB), tok, VOCAB)
