"""One GRPO loss step (``compute_loss`` and its backward) through TRL's own GRPOTrainer and through
rl_losses.integrations.trl.GRPOTrainer with each ``lm_head_strategy``, on models built in code from a config
(random weights, a word-level tokenizer made here: nothing is downloaded), one table.

    python3 benchmarks/bench_trl_step.py --out OUT                   # GPU, bf16: the 4 configurations below
    python3 benchmarks/bench_trl_step.py --cpu --out OUT             # CPU, fp32: 1 layer, V=32768, H=64
    python3 benchmarks/bench_trl_step.py --dry-run --out /tmp/x      # CPU, tiny configurations: checks the logic
    python3 benchmarks/bench_trl_step.py --arms trl,rl_losses_fast,rl_losses_fallback --loss-type grpo --cpu ...

Configurations (CONFIGS; Qwen2 architecture): 1 layer, H=2048, V=151936 and 1 layer, H=4096, V=262144, each with
8 sequences of 128 prompt and up to 1024 completion tokens; a Qwen2.5-1.5B-like model (28 layers, H=1536,
V=151936, tied embeddings, gradient checkpointing) and a Qwen2.5-0.5B-like one (24 layers, H=896) with 8 x (256 +
up to 2048). TRL's defaults otherwise: loss_type dapo, num_iterations=1 (on-policy: no old log-probs in the
batch; --loss-type, --num-iterations change them). Arms: TRL's trainer (its own chunked fused head), rl_losses'
with lm_head_strategy "fast" and "lean", and on request rl_losses_fallback (TRL's formula over rl_losses'
per-token log-probs, forced). Per (configuration, arm): the median of CUDA-event-timed steps (timing.median_ms)
after one untimed step, as many as fit in --arm-seconds (2 to --reps), the peak memory beyond the model and the
batch, the loss, and for ours the loss's relative difference from TRL's. Both trainers are real
``trl.GRPOTrainer`` instances on copies of the same weights; the batch is what ``_generate_and_score_completions``
hands the loss, with random completions of random lengths. Writes OUT/bench_trl_step.json and .md. Needs trl,
transformers, datasets (and their small pure-Python dependencies) besides torch and accelerate.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import sys
import tempfile
import time

import torch

from timing import git_commit, median_ms

_1L = dict(layers=1, batch=8, prompt=128, completion=1024, tied=False, checkpointing=False)
_QWEN = dict(vocab=151936, batch=8, prompt=256, completion=2048, tied=True)
CONFIGS = {
    "1 layer, H=2048, V=151936": dict(_1L, vocab=151936, hidden=2048, heads=16, kv_heads=2, intermediate=8192),
    "1 layer, H=4096, V=262144": dict(_1L, vocab=262144, hidden=4096, heads=32, kv_heads=8, intermediate=16384),
    "Qwen2.5-1.5B-like (28 layers, H=1536), checkpointing": dict(_QWEN, layers=28, hidden=1536, heads=12, kv_heads=2,
                                                                  intermediate=8960, checkpointing=True),
    "Qwen2.5-0.5B-like (24 layers, H=896)": dict(_QWEN, layers=24, hidden=896, heads=14, kv_heads=2,
                                                 intermediate=4864, checkpointing=False),
}
CPU = {"1 layer, H=64, V=32768": dict(layers=1, vocab=32768, hidden=64, heads=4, kv_heads=2, intermediate=256,
                                      batch=16, prompt=8, completion=48, tied=False, checkpointing=False)}
DRY = {"1 layer, H=64, V=512": dict(layers=1, vocab=512, hidden=64, heads=4, kv_heads=2, intermediate=128, batch=4,
                                    prompt=8, completion=24, tied=False, checkpointing=False),
       "2 layers, tied, checkpointing": dict(layers=2, vocab=384, hidden=48, heads=4, kv_heads=2, intermediate=96,
                                             batch=4, prompt=8, completion=24, tied=True, checkpointing=True)}
ARMS = ("trl", "rl_losses_fast", "rl_losses_lean", "rl_losses_fallback")


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
                                      intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                      max_position_embeddings=4096, tie_word_embeddings=s["tied"], pad_token_id=0,
                                      eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a 1.5B model's CPU init would take most of a minute)
        return transformers.Qwen2ForCausalLM(config).to(dtype=dtype)


def make_trainer(cls, model, tok, s, args, cpu, **kwargs):
    import datasets
    import trl

    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["batch"],
                            num_generations=s["batch"], max_completion_length=s["completion"],
                            num_iterations=args.num_iterations, loss_type=args.loss_type, report_to=[],
                            use_cpu=cpu, bf16=not cpu, save_strategy="no", seed=0,
                            gradient_checkpointing=s["checkpointing"])
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                  train_dataset=datasets.Dataset.from_dict({"prompt": ["w3 w4"] * s["batch"]}),
                  processing_class=tok, **kwargs)
    trainer.current_gradient_accumulation_steps = 1
    if config.gradient_checkpointing:  # what Trainer.train() does first; compute_loss alone would run without it
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs)
    trainer.model.train()
    return trainer


def make_batch(s, device, num_iterations):
    g = torch.Generator().manual_seed(1)
    b, p, c, v = s["batch"], s["prompt"], s["completion"], s["vocab"]
    lengths = torch.randint(c // 4, c + 1, (b,), generator=g)
    completion_mask = (torch.arange(c) < lengths.unsqueeze(1)).long()
    batch = dict(prompt_ids=torch.randint(3, v, (b, p), generator=g), prompt_mask=torch.ones(b, p, dtype=torch.long),
                 completion_ids=torch.randint(3, v, (b, c), generator=g) * completion_mask,
                 completion_mask=completion_mask, advantages=torch.randn(b, generator=g),
                 num_items_in_batch=completion_mask.sum().float())
    if num_iterations > 1:  # TRL computes the old policy's log-probs only then (without vLLM)
        batch["old_per_token_logps"] = -4 * torch.rand(b, c, generator=g)
    return {k: t.to(device) for k, t in batch.items()}


def arm_trainer(name, model, tok, s, args, cpu):
    import trl

    from rl_losses.integrations import trl as rl_trl

    if name == "trl":
        return make_trainer(trl.GRPOTrainer, model, tok, s, args, cpu)
    strategy = "lean" if name == "rl_losses_lean" else "fast"
    trainer = make_trainer(rl_trl.GRPOTrainer, model, tok, s, args, cpu, lm_head_strategy=strategy)
    if name == "rl_losses_fallback":  # TRL's formula over rl_losses' log-probs, as a fallback runs it
        trainer._fallback_reasons = lambda model: ["benchmarked fallback"]
    return trainer


def run_arm(name, base, tok, s, inputs, args, device):
    trainer = arm_trainer(name, copy.deepcopy(base), tok, s, args, device == "cpu")
    model, losses = trainer.model, []

    def step():
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        losses.append(loss.detach())

    t0 = time.perf_counter()
    step()  # untimed: first-call set-up
    if device == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    reps = max(2, min(args.reps, int(args.arm_seconds / max(first_s, 1e-3))))
    if device == "cuda":
        model.zero_grad(set_to_none=True)
        gc.collect()  # an earlier arm's trainer (reference cycles) must not be freed mid-measurement
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    row = {"ms": round(median_ms(step, reps, device), 3), "steps": reps, "loss": losses[-1].float().item()}
    if device == "cuda":
        row["extra_peak_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
    if name != "trl":
        row["fused"] = trainer._metrics["train"]["rl_losses/fused_loss"][-1]
    return row


def table(rows, arms) -> list[str]:
    """One line per configuration: each arm's ms · extra peak MiB, and ours over TRL's time."""
    head = "| configuration | " + " | ".join(arms) + " | " + " | ".join(f"TRL / {a}" for a in arms if a != "trl")
    out = [head + " |", "|---" * (len(arms) + len([a for a in arms if a != "trl"]) + 1) + "|"]
    for config in dict.fromkeys(r["config"] for r in rows):
        got = {r["provider"]: r for r in rows if r["config"] == config}
        cells = [("–" if got.get(a, {}).get("ms") is None else f"{got[a]['ms']:.1f} ms"
                  + ("" if got[a].get("extra_peak_mib") is None else f" · {got[a]['extra_peak_mib']:.0f} MiB"))
                 if "error" not in got.get(a, {}) else got[a]["error"][:40] for a in arms]
        trl_ms = got.get("trl", {}).get("ms")
        ratios = [f"{trl_ms / got[a]['ms']:.2f}×" if trl_ms and got.get(a, {}).get("ms") else "–"
                  for a in arms if a != "trl"]
        out.append(f"| {config} | " + " | ".join(cells + ratios) + " |")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--configs", default=None, help="comma-separated indices into the configurations (0-based)")
    parser.add_argument("--arms", default="trl,rl_losses_fast,rl_losses_lean", help=f"of {','.join(ARMS)}")
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--arm-seconds", type=float, default=8.0, help="timed steps per arm: as many as fit")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds: no configuration starts past it")
    args = parser.parse_args()
    import trl

    t_start = time.perf_counter()
    cpu = args.dry_run or args.cpu
    device = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    configs = DRY if args.dry_run else CPU if args.cpu else CONFIGS
    if args.configs:
        configs = {k: configs[k] for i, k in enumerate(configs) if str(i) in args.configs.split(",")}
    arms = args.arms.split(",")
    if any(a not in ARMS for a in arms):
        parser.error(f"unknown arms in {arms}; known: {ARMS}")
    meta = {"script": "bench_trl_step.py", "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python3", *sys.argv]), "git": git_commit(), "torch": torch.__version__,
            "trl": trl.__version__, "dtype": str(dtype), "loss_type": args.loss_type, "num_iterations": args.num_iterations}
    rows = []
    os.makedirs(args.out, exist_ok=True)

    def save():  # after each arm: a kill keeps every finished number
        with open(os.path.join(args.out, "bench_trl_step.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    for config, s in configs.items():
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            rows += [{"config": config, "provider": a, "error": "time budget"} for a in arms]
            continue
        tok, base = make_tokenizer(s["vocab"]), make_model(s, dtype, device)
        inputs = make_batch(s, device, args.num_iterations)
        for name in arms:
            row = {"config": config, "provider": name, **{k: s[k] for k in ("layers", "hidden", "vocab")},
                   "tokens": f"{s['batch']} x ({s['prompt']} + {s['completion']})"}
            try:
                row.update(run_arm(name, base, tok, s, inputs, args, device))
            except Exception as e:  # noqa: BLE001  (an arm that fails is reported; the others run)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            trl_row = next((r for r in rows if r["config"] == config and r["provider"] == "trl"), None)
            if name != "trl" and trl_row and "loss" in trl_row and "loss" in row:
                row["loss_rel_diff"] = abs(row["loss"] - trl_row["loss"]) / max(abs(trl_row["loss"]), 1e-30)
            rows.append(row)
            print(config, name, json.dumps({k: v for k, v in row.items() if k not in ("config", "provider")}),
                  flush=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            save()
        del base, inputs
        if device == "cuda":
            torch.cuda.empty_cache()
    save()
    lines = table(rows, arms)
    with open(os.path.join(args.out, "bench_trl_step.md"), "w") as f:
        f.write(f"{meta['device']} · {meta['dtype']} · loss_type {args.loss_type} · num_iterations "
                f"{args.num_iterations} · ms per compute_loss + backward · extra peak MiB\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}/bench_trl_step.json and .md ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
