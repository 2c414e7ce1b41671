"""rl_losses.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer, on a tiny causal LM and a tokenizer
built in code (no download), with a rule-based reward: from the same weights and seed, the generated batch,
the old-policy and reference log-probs, the per-step loss, the gradient of every parameter and TRL's metrics
agree (fp32), for each TRL loss_type the fused loss covers, importance_sampling_level="sequence" (GSPO, with
delta), the ratio-weighted KL (use_bias_correction_kl), vLLM's importance-sampling correction (simulated engine
log-probs), the entropy bonus (static, and adaptive over accumulated micro-batches); the options without a fused
form keep TRL's formula. The loss step's peak memory is measured at a vocabulary where the logits dominate."""
import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from helpers_trl import (assert_rel_close, compare_loss_step, make_model, make_tokenizer, make_trainer,  # noqa: E402
                         saved_model, simulate_vllm)
from rl_losses.integrations import trl as rl_trl  # noqa: E402

DEFAULTS = dict(loss_type="grpo", importance_sampling_level="token", beta=0.0, num_iterations=2, epsilon=0.1,
                epsilon_high=0.15)
SEQ = dict(importance_sampling_level="sequence")
KL = dict(beta=0.05, use_bias_correction_kl=False)
ASCENT = dict(ascent=True)  # the test's parameter update goes up the loss's gradient (not a GRPOConfig option)
CASES = {  # GRPOConfig options over DEFAULTS (num_iterations=2: old log-probs reused after an update)
    "grpo-on-policy": dict(num_iterations=1),
    "grpo-kl": KL,
    "grpo-kl-bias-corrected": dict(KL, use_bias_correction_kl=True),
    "grpo-kl-bias-corrected-on-policy": dict(KL, use_bias_correction_kl=True, num_iterations=1),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo-delta": dict(loss_type="dapo", **ASCENT, delta=1.3),
    "luspo": dict(loss_type="luspo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "cispo-kl-on-policy": dict(KL, loss_type="cispo", epsilon_high=1.1, num_iterations=1),
    "bnpo-entropy-bonus": dict(loss_type="bnpo", entropy_coef=0.3),
    "dapo-entropy-bonus-kl": dict(KL, loss_type="dapo", entropy_coef=0.3),
    "dr_grpo-entropy-bonus-on-policy": dict(loss_type="dr_grpo", entropy_coef=0.3, num_iterations=1),
    "luspo-gspo-entropy-bonus": dict(SEQ, loss_type="luspo", entropy_coef=0.3),
    "sapo": dict(loss_type="sapo"),
    "sapo-kl": dict(KL, loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "vespo": dict(loss_type="vespo"),
    "vespo-sequence": dict(SEQ, loss_type="vespo"),
    "gspo": SEQ,
    "luspo-gspo": dict(SEQ, loss_type="luspo"),
    "sapo-gspo": dict(SEQ, loss_type="sapo"),
    "cispo-gspo": dict(SEQ, loss_type="cispo", epsilon_high=1.1),
    "gspo-kl": dict(SEQ, **KL),
    "gspo-kl-bias-corrected": dict(SEQ, **dict(KL, use_bias_correction_kl=True)),
    # delta caps R_s where A < 0: the update ascends (ASCENT), which raises those sequences' ratios above it
    "gspo-delta": dict(SEQ, **ASCENT, delta=1.2),
    "gspo-delta-kl-bias-corrected": dict(SEQ, **ASCENT, **dict(KL, use_bias_correction_kl=True), delta=1.2),
    # TRL's bonus is a token mean; grpo and sapo weigh tokens by 1/|o_i| (moved into the advantages)
    "grpo-entropy-bonus": dict(entropy_coef=0.3),
    "grpo-entropy-bonus-delta-on-policy": dict(entropy_coef=0.3, delta=1.2, num_iterations=1),
    "sapo-entropy-bonus": dict(loss_type="sapo", entropy_coef=0.3),
    "gspo-entropy-bonus": dict(SEQ, **ASCENT, entropy_coef=0.3, delta=1.2),
    "sapo-gspo-entropy-bonus": dict(SEQ, loss_type="sapo", entropy_coef=0.3),
    # vLLM's importance-sampling correction, from simulated engine log-probs (simulate_vllm)
    "vllm-token_truncate": dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.2),
    "vllm-token_mask": dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.8,
                            vllm_importance_sampling_clip_max=1.25),
    "vllm-token_mask-kl-bias-corrected": dict(KL, use_bias_correction_kl=True,
                                              vllm_importance_sampling_mode="token_mask",
                                              vllm_importance_sampling_clip_max=1.25),
    "vllm-sequence_truncate": dict(vllm_importance_sampling_mode="sequence_truncate",
                                   vllm_importance_sampling_clip_max=1.5),
    "vllm-sequence_mask": dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.5,
                               vllm_importance_sampling_clip_max=2.0),
    "vllm-gspo-sequence_mask": dict(SEQ, vllm_importance_sampling_mode="sequence_mask",
                                    vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0),
    "vllm-gspo-token_truncate": dict(SEQ, vllm_importance_sampling_mode="token_truncate",
                                     vllm_importance_sampling_clip_max=1.2),
    "vllm-gspo-token_mask": dict(SEQ, vllm_importance_sampling_mode="token_mask",
                                 vllm_importance_sampling_clip_max=1.25),
    "vllm-cispo-token_truncate": dict(loss_type="cispo", epsilon_high=1.1,
                                      vllm_importance_sampling_mode="token_truncate"),
    "vllm-vespo-token_truncate": dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate",
                                      vllm_importance_sampling_clip_max=1.2),
    "vllm-gspo-token_mask-entropy-bonus": dict(SEQ, entropy_coef=0.3, vllm_importance_sampling_mode="token_mask",
                                               vllm_importance_sampling_clip_max=1.25),
    # TRL's delta at or below 1 + ε_h = 1.15 (it caps the ratio where A > 0) and below 1 - ε_l = 0.9
    "dapo-delta-inside": dict(loss_type="dapo", delta=1.1),
    "grpo-delta-on-bound-kl": dict(KL, delta=1.15),
    "bnpo-delta-below-low": dict(loss_type="bnpo", delta=0.85),
    "gspo-delta-inside": dict(SEQ, loss_type="luspo", delta=1.05),
    # the masks that read every token's current log-prob or entropy first: a no-gradient pre-pass, then fused
    "off-policy-mask": dict(off_policy_mask_threshold=0.02),
    "off-policy-mask-gspo-kl": dict(SEQ, **KL, off_policy_mask_threshold=0.02),
    "off-policy-mask-entropy-bonus": dict(loss_type="dapo", entropy_coef=0.3, off_policy_mask_threshold=0.02),
    "vllm-off-policy-mask": dict(off_policy_mask_threshold=0.05, vllm_importance_sampling_mode="token_mask",
                                 vllm_importance_sampling_clip_max=1.5),
    "top-entropy": dict(top_entropy_quantile=0.5),
    "top-entropy-kl-on-policy": dict(KL, loss_type="bnpo", top_entropy_quantile=0.4, num_iterations=1),
    "top-entropy-entropy-bonus": dict(loss_type="dr_grpo", top_entropy_quantile=0.5, entropy_coef=0.3),
    "top-entropy-grpo-entropy-bonus": dict(top_entropy_quantile=0.5, entropy_coef=0.3),
    "top-entropy-off-policy-mask-cispo": dict(loss_type="cispo", epsilon_high=1.1, top_entropy_quantile=0.6,
                                              off_policy_mask_threshold=0.02),
    "top-entropy-vespo-sequence": dict(SEQ, loss_type="vespo", top_entropy_quantile=0.5),
}
def delta_binding(trainer, x):
    """The tokens (sequences at sequence level) where TRL's delta is the binding cap, from TRL's own log-probs:
    r > δ where A < 0 if δ > 1 + ε_h (above the clip), where A > 0 otherwise (at or below it)."""
    mask = x["completion_mask"]
    with torch.no_grad():
        lp = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([x["prompt_ids"], x["completion_ids"]], 1),
            torch.cat([x["prompt_mask"], mask], 1), mask.shape[1])[0]
    old = lp if x.get("old_per_token_logps") is None else x["old_per_token_logps"]
    if trainer.importance_sampling_level == "sequence":
        ratio, count = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)), 1
    else:
        ratio, count = torch.exp(lp - old), mask
    adv = x["advantages"] if trainer.importance_sampling_level == "sequence" else x["advantages"].unsqueeze(1)
    delta = trainer.args.delta
    side = adv < 0 if delta > 1 + trainer.epsilon_high else adv > 0
    return int((((ratio > delta) & side) * count).sum())


