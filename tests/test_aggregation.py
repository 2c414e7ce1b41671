"""Aggregation presets (rl_losses.aggregation) against TRL's reductions, and the policy family's options in the
configs and loss modules (docs/policy_losses.md), against the float64 reference."""
import pytest
import torch

import rl_losses
from rl_losses import reference

from conftest import assert_close
from test_policy import make_batch


# ---- aggregation presets -------------------------------------------------------------------------------------------
def _trl_aggregate(name, per_token, mask, max_len):
    # grpo_trainer.py (trl 1.16.0, _compute_loss): each loss_type's reduction of (B, T) per-token losses.
    if name in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if name in ("bnpo", "dapo", "cispo", "vespo"):  # dapo/cispo/vespo: num_items_in_batch = this batch's count
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if name == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    return (per_token * mask).sum(-1).mean()  # luspo


@pytest.mark.parametrize("name", sorted(rl_losses.aggregation.TRL_LOSS_TYPES))
def test_presets_match_trl_reductions(name):
    b, t = 5, 7
    mask = torch.rand(b, t) < 0.7
    mask[1] = False  # an empty completion
    per_token = torch.randn(b, t, dtype=torch.float64)
    _, preset = rl_losses.aggregation.trl_loss_type(name)
    weights, divisor = rl_losses.aggregation.aggregation_weights(preset, completion_mask=mask,
                                                                 max_completion_length=t + 2)
    divisor = mask.sum().clamp_min(1) if divisor is None else divisor
    ours = (weights.double() * per_token).sum() / divisor
    assert_close(ours, _trl_aggregate(name, per_token, mask.double(), t + 2), torch.float32)


@pytest.mark.parametrize("preset", rl_losses.aggregation.PRESETS)
def test_packed_presets_equal_padded(preset):
    # The same completions padded (B, T) and packed into rows with document ids give the same (w, D).
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    w_pad, d_pad = rl_losses.aggregation.aggregation_weights(preset, completion_mask=mask, max_completion_length=4)
    lengths = mask.sum(1)
    doc = torch.repeat_interleave(torch.arange(3), lengths)
    labels = torch.randint(0, 10, doc.shape)
    w_pack, d_pack = rl_losses.aggregation.aggregation_weights(preset, labels=labels, document_index=doc,
                                                               max_completion_length=4)
    assert d_pad == d_pack
    assert_close(w_pack, w_pad[mask], torch.float32)


def test_aggregation_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    agg = rl_losses.aggregation
    with pytest.raises(ValueError, match="preset must be one of"):
        agg.aggregation_weights("seq-mean", completion_mask=mask)
    with pytest.raises(ValueError, match="needs max_completion_length > 0, got None"):
        agg.aggregation_weights("sequence_sum_constant", completion_mask=mask)
    with pytest.raises(ValueError, match="num_items_in_batch applies to 'token_mean' only"):
        agg.aggregation_weights("luspo", completion_mask=mask, num_items_in_batch=4)
    with pytest.raises(ValueError, match="completion_mask must be \\(B, T\\)"):
        agg.aggregation_weights("luspo", completion_mask=mask.reshape(-1))
    with pytest.raises(ValueError, match="TRL loss_type must be one of"):
        agg.trl_loss_type("gpg")


# ---- configs -------------------------------------------------------------------------------------------------------
def test_config_options_reach_the_op():
    from rl_losses.config import LanguageModelLossConfig

    cfg = LanguageModelLossConfig.from_dict({
        "type": "grpo", "loss_type": "sapo", "sapo_temperature_neg": 0.8, "rollout_correction": "token_mask",
        "rollout_mask_bounds": [0.7, 1.4], "kl_estimator": "k2", "beta": 0.05, "entropy_coefficient": 0.01,
        "metrics": "with_entropy"})
    assert LanguageModelLossConfig.from_dict(cfg.to_dict()) == cfg
    logits, target, advantages, old, rollout, ref = make_batch(3, 6, 30, torch.float32)
    batch = dict(labels=target, advantages=advantages, rollout_log_probs=rollout, ref_log_probs=ref)  # on-policy
    loss, metrics = cfg.get_loss(name="grpo")(logits, batch)
    expected = reference.grpo_loss(logits.double(), target, advantages.double(), None, loss_type="sapo",
                                   sapo_temperature_neg=0.8, rollout_log_probs=rollout.double(),
                                   rollout_correction="token_mask", rollout_mask_bounds=(0.7, 1.4),
                                   ref_log_probs=ref.double(), beta=0.05, kl_estimator="k2",
                                   entropy_coefficient=0.01, compute_entropy=True)
    assert_close(loss, expected.loss, torch.float32)
    assert_close(metrics["grpo_kl"], expected.kl, torch.float32)
    assert_close(metrics["grpo_rollout_weight"], expected.rollout_weight_mean, torch.float32)


@pytest.mark.parametrize("options,match", [
    (dict(loss_type="gspo"), "loss_type must be one of"),
    (dict(loss_type="sapo", sapo_temperature_pos=0.0), "sapo_temperature_pos must be a finite number > 0"),
    (dict(loss_type="cispo", delta=2.0), "delta must be None with loss_type='cispo'"),
    (dict(rollout_correction="token_mask", rollout_mask_bounds=(2.0, 1.0)), "rollout_mask_bounds must be None or"),
    (dict(rollout_correction="token_truncate", rollout_mask_bounds=(0.5, 1.0)), "unless rollout_correction is"),
    (dict(kl_estimator="low_var_kl"), "kl_estimator must be one of"),
    (dict(rollout_correction="both"), "rollout_correction must be one of"),
])
def test_config_validation(options, match):
    from rl_losses.config import LanguageModelGRPOLossConfig

    with pytest.raises((ValueError, TypeError), match=match):
        LanguageModelGRPOLossConfig(**options)


def test_gspo_config_options_reach_the_op():
    from rl_losses.config import LanguageModelLossConfig

    cfg = LanguageModelLossConfig.from_dict({"type": "gspo", "loss_type": "cispo", "epsilon_high": 1.1, "beta": 0.03,
                                             "kl_estimator": "k1", "entropy_coefficient": 0.02, "metrics": "basic"})
    logits, target, _, old, _, ref = make_batch(2, 8, 30, torch.float32)
    doc = torch.tensor([[0] * 5 + [1] * 3, [1] * 2 + [2] * 6])
    advantages = torch.randn(3)  # per document
    batch = dict(labels=target, advantages=advantages, old_log_probabilities=old, ref_log_probs=ref,
                 document_index=doc)
    loss, metrics = cfg.get_loss(name="gspo")(logits, batch)
    expected = reference.gspo_loss(logits.double(), target, advantages.double(), old.double(), doc,
                                   loss_type="cispo", epsilon_high=1.1, ref_log_probs=ref.double(), beta=0.03,
                                   kl_estimator="k1", entropy_coefficient=0.02)
    assert_close(loss, expected.loss, torch.float32)
    assert_close(metrics["gspo_kl"], expected.kl, torch.float32)
    assert_close(metrics["gspo_advantage"], (advantages[doc] * (target >= 0)).sum() / (target >= 0).sum(),
                 torch.float32)
