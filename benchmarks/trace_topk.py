"""The GPU timeline of one topk_distillation fwd+bwd beside cross-entropy's: each kernel's start, length and the gap
before it, as CUPTI records them through torch.profiler. Kernel-by-kernel timings (Nsight Compute) serialise the
kernels; this shows how they overlap in a stream (dependent launches, a persistent grid's waves).

    python benchmarks/trace_topk.py [--n 16384 --v 128256 --k 20,256]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import rl_losses


def profiled_events(call, calls: int = 1) -> list[dict]:
    """The trace events (CPU operators, CUDA runtime calls, GPU activities) of `calls` calls of `call`, as
    torch.profiler's Chrome trace holds them."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def timeline(call) -> list[dict]:
    """The GPU activities of the second of two profiled calls (the first warms the profiler's buffers)."""
    events = profiled_events(call, calls=2)
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    return gpu[len(gpu) // 2:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--k", default="20,256")
    args = ap.parse_args()
    x = torch.randn(args.n, args.v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, args.v, (args.n,), device="cuda")
    teacher = torch.randn(args.n, args.v, device="cuda", dtype=torch.bfloat16)
    entries = {}
    for k in map(int, args.k.split(",")):
        top, ids = teacher.topk(k, -1)
        entries[k] = (ids, top.float() - torch.logsumexp(teacher.float(), -1, keepdim=True))
    del teacher

    def call(k: int) -> None:
        x.grad = None
        if k == 0:
            rl_losses.cross_entropy(x, labels).backward()
        else:
            rl_losses.topk_distillation_loss(x, labels, *entries[k], tail="none").loss.backward()

    for k in (0, *entries):
        for _ in range(3):
            call(k)
    torch.cuda.synchronize()
    for k in (0, *entries):
        acts = timeline(lambda: call(k))
        t0 = prev = acts[0]["ts"]
        span = acts[-1]["ts"] + acts[-1]["dur"] - t0
        print(f"== K={k}{' (cross-entropy)' if k == 0 else ''}: {len(acts)} GPU activities, "
              f"first start to last end {span / 1e3:.3f} ms")
        for e in acts:
            print(f"  +{(e['ts'] - t0) / 1e3:7.3f} ms  gap {(e['ts'] - prev) / 1e3:6.3f}  dur {e['dur'] / 1e3:7.3f}  "
                  f"{e['name'][:110]}")
            prev = e["ts"] + e["dur"]


if __name__ == "__main__":
    main()
