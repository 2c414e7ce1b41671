"""The median time of a call, for the benchmarks that time whole steps (bench_trl_step.py,
bench_token_log_probs.py): CUDA events around each call on a GPU, the host clock on the CPU (their --dry-run)."""
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
