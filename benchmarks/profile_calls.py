"""Where the time of one loss call goes on a GPU: the kernels it launches (name, count, device time), the
host's time per call, and the fixed cost of an empty chain of as many launches.

    python3 benchmarks/profile_calls.py [--shapes 4096x32000,16384x128256] [--ops ce,grpo,gspo_2048] [--divisor]

Each op runs fwd+bwd as bench_gpu.py runs it (rl_losses provider, bf16). Per (op, shape):
  kernels   the CUDA kernels of one call (torch.profiler, the median of 10 profiled calls' durations);
  device    the median CUDA-event time of one call with the host ahead (the stream held first);
  host      the host's time per call while queueing (no synchronisation inside);
  chain     the device time of an empty chain of the same number of launches (1-element adds): the floor
            below which a call of that many kernels cannot go, whatever the bytes;
  synced    the wall time of a lone call (device idle before, waited for after);
  host self time by operator and runtime call (torch.profiler, CPU activity).
Kernel durations are taken with dependent launches on: a kernel that starts early and waits for the one
before it reports its wait too, so they overlap and do not add up to the call's time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402
from timing import Timer  # noqa: E402


TIMER = Timer("cuda")


def device_ms(fn, reps: int = 30) -> float:
    """The median device time of one call with the host ahead (timing.Timer)."""
    return statistics.median(TIMER(fn, reps))


def host_us(fn, reps: int = 50) -> float:
    """The host's time per call while the device is held busy (its queue never full)."""
    torch.cuda.synchronize()
    TIMER.hold(50.0)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    out = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    return out


def kernels_of(fn, calls: int = 10) -> list[tuple[str, int, float]]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name and not e.name.startswith("cuda"):
            per_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    rows = [(name, len(ts) / calls, statistics.median(ts)) for name, ts in per_name.items()]
    return sorted(rows, key=lambda r: -r[1] * r[2])


def host_breakdown(fn, calls: int = 20, top: int = 12) -> list[tuple[str, float, int]]:
    """The host's self time per call by operator / runtime API (torch.profiler, CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    TIMER.hold(50.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    rows = [(e.key, e.self_cpu_time_total / calls, e.count // calls) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def synced_ms(fn, reps: int = 30) -> float:
    """Wall time of one call with the device idle before it and waited for after it (as triton's do_bench
    or a lone call measures it): the host's cost shows wherever it exceeds the device's."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def empty_chain_ms(k: int) -> float:
    x = torch.zeros(1, device="cuda")

    def chain():
        for _ in range(k):
            x.add_(1)

    return device_ms(chain)


# A case meets its target at >= TARGET_PCT% of the copy ceiling, or when its time beyond the copy of its
# minimal bytes is within TARGET_CHAIN_US of the device time of an empty chain of as many launches as it makes
# (bench_gpu.py --grid).
TARGET_PCT, TARGET_CHAIN_US = 85.0, 5.0
_chain_us: dict[int, float] = {}


def add_launches(row: dict, step, ceiling_gbps: float) -> None:
    """The kernels of one call (torch.profiler), the device time of an empty chain of as many launches (measured
    once per count), the call's time beyond the copy of its minimal bytes, and whether the case meets its target
    (TARGET_PCT of the ceiling, or within TARGET_CHAIN_US of the empty chain)."""
    k = round(sum(count for _, count, _ in kernels_of(step, calls=1)))
    if k not in _chain_us:
        _chain_us[k] = empty_chain_ms(k) * 1e3
    beyond = row["ms"] * 1e3 - row["min_bytes"] / ceiling_gbps / 1e3
    row.update(kernels=k, chain_us=round(_chain_us[k], 1), beyond_copy_us=round(beyond, 1))
    if row["pct_ceiling"] >= TARGET_PCT:
        row["target"] = f">= {TARGET_PCT:.0f}%"
    elif beyond <= _chain_us[k] + TARGET_CHAIN_US:
        row["target"] = "launch chain"
    else:
        row["target"] = "missed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x32000,16384x128256")
    ap.add_argument("--ops", default="ce,grpo,gspo_2048")
    ap.add_argument("--divisor", action="store_true",
                    help="CE and GRPO with a given divisor (static sizes, as GSPO's num_documents and divisor)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__}")
    provider = cases.RlLosses(static_divisor=args.divisor)
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split("x"))
        for name in args.ops.split(","):
            op = cases.OPS[name]
            s = provider.prepare(op, cases.make_inputs(op, n, v, torch.bfloat16, dev, seed=0))

            def step():
                provider.loss(op, s, cases.head_output(s["base"])).backward()

            for _ in range(3):
                step()
            ks = kernels_of(step)
            n_launch = round(sum(c for _, c, _ in ks))
            print(f"\n== {name} {n}x{v}: device {device_ms(step):.3f} ms | host {host_us(step):.0f} us/call | "
                  f"{n_launch} kernels | empty chain of {n_launch}: {empty_chain_ms(n_launch) * 1e3:.1f} us")
            print(f"   synced (device idle before, waited after): {synced_ms(step):.3f} ms")
            for kname, count, us in ks:
                print(f"   {count:4.1f} x {us:9.1f} us  {kname[:150]}")
            print("   host self time per call:")
            for key, us, count in host_breakdown(step):
                print(f"   {us:8.1f} us  {count:3d} x  {key[:120]}")
            del s
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
