"""The median time of a call, for the benchmarks that time whole steps (bench_trl_step.py,
bench_token_log_probs.py, bench_head_peers.py, profile_linear.py): CUDA events around each call on a GPU, the host
clock on the CPU (their --dry-run); and the peak memory of a step beyond its inputs and the gradients it returns."""
from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, reps: int, device: str) -> float:
    """Median milliseconds of `reps` calls of fn() (the caller warms up first)."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_beyond_grads_mib(step, params) -> float:
    """MiB of CUDA memory one step() allocates at its peak beyond what was allocated before it (the inputs) and
    the .grad of `params` it leaves (cleared first)."""
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grads = sum(p.grad.nbytes for p in params if p.grad is not None)
    return (torch.cuda.max_memory_allocated() - base - grads) / 2**20
