"""The TRL drop-in's tests' shared pieces: a tiny causal LM and a word-level tokenizer built in code (no
download), a rule-based reward, the two trainers from the same weights, and the comparison of one loss step
(loss, every parameter's gradient, TRL's metrics) between TRL's GRPOTrainer and rl_losses'."""
import math
import tempfile

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

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
    options = dict(max_completion_length=6, bf16=False) | options
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=4,
                          report_to=[], use_cpu=True, save_strategy="no", seed=0, temperature=0.9, **options)
    trainer = cls(model=model, reward_funcs=reward_words, args=args,
                  train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    # Set by Trainer.train(); the steps here are driven by hand, in training mode.
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def assert_rel_close(actual, expected, name, rtol=1e-5):
    scale = max(expected.abs().max().item(), 1e-12)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=rtol, atol=rtol, msg=lambda m: f"{name}: {m}")


METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean", "policy_loss",
           "entropy_coef")


def simulate_vllm(trainer, inputs, generator):
    """What TRL's trainer adds to the batch when the completions come from vLLM with the importance-sampling
    correction on: the engine's log-probs ``sampling_per_token_logps`` (here the old log-probs plus noise, one
    of them NaN, as an engine that returns none for a token) and the ratio ``importance_sampling_ratio`` that
    TRL's _generate_and_score_completions computes from them; then the trainer is switched to vLLM mode."""
    old, mask = inputs["old_per_token_logps"], inputs["completion_mask"]
    sampling = old + 0.3 * torch.randn(old.shape, generator=generator, dtype=old.dtype)
    sampling[0, 0] = float("nan")
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    mode, low, high = (trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
                       trainer.vllm_importance_sampling_clip_max)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=low, max=high)
    else:
        ratio = ratio.masked_fill((ratio < (-math.inf if low is None else low)) |
                                  (ratio > (math.inf if high is None else high)), 0.0)
    trainer.use_vllm = True
    return dict(inputs, sampling_per_token_logps=sampling, importance_sampling_ratio=ratio)




def compare_loss_step(theirs, ours, inputs, step="", rtol=1e-5, fused=True):
    """One loss step (forward and backward) on each trainer's inputs: ours took the fused path (or, `fused`
    False, TRL's formula), and the loss, every parameter's gradient and TRL's metrics agree. Returns TRL's
    loss."""
    losses = []
    for trainer, x in zip((theirs, ours), inputs):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, x)
        loss.backward()
        losses.append(loss.detach())
    assert ours._metrics["train"]["rl_losses/fused_loss"][-1] == float(fused)
    torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=rtol / 10)
    for (name, p), q in zip(theirs.model.named_parameters(), ours.model.parameters()):
        assert_rel_close(q.grad, p.grad, f"step {step}: grad of {name}", rtol=rtol)
    for name in METRICS:
        assert (name in theirs._metrics["train"]) == (name in ours._metrics["train"]), name
        if name in theirs._metrics["train"]:
            expected = theirs._metrics["train"][name][-1]
            assert ours._metrics["train"][name][-1] == pytest.approx(expected, rel=rtol, abs=rtol / 10), name
    return losses[0]


class FakeVLLM:
    """Stands in for TRL's VLLMGeneration (``trainer.vllm_generation``), so that TRL's own generation step
    computes the engine's log-probs, the old log-probs and the importance-sampling ratio: each completion is
    random words (EOS-terminated when shorter than the limit), its log-probs the trainer's model's at the
    sampling temperature plus N(0, noise²), the first one None (a token the engine did not score)."""

    def __init__(self, trainer, seed, noise=0.3):
        self.trainer, self.generator, self.noise = trainer, torch.Generator().manual_seed(seed), noise

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        trainer, g = self.trainer, self.generator
        vocab, limit = trainer.model.config.vocab_size, trainer.max_completion_length
        completions, logprobs = [], []
        for prompt in prompts:
            length = int(torch.randint(2, limit + 1, (1,), generator=g))
            ids = torch.randint(3, vocab, (length,), generator=g).tolist()
            if length < limit:
                ids[-1] = 1  # EOS
            with torch.no_grad():
                logits = trainer.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
            lp = torch.log_softmax(logits.float() / trainer.temperature, -1).gather(-1, torch.tensor(ids)[:, None])
            lp = (lp[:, 0] + self.noise * torch.randn(length, generator=g)).tolist()
            logprobs.append([[None if i == 0 else x] for i, x in enumerate(lp)])
            completions.append(ids)
        return prompts, completions, logprobs, None
