"""GPU benchmark of the sampler's distribution (docs/consistency.md): each filter's cost beside the plain op, in one
run, for token_log_probs (forward, no gradient: the scoring entry) and GRPO (forward + backward).

    python3 benchmarks/bench_sampler.py --out OUT             # N = 16384, V = 128256, bf16
    python3 benchmarks/bench_sampler.py --dry-run --out /tmp/x   # CPU, small shapes: checks the logic

Per arm: the median ms of CUDA-event-timed calls after warm-up and its ratio to the plain op's; the options:
top_p = 0.9; top_k = 1024; min_p = 0.05; all three; and "kept_ids", the top_k = 1024 set handed over as the
engine's ids (kept_token_log_probs; for GRPO into policy_token_loss, the loss averaged over the tokens). Two kinds of rows: "flat" logits N(0, 2^2), where top_p = 0.9
keeps ~24% of the vocabulary, and "peaked" N(0, 5^2), where a few tokens hold most of the mass (as a language
model's next token mostly does). OUT/bench_sampler.json holds the results.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

import rl_losses
from timing import Timer, git_commit, summary

DATA = {"flat": 2.0, "peaked": 5.0}  # the logits' standard deviation
ARMS = {"plain": {}, "top_p": dict(top_p=0.9), "top_k": dict(top_k=1024), "min_p": dict(min_p=0.05),
        "all": dict(top_k=1024, top_p=0.9, min_p=0.05), "kept_ids": dict(kept_ids="top_k=1024")}


def kept_ids_step(op, logits, target, adv, old):
    kept_ids = logits.topk(1024, -1).indices
    if op == "token_log_probs":
        def step():
            with torch.no_grad():
                rl_losses.kept_token_log_probs(logits, target, kept_ids)
        return step
    x = logits.detach().requires_grad_()

    def step():
        lp, _ = rl_losses.kept_token_log_probs(x, target, kept_ids)
        rl_losses.policy_token_loss(lp, old, adv).loss.mean().backward()
        x.grad = None
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    a = parser.parse_args()
    device = "cpu" if a.dry_run else "cuda"
    n, v = (256, 4000) if a.dry_run else (16384, 128256)
    torch.manual_seed(0)
    target = torch.randint(0, v, (n,), device=device)
    adv, old = torch.randn(n, device=device), -torch.rand(n, device=device)
    timer = Timer(device)
    rows = []
    for data, std in DATA.items():
        logits = (torch.randn(n, v, device=device) * std).to(torch.bfloat16)
        for op in ("token_log_probs", "grpo"):
            plain_ms = None
            for arm, options in ARMS.items():
                if arm == "kept_ids":
                    step = kept_ids_step(op, logits, target, adv, old)
                elif op == "token_log_probs":
                    def step():
                        with torch.no_grad():
                            rl_losses.token_log_probs(logits, target, **options)
                else:
                    x = logits.detach().requires_grad_()

                    def step():
                        rl_losses.grpo_loss(x, target, adv, old, **options).loss.backward()
                        x.grad = None
                for _ in range(3):
                    step()
                timer.sync()
                s = summary(timer(step, a.reps))
                plain_ms = s["ms"] if arm == "plain" else plain_ms
                rows.append(dict(data=data, op=op, arm=arm, options=options, **s,
                                 vs_plain=round(s["ms"] / plain_ms, 3)))
                print(json.dumps(rows[-1]), flush=True)
        del logits
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", n=n, v=v, dtype="bfloat16",
                commit=git_commit(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                command="python3 benchmarks/" + " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]))
    with open(os.path.join(a.out, "bench_sampler.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
