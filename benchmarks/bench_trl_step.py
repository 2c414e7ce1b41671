"""GPU benchmark of one GRPO loss step (forward and backward) through TRL's own GRPOTrainer._compute_loss and
through rl_losses.integrations.trl.GRPOTrainer, on a 1-layer model built from a config with a real
vocabulary (V=151936, bf16) and a realistic completion batch.

    python3 benchmarks/bench_trl_step.py --out OUT                   # GPU: B=8, prompt 128, completion 1024
    python3 benchmarks/bench_trl_step.py --cpu --out OUT             # CPU, fp32: V=32768, B=16, completion 48
    python3 benchmarks/bench_trl_step.py --dry-run --out /tmp/x      # CPU, tiny shapes: checks the logic

Per configuration (CASES: loss types, and the masks that need every token's log-prob or entropy first) three
paths: TRL's trainer, rl_losses' fused loss, and rl_losses' trainer made to keep TRL's formula (its fallback:
TRL's loss over rl_losses' per-token log-probs), whose ratio to the fused step is the fallback's cost.

Both trainers are real ``trl.GRPOTrainer`` instances (the same weights, a tokenizer built in code, a rule-based
reward); the batch is what ``_generate_and_score_completions`` hands to the loss (prompt/completion ids and
masks, per-sequence advantages, the old policy's log-probs of num_iterations > 1), made here with random
completions of random lengths. Reported per loss_type: median ms of CUDA-event-timed steps after warm-up, the
extra peak memory over the model and the batch, the loss of both (they must agree), and the speed-up and memory
ratio. OUT/bench_trl_step.json holds the results. Needs trl and datasets (and their small pure-Python
dependencies) besides torch, transformers and accelerate.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile

import torch

from timing import median_ms

HEADLINE = dict(vocab=151936, hidden=2048, heads=16, kv_heads=2, batch=8, prompt=128, completion=1024)
CPU = dict(vocab=32768, hidden=64, heads=4, kv_heads=2, batch=16, prompt=8, completion=48)
DRY = dict(vocab=512, hidden=64, heads=4, kv_heads=2, batch=4, prompt=8, completion=24)
CASES = {  # GRPOConfig options of each measured configuration
    "grpo": dict(loss_type="grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "grpo-top_entropy_quantile": dict(loss_type="grpo", top_entropy_quantile=0.5),
    "dapo-off_policy_mask_threshold": dict(loss_type="dapo", off_policy_mask_threshold=0.5),
}


def make_tokenizer(vocab_size):
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def make_model(s, dtype, device):
    import transformers

    config = transformers.Qwen2Config(vocab_size=s["vocab"], hidden_size=s["hidden"],
                                      intermediate_size=4 * s["hidden"], num_hidden_layers=1,
                                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                      max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
                                      eos_token_id=1)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(device=device, dtype=dtype)


def make_trainer(cls, model, tok, s, options, cpu):
    import datasets
    import trl

    options = dict(epsilon_high=0.28) | options
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["batch"],
                          num_generations=s["batch"], max_completion_length=s["completion"], num_iterations=2,
                          report_to=[], use_cpu=cpu, bf16=not cpu, save_strategy="no", seed=0, **options)
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                  train_dataset=datasets.Dataset.from_dict({"prompt": ["w3 w4"] * s["batch"]}),
                  processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def make_batch(s, device):
    g = torch.Generator().manual_seed(1)
    b, p, c, v = s["batch"], s["prompt"], s["completion"], s["vocab"]
    lengths = torch.randint(c // 4, c + 1, (b,), generator=g)
    completion_mask = (torch.arange(c) < lengths.unsqueeze(1)).long()
    batch = dict(prompt_ids=torch.randint(3, v, (b, p), generator=g), prompt_mask=torch.ones(b, p, dtype=torch.long),
                 completion_ids=torch.randint(3, v, (b, c), generator=g) * completion_mask,
                 completion_mask=completion_mask, advantages=torch.randn(b, generator=g),
                 old_per_token_logps=-4 * torch.rand(b, c, generator=g),
                 num_items_in_batch=completion_mask.sum().float())
    return {k: t.to(device) for k, t in batch.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    import trl

    from rl_losses.integrations import trl as rl_trl

    cpu = args.dry_run or args.cpu
    device = "cpu" if cpu else "cuda"
    s = DRY if args.dry_run else CPU if args.cpu else HEADLINE
    dtype = torch.float32 if cpu else torch.bfloat16
    tok = make_tokenizer(s["vocab"])
    base = make_model(s, dtype, device)
    inputs = make_batch(s, device)
    results = {"shape": s, "dtype": str(dtype), "trl": trl.__version__,
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    paths = (("trl", trl.GRPOTrainer), ("rl_losses", rl_trl.GRPOTrainer), ("rl_losses_fallback", rl_trl.GRPOTrainer))
    for case, options in CASES.items():
        entry = {}
        for name, cls in paths:
            trainer = make_trainer(cls, copy.deepcopy(base), tok, s, options, cpu)
            if name == "rl_losses_fallback":  # TRL's formula over rl_losses' log-probs, as a fallback runs it
                trainer._fallback_reasons = lambda model: ["benchmarked fallback"]
            model = trainer.model
            losses = []

            def step(trainer=trainer, model=model, losses=losses):
                model.zero_grad(set_to_none=True)
                loss = trainer.compute_loss(model, inputs)
                loss.backward()
                losses.append(loss.detach())

            for _ in range(2):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
                model.zero_grad(set_to_none=True)
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            ms = median_ms(step, args.reps, device)
            entry[name] = {"ms": ms, "loss": losses[-1].float().item()}
            if device == "cuda":
                entry[name]["extra_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
            if name != "trl":
                entry[name]["fused"] = trainer._metrics["train"]["rl_losses/fused_loss"][-1]
            del trainer, model
            if device == "cuda":
                torch.cuda.empty_cache()
        entry["speedup"] = entry["trl"]["ms"] / entry["rl_losses"]["ms"]
        entry["fallback_cost"] = entry["rl_losses_fallback"]["ms"] / entry["rl_losses"]["ms"]
        if device == "cuda":
            entry["memory_ratio"] = entry["rl_losses"]["extra_peak_mib"] / entry["trl"]["extra_peak_mib"]
        entry["loss_rel_diff"] = max(abs(entry[n]["loss"] - entry["trl"]["loss"]) for n in ("rl_losses",
                                     "rl_losses_fallback")) / max(abs(entry["trl"]["loss"]), 1e-30)
        results[case] = entry
        print(case, json.dumps(entry))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_trl_step.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