def mask_counter(trainer, name, counts):
    """Wrap TRL's mask function `name` on `trainer` so that it adds the tokens or sequences it drops to
    counts[name]."""
    original = getattr(trainer, name)

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        counts[name] = counts.get(name, 0) + int((result == 0).sum() if name == "get_off_policy_mask"
                                                  else ((~result) & args[1].bool()).sum())
        return result

    setattr(trainer, name, counted)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl(case):
    options = dict(DEFAULTS, **CASES[case])
    step_size = -2.0 if options.pop("ascent", False) else 2.0
    vllm = "vllm_importance_sampling_mode" in options
    iterations = options["num_iterations"]
    vocab_size = 97
    tok = make_tokenizer(vocab_size)
    torch.manual_seed(0)
    model = saved_model(vocab_size)
    theirs = make_trainer(trl.GRPOTrainer, model, tok, vocab_size, vllm_importance_sampling_correction=vllm,
                          **options)
    ours = make_trainer(rl_trl.GRPOTrainer, model, tok, vocab_size, vllm_importance_sampling_correction=vllm,
                        **options)
    dropped = {}
    for name in ("get_off_policy_mask", "get_high_entropy_mask"):
        mask_counter(theirs, name, dropped)
    batch = next(iter(theirs.get_train_dataloader()))
    clipped, binding = 0.0, 0
    for step in range(3):
        if step != 1 or iterations == 1:  # step 1 of num_iterations=2 reuses step 0's batch after an update
            inputs = []
            for trainer in (theirs, ours):
                trainer.use_vllm = False  # generated here by transformers; the vLLM inputs are simulated below
                torch.manual_seed(100 + step)
                inputs.append(trainer._generate_and_score_completions(batch))
            for key in ("completion_ids", "completion_mask", "advantages"):
                torch.testing.assert_close(inputs[1][key], inputs[0][key])
            for key in ("old_per_token_logps", "ref_per_token_logps"):
                assert (inputs[0].get(key) is None) == (inputs[1].get(key) is None), key
                if inputs[0].get(key) is not None:
                    assert_rel_close(inputs[1][key], inputs[0][key], key)
            if vllm:
                inputs = [simulate_vllm(t, x, torch.Generator().manual_seed(step)) for t, x in zip((theirs, ours),
                                                                                                   inputs)]
        assert ours._rl_losses_fallback is None, ours._rl_losses_fallback
        if options.get("delta"):
            binding += delta_binding(theirs, inputs[0])
        compare_loss_step(theirs, ours, inputs, step)
        for name in ("clip_ratio/region_mean", "cispo_clip_ratio"):
            clipped += theirs._metrics["train"].get(name, [0.0])[-1]
        with torch.no_grad():  # the same update on both: large enough that the reused batch's ratios clip
            for p, q in zip(theirs.model.parameters(), ours.model.parameters()):
                p -= step_size * p.grad
                q.copy_(p)
    if iterations > 1 and options["loss_type"] not in ("sapo", "vespo") and step_size > 0:
        assert clipped > 0, "the test never reached the clipped region"
    if options.get("delta") and iterations > 1:  # (on-policy, the ratio is 1)
        assert binding > 0, "the test never reached a ratio where delta is the binding cap"
    if options.get("off_policy_mask_threshold") is not None:
        assert dropped.get("get_off_policy_mask", 0) > 0, "the off-policy mask never dropped a sequence"
    if options.get("top_entropy_quantile", 1.0) < 1.0:
        assert dropped.get("get_high_entropy_mask", 0) > 0, "the entropy mask never dropped a token"


