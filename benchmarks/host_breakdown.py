"""Where a tiny call's host time goes on this machine: per-call host time of the raw ops (forward + backward, and the
forward alone under no_grad) beside PyTorch's smallest autograd step, an add_ and an empty, with CPU tensors and with
CUDA tensors on the same host (CPU tensors only where there is no GPU); then every CUDA runtime call one op call makes
(CUPTI through torch.profiler).

    python3 benchmarks/host_breakdown.py
"""
from __future__ import annotations

import collections
import os
import sys
import time

import torch

import rl_losses  # noqa: F401  (the ops)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_topk import profiled_events  # noqa: E402

ops = torch.ops.rl_losses


def host_us(fn, device: str, calls: int = 3000, rounds: int = 3) -> float:
    """The best of `rounds` means of the host's µs per call. On CUDA a synchronisation every 64 calls (inside the
    timing, as host_time.py) keeps CUDA's queue of pending launches from filling."""
    for _ in range(300):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            fn()
            if i % 64 == 63 and device == "cuda":
                torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def probes(device: str) -> dict:
    """The timed calls at 8 x 64 rows: the raw ops with and without autograd, and PyTorch's own small calls."""
    x = torch.randn(8, 64, device=device, requires_grad=True)
    xd = x.detach().clone()
    t = torch.randint(0, 64, (8,), device=device)
    adv, old = torch.randn(8, device=device), torch.randn(8, device=device)
    # Two documents of four rows; their count given, as a trainer knows it (no max() read back).
    docs = torch.arange(8, device=device) // 4

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    return {"ce_fb": lambda: ops.cross_entropy(x, t)[0].backward(),
            "grpo_fb": lambda: ops.grpo(x, t, adv, old)[0].backward(),
            "gspo_fb": lambda: ops.gspo(x, t, adv, old, docs, num_documents=2)[0].backward(),
            "ce_no_grad": no_grad(lambda: ops.cross_entropy(xd, t)),
            "ce_sum_no_grad": no_grad(lambda: ops.cross_entropy(xd, t, reduction="sum")),
            "grpo_no_grad": no_grad(lambda: ops.grpo(xd, t, adv, old)),
            "gspo_no_grad": no_grad(lambda: ops.gspo(xd, t, adv, old, docs, num_documents=2)),
            "torch_floor_fb": lambda: (x * 2).sum().backward(),
            "add_": lambda: xd.add_(1),
            "empty": lambda: torch.empty(8, device=device)}


def runtime_calls(fn, calls: int = 20) -> list[tuple[str, str, float, float]]:
    """(category, name, count per call, mean µs) of the CPU operators and CUDA runtime calls of `calls` profiled
    calls, those made at least once a call, the longest in total first."""
    seen = collections.defaultdict(lambda: [0, 0.0])
    for e in profiled_events(fn, calls):
        if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op"):
            seen[(e["cat"], e["name"])][0] += 1
            seen[(e["cat"], e["name"])][1] += e.get("dur", 0)
    rows = [(cat, name, k / calls, d / k) for (cat, name), (k, d) in seen.items() if k >= calls]
    return sorted(rows, key=lambda r: -r[2] * r[3])


def main() -> None:
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        calls = probes(device)
        print(f"== {device}: host us/call (best of 3 rounds of 3000)")
        for name, fn in calls.items():
            print(f"  {name:18s} {host_us(fn, device):8.1f}")
        if device == "cuda":
            for name in ("ce_no_grad", "grpo_no_grad", "gspo_no_grad", "ce_fb", "grpo_fb"):
                print(f"-- {name}: calls per op call (x20 calls), mean us (profiled)")
                for cat, op, per_call, us in runtime_calls(calls[name]):
                    print(f"  {cat:12s} {per_call:5.1f} x {us:7.2f} us  {op[:80]}")


if __name__ == "__main__":
    main()
