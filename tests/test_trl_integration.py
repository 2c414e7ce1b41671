"""rl_losses.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer, on a tiny causal LM and a tokenizer
built in code (no download), with a rule-based reward: from the same weights and seed, the generated batch,
the old-policy and reference log-probs, the per-step loss, the gradient of every parameter and TRL's metrics
agree (fp32), for each TRL loss_type the fused loss covers and for importance_sampling_level="sequence"
(GSPO). The loss step's peak memory is measured at a vocabulary where the logits dominate."""
import copy
import tempfile

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from rl_losses.integrations import trl as rl_trl  # noqa: E402

PROMPT_WORDS = 4


def make_tokenizer(vocab_size):
    """A word-level tokenizer over the words w3 ... w{V-1}, built in code."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def saved_model(vocab_size, hidden_size=32):
    """The tiny model saved to a temporary folder: both trainers load it from there, and so does TRL's
    reference model when beta != 0 (it is created from the policy's path)."""
    path = tempfile.mkdtemp()
    make_model(vocab_size, hidden_size).save_pretrained(path)
    return path


def make_model(vocab_size, hidden_size=32):
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def reward_words(completions, **kwargs):
    """Rule-based: the words' ids modulo 7, summed (any spread of rewards within a group will do)."""
    return [float(sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit())) for c in completions]


def make_trainer(cls, model, tok, vocab_size, **options):
    prompts = [" ".join(f"w{(7 * i + j) % (vocab_size - 3) + 3}" for j in range(PROMPT_WORDS)) for i in range(16)]
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=options.pop("max_completion_length", 6), report_to=[],
                          use_cpu=True, bf16=False, save_strategy="no", seed=0, temperature=0.9, **options)
    trainer = cls(model=model, reward_funcs=reward_words, args=args,
                  train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    # Set by Trainer.train(); the steps here are driven by hand, in training mode.
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def assert_rel_close(actual, expected, name, rtol=1e-5):
    scale = max(expected.abs().max().item(), 1e-12)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=rtol, atol=rtol, msg=lambda m: f"{name}: {m}")


CASES = {
    # loss_type, importance_sampling_level, beta, num_iterations (2: old log-probs reused after an update)
    "grpo-on-policy": ("grpo", "token", 0.0, 1),
    "grpo-kl": ("grpo", "token", 0.05, 2),
    "bnpo": ("bnpo", "token", 0.0, 2),
    "dr_grpo": ("dr_grpo", "token", 0.0, 2),
    "dapo-delta": ("dapo", "token", 0.0, 2),
    "gspo": ("grpo", "sequence", 0.0, 2),
    "luspo-gspo": ("luspo", "sequence", 0.0, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl(case):
    loss_type, level, beta, iterations = CASES[case]
    vocab_size = 97
    tok = make_tokenizer(vocab_size)
    torch.manual_seed(0)
    model = saved_model(vocab_size)
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, num_iterations=iterations,
                   epsilon=0.1, epsilon_high=0.15, delta=1.3 if case == "dapo-delta" else None)
    if beta:
        options["use_bias_correction_kl"] = False  # TRL's default (True) weights k3 by the ratio: not fused here
    theirs = make_trainer(trl.GRPOTrainer, model, tok, vocab_size, **options)
    ours = make_trainer(rl_trl.GRPOTrainer, model, tok, vocab_size, **options)
    assert ours._rl_losses_fallback is None, ours._rl_losses_fallback
    batch = next(iter(theirs.get_train_dataloader()))
    clipped = 0.0
    for step in range(3):
        if step != 1 or iterations == 1:  # step 1 of num_iterations=2 reuses step 0's batch after an update
            inputs = []
            for trainer in (theirs, ours):
                torch.manual_seed(100 + step)
                inputs.append(trainer._generate_and_score_completions(batch))
            for key in ("completion_ids", "completion_mask", "advantages"):
                torch.testing.assert_close(inputs[1][key], inputs[0][key])
            for key in ("old_per_token_logps", "ref_per_token_logps"):
                assert (inputs[0].get(key) is None) == (inputs[1].get(key) is None), key
                if inputs[0].get(key) is not None:
                    assert_rel_close(inputs[1][key], inputs[0][key], key)
        losses = []
        for trainer, x in zip((theirs, ours), inputs):
            trainer.model.zero_grad()
            loss = trainer.compute_loss(trainer.model, x)
            loss.backward()
            losses.append(loss.detach())
        assert ours._metrics["train"]["rl_losses/fused_loss"][-1] == 1.0
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)
        for (name, p), q in zip(theirs.model.named_parameters(), ours.model.parameters()):
            assert_rel_close(q.grad, p.grad, f"step {step}: grad of {name}")
        for name in ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                     "clip_ratio/low_min", "clip_ratio/high_max"):
            if name in theirs._metrics["train"]:
                expected = theirs._metrics["train"][name][-1]
                assert ours._metrics["train"][name][-1] == pytest.approx(expected, rel=1e-5, abs=1e-6), name
        clipped += theirs._metrics["train"]["clip_ratio/region_mean"][-1]
        with torch.no_grad():  # the same update on both: large enough that the reused batch's ratios clip
            for p, q in zip(theirs.model.parameters(), ours.model.parameters()):
                p -= 2.0 * p.grad
                q.copy_(p)
    if iterations > 1:
        assert clipped > 0, "the test never reached the clipped region"


def test_unsupported_options_keep_trls_formula():
    """loss_type='sapo' has no fused form here: the loss is TRL's formula over rl_losses' log-probs."""
    vocab_size = 53
    tok = make_tokenizer(vocab_size)
    torch.manual_seed(1)
    model = make_model(vocab_size)
    theirs = make_trainer(trl.GRPOTrainer, copy.deepcopy(model), tok, vocab_size, loss_type="sapo")
    ours = make_trainer(rl_trl.GRPOTrainer, copy.deepcopy(model), tok, vocab_size, loss_type="sapo")
    assert "loss_type='sapo'" in ours._rl_losses_fallback
    batch = next(iter(theirs.get_train_dataloader()))
    losses = []
    for trainer in (theirs, ours):
        torch.manual_seed(7)
        x = trainer._generate_and_score_completions(batch)
        loss = trainer.compute_loss(trainer.model, x)
        loss.backward()
        losses.append(loss.detach())
    assert ours._metrics["train"]["rl_losses/fused_loss"][-1] == 0.0
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)
    for (name, p), q in zip(theirs.model.named_parameters(), ours.model.parameters()):
        assert_rel_close(q.grad, p.grad, f"grad of {name}")


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
