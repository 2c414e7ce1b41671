"""The one timer and the one copy ceiling of every benchmark script.

Timer: the milliseconds of each of `reps` calls. On a GPU, CUDA events around each call with the host ahead of the
device, as in a training step (the model's forward has queued work before the loss is called): the stream is first
held by a sleep kernel long enough for the host to queue all `reps` calls, so that the events time the device work
of each call, not the Python and launch overhead around it. A call that synchronises with the host still waits, as
it would in training. `host_ms`: the host's time per call while queueing. On the CPU (the dry runs): the host clock.
copy_ceiling: the device-to-device copy bandwidth, bytes read + written over the median time, timed by the same
Timer: the memory ceiling every "% of the ceiling" divides by. peak_beyond_grads_mib: the peak memory of a step beyond
its inputs and the gradients it returns.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import torch


class Timer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.host_ms = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def event(self):
        """A time mark on the device's stream (the host clock on the CPU); elapsed() of two marks in ms."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def hold(self, ms: float) -> None:
        """Keeps the device busy for about `ms` (a sleep kernel), so that the host queues what follows ahead of it."""
        if self.cuda:
            torch.cuda._sleep(int(min(ms, 2000.0) * self.cycles_per_ms()))

    def __call__(self, fn, reps: int, before=None) -> list[float]:
        """Milliseconds of each of `reps` calls of fn (the caller warms up first); `before`, when given, runs ahead
        of each call, outside its timing (restoring inputs)."""
        if not self.cuda:
            out = []
            for _ in range(reps):
                if before is not None:
                    before()
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # one call's host time, to size the sleep
        one_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        self.hold(2.0 * reps * one_ms + 1.0)
        t = time.perf_counter()
        for s, e in zip(starts, ends):
            if before is not None:
                before()
            s.record()
            fn()
            e.record()
        self.host_ms = (time.perf_counter() - t) * 1e3 / reps
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    _cycles_per_ms = None

    @classmethod
    def cycles_per_ms(cls) -> float:
        """Clock cycles of torch.cuda._sleep per millisecond, measured once."""
        if cls._cycles_per_ms is None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(10_000_000)
            b.record()
            torch.cuda.synchronize()
            cls._cycles_per_ms = 10_000_000 / a.elapsed_time(b)
        return cls._cycles_per_ms


def summary(times: list[float]) -> dict:
    """The median and the 20th / 80th percentiles of a list of milliseconds."""
    s = sorted(times)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return dict(ms=round(statistics.median(s), 4), ms_p20=round(q(0.2), 4), ms_p80=round(q(0.8), 4), reps=len(s))


def median_ms(fn, reps: int, device) -> float:
    """Median milliseconds of `reps` calls of fn() (the caller warms up first)."""
    return statistics.median(Timer(device)(fn, reps))


def copy_ceiling(device, timer: Timer, nbytes: int, reps: int = 30) -> dict:
    """Device-to-device copy bandwidth, bytes read + written over the median time (the memory ceiling)."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)  # random, never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    timer.sync()
    ms = statistics.median(timer(lambda: dst.copy_(src), reps))
    return {"bytes": nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6}


def git_commit() -> str | None:
    """The commit the numbers are of: RL_LOSSES_GIT when set (a copy of the tree whose .git lags it, as on a remote
    machine, must be told), else this checkout's HEAD."""
    if os.environ.get("RL_LOSSES_GIT"):
        return os.environ["RL_LOSSES_GIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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


def write_results(out_dir: str, name: str, results: dict) -> None:
    """results as out_dir/name (indented JSON), and printed."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