def test_adaptive_entropy_matches_trl():
    """use_adaptive_entropy over three optimizer steps of two accumulated micro-batches each (loss_type grpo: its
    1/|o_i| in the advantages): per micro-batch the loss, per window the accumulated gradients, the applied
    coefficient (TRL's gate on the previous step's entropy) and the controller's update from the window's
    entropy agree. The target moves between the windows so that both sides of the gate and both branches of
    the update are taken: coefficient 0.2 → 0.25 (nothing applied yet) → 0.3 (0.25 applied) → 0.25 (gated)."""
    vocab_size = 97
    tok = make_tokenizer(vocab_size)
    torch.manual_seed(0)
    model = saved_model(vocab_size)
    options = dict(DEFAULTS, use_adaptive_entropy=True, entropy_coef=0.2, entropy_coef_delta=0.05,
                   gradient_accumulation_steps=2)
    trainers = [make_trainer(cls, model, tok, vocab_size, **options) for cls in (trl.GRPOTrainer, rl_trl.GRPOTrainer)]
    theirs, ours = trainers
    batches = iter(theirs.get_train_dataloader())
    trajectory = []
    for window, target in enumerate((10.0, 10.0, 0.0)):
        for trainer in trainers:
            trainer.args.entropy_target, trainer.current_gradient_accumulation_steps = target, 2
            trainer.model.zero_grad()
        applied = rl_trl.applied_entropy_coef(ours)
        for micro in range(2):
            batch = next(batches)
            losses = []
            for trainer in trainers:
                trainer.accelerator.gradient_state._set_sync_gradients(micro == 1)
                torch.manual_seed(100 * window + micro)
                loss = trainer.compute_loss(trainer.model, trainer._generate_and_score_completions(batch))
                loss.backward()
                losses.append(loss.detach())
            assert ours._rl_losses_fallback is None and ours._metrics["train"]["rl_losses/fused_loss"][-1] == 1.0
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)
        for (name, p), q in zip(theirs.model.named_parameters(), ours.model.parameters()):
            assert_rel_close(q.grad, p.grad, f"window {window}: grad of {name}")
        assert ours._last_world_entropy == pytest.approx(theirs._last_world_entropy, rel=1e-6)
        assert ours.entropy_coef == pytest.approx(theirs.entropy_coef, abs=1e-12)
        for name in ("entropy_coef", "policy_loss", "entropy"):
            expected = theirs._metrics["train"][name]
            assert ours._metrics["train"][name] == pytest.approx(expected, rel=1e-5, abs=1e-6), name
        trajectory.append((applied, theirs.entropy_coef))
        with torch.no_grad():
            for p, q in zip(theirs.model.parameters(), ours.model.parameters()):
                p -= p.grad
                q.copy_(p)
    assert trajectory == [pytest.approx(v) for v in ((0.0, 0.25), (0.25, 0.3), (0.0, 0.25))]


