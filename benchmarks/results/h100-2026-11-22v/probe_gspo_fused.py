"""GSPO fwd+bwd under settings of the fused form's knobs (csrc/gspo/gspo_cuda.cu), side by side in one process.

    python3 benchmarks/probe_gspo_fused.py --docs 64,2048 \
        --settings "FUSED=0" "FUSED=1" "FUSED=1,HINTS=1" "FUSED=1,TILE=16384,LAG=100"

Each setting is a comma list of RL_LOSSES_GSPO_<KEY>=<value> (read by the op at each call). Prints the median
ms over --reps CUDA-event-timed calls (after warm-up) per (documents, setting), and the copy ceiling measured
in the same process, with each time as % of GSPO's 3-pass floor (3·N·V·bytes at the ceiling's rate).
--once: one call per case (for a profiler).
"""
import argparse
import os

import torch

import rl_losses


def copy_rate(gib=1.0, reps=20):
    """Device-to-device copy, read + write bytes per second (median)."""
    a = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / sorted(times[3:])[len(times[3:]) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--docs", default="64,2048", help="tokens per document")
    ap.add_argument("--settings", nargs="+", default=["FUSED=0", "FUSED=1"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args()
    n, v = args.n, args.v
    torch.manual_seed(0)
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    adv = torch.randn(n, device="cuda")
    old = torch.randn(n, device="cuda") * 0.1 - 12.0
    ceiling = None if args.once else copy_rate()
    floor_bytes = 3 * n * v * logits.element_size()
    if ceiling:
        print(f"copy ceiling {ceiling / 1e9:.0f} GB/s; 3-pass floor {floor_bytes / ceiling * 1e3:.3f} ms")
    for length in (int(x) for x in args.docs.split(",")):
        doc = torch.arange(n, device="cuda") // length
        n_docs = (n + length - 1) // length

        def call():
            out = rl_losses.gspo_loss(logits, target, adv, old, doc, num_documents=n_docs)
            out.loss.backward()
            logits.grad = None

        for setting in args.settings:
            keys = [f"RL_LOSSES_GSPO_{kv.split('=')[0]}" for kv in setting.split(",")]
            for kv, key in zip(setting.split(","), keys):
                os.environ[key] = kv.split("=", 1)[1]
            if args.once:
                call()
                torch.cuda.synchronize()
            else:
                times = []
                for i in range(args.reps + 3):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    call()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e))
                ms = sorted(times[3:])[len(times[3:]) // 2]
                print(f"docs {length:5d} | {setting:32s} | {ms:.3f} ms | {floor_bytes / ceiling * 1e3 / ms * 100:5.1f}% "
                      f"of floor | min {min(times[3:]):.3f}", flush=True)
            for key in keys:
                del os.environ[key]


if __name__ == "__main__":
    main()