def test_op_options_maps_trl_config():
    """op_options: TRL's names to the op's, and the reasons a configuration keeps TRL's formula."""
    vocab_size = 53
    tok = make_tokenizer(vocab_size)
    trainer = make_trainer(trl.GRPOTrainer, saved_model(vocab_size), tok, vocab_size, loss_type="sapo", beta=0.1,
                           sapo_temperature_pos=0.7, vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
                           vllm_importance_sampling_clip_max=None)
    trainer.use_vllm = True
    options, reasons = rl_trl.op_options(trainer)
    assert reasons == []
    assert options == dict(loss_type="sapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.1,
                           sapo_temperature_pos=0.7, sapo_temperature_neg=1.05, kl_importance_weighted=True,
                           rollout_correction="token_mask", rollout_mask_bounds=(0.5, math.inf))
    trainer.vllm_importance_sampling_mode = "token_truncate"
    assert rl_trl.op_options(trainer)[1] == ["vllm_importance_sampling_clip_min=0.5 with mode 'token_truncate'",
                                             "vllm_importance_sampling_clip_max=None with mode 'token_truncate'"]
    trainer.vllm_importance_sampling_clip_min = None
    assert rl_trl.op_options(trainer)[1] == ["vllm_importance_sampling_clip_max=None with mode 'token_truncate'"]
    trainer.importance_sampling_level = "sequence"
    assert not any("beta" in r for r in rl_trl.op_options(trainer)[1])  # the KL at sequence level is fused
    trainer.loss_type, trainer.args.delta = "vespo", 1.5  # delta is ppo_clip's only (TRL ignores it elsewhere)
    options = rl_trl.op_options(trainer)[0]
    assert options["loss_type"] == "vespo" and "delta" not in options
    assert {k: options[k] for k in rl_trl._VESPO} == {k: getattr(trainer.args, k) for k in rl_trl._VESPO}
    trainer.loss_type, trainer.entropy_coef, trainer._entropy_bonus_enabled = "sapo", 0.1, True
    assert "an entropy bonus with loss_type='sapo' and beta != 0" in rl_trl.op_options(trainer)[1]
    trainer.beta = 0.0
    options, reasons = rl_trl.op_options(trainer)
    assert options["entropy_coefficient"] == 0.1 and not any("entropy" in r for r in reasons)
    trainer.use_adaptive_entropy, trainer._last_world_entropy = True, math.inf  # TRL's gate: no bonus yet
    assert rl_trl.op_options(trainer)[0]["entropy_coefficient"] == 0.0
    trainer._last_world_entropy = trainer.args.entropy_target
    assert rl_trl.op_options(trainer)[0]["entropy_coefficient"] == 0.1
    trainer.loss_type = "unknown"
    assert rl_trl.op_options(trainer) == ({}, ["loss_type='unknown'"])


FALLBACKS = {  # options without a fused form, and the reason given
    "top_entropy-sequence": (dict(importance_sampling_level="sequence", top_entropy_quantile=0.5),
                             "top_entropy_quantile < 1 with importance_sampling_level='sequence'"),
    "top_entropy-entropy-bonus-kl": (dict(loss_type="bnpo", top_entropy_quantile=0.5, entropy_coef=0.3, beta=0.05),
                                     "top_entropy_quantile < 1 with an entropy bonus and beta != 0"),
    "grpo-entropy-bonus-kl": (dict(loss_type="grpo", entropy_coef=0.3, beta=0.05),
                              "an entropy bonus with loss_type='grpo' and beta != 0"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_unsupported_options_keep_trls_formula(case, caplog):
    """Options without a fused form: the loss is TRL's formula over rl_losses' log-probs, with one warning per
    trainer and reason that names the option and its cost."""
    options, reason = FALLBACKS[case]
    vocab_size = 53
    tok = make_tokenizer(vocab_size)
    torch.manual_seed(1)
    model = saved_model(vocab_size)
    theirs = make_trainer(trl.GRPOTrainer, model, tok, vocab_size, **options)
    ours = make_trainer(rl_trl.GRPOTrainer, model, tok, vocab_size, **options)
    assert reason in ours._rl_losses_fallback
    batch = next(iter(theirs.get_train_dataloader()))
    with caplog.at_level("WARNING", logger=rl_trl.logger.name):
        for step in range(2):
            inputs = []
            for trainer in (theirs, ours):
                torch.manual_seed(7 + step)
                inputs.append(trainer._generate_and_score_completions(batch))
            compare_loss_step(theirs, ours, inputs, step, fused=False)
        warned = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
        assert len(warned) == 1, warned  # once per trainer and reason, not per step
        assert "has no fused form" in warned[0] and rl_trl.FALLBACK_COST in warned[0]
        other = make_trainer(rl_trl.GRPOTrainer, model, tok, vocab_size, **options)
        torch.manual_seed(7)
        other.compute_loss(other.model, other._generate_and_score_completions(batch))
        assert len([r for r in caplog.records if reason in r.getMessage()]) == 2  # a second trainer warns again


def _peak_cpu_bytes(fn):
    """Peak of the CPU memory torch holds while fn runs (tensors alive before it included), from the
    profiler's memory timeline."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(s) for s in sizes)


def test_loss_step_peak_memory(capsys):
    """At V = 32768 the loss step (forward and backward) through rl_losses allocates less than TRL's own."""
    vocab_size, completion = 32768, 48
    tok = make_tokenizer(vocab_size)
    torch.manual_seed(2)
    model = make_model(vocab_size, hidden_size=64)
    peaks, batch, inputs = {}, None, None
    for name, cls in (("trl", trl.GRPOTrainer), ("rl_losses", rl_trl.GRPOTrainer)):
        trainer = make_trainer(cls, copy.deepcopy(model), tok, vocab_size, max_completion_length=completion,
                               num_iterations=2)
        if inputs is None:
            batch = next(iter(trainer.get_train_dataloader()))
            torch.manual_seed(3)
            inputs = trainer._generate_and_score_completions(batch)

        def step(trainer=trainer):
            trainer.compute_loss(trainer.model, inputs).backward()

        step()  # warm-up (lazy initialisations)
        trainer.model.zero_grad(set_to_none=False)
        peaks[name] = _peak_cpu_bytes(step)
    with capsys.disabled():
        print(f"\nGRPO loss step peak CPU memory, V={vocab_size}, {inputs['completion_ids'].shape} completion tokens: "
              + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peaks.items()))
    assert peaks["rl_losses"] < peaks["trl"]
