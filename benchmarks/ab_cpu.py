"""Two or more builds of the CPU kernels timed side by side: before/after on a machine whose cores other work shares.

    python benchmarks/ab_cpu.py --builds main=/path/a/python,new=/path/b/python [--ops gspo_2048,ce,grpo]
                                [--eager] [--rounds 3] [--reps 5]

Each build is a folder holding an `rl_losses` package (with its `_C` library) put first on PYTHONPATH. Every
(build, op, provider) runs in a fresh subprocess through `bench_cpu.py --worker` (its warm-up, median of --reps),
the builds alternating within each round and in reverse order every other round, so that a change in the
machine's load between rounds reaches every build alike; --eager adds eager PyTorch once per round (with the
first build's package). Prints each run with the load average, then the median over the rounds and the ratios
to eager PyTorch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_cpu.py")


def run_one(path: str, op: str, provider: str, args) -> dict:
    cmd = [sys.executable, BENCH, "--worker", op, provider, "--n", str(args.n), "--v", str(args.v), "--reps",
           str(args.reps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", required=True, help="name=folder,... (each folder holds an rl_losses package)")
    ap.add_argument("--ops", default="gspo_2048")
    ap.add_argument("--eager", action="store_true", help="also eager PyTorch, once per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--v", type=int, default=32000)
    args = ap.parse_args(argv)
    builds = [b.split("=", 1) for b in args.builds.split(",")]
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for op in args.ops.split(","):
            jobs = [(name, path, "rl_losses") for name, path in builds]
            jobs += [("eager", builds[0][1], "torch_eager")] if args.eager else []
            for name, path, provider in jobs[::-1] if r % 2 else jobs:
                out = run_one(path, op, provider, args)
                if "ms" not in out:
                    print(f"round {r} {op} {name}: {out.get('error')}", flush=True)
                    continue
                times.setdefault((op, name), []).append(out["ms"])
                print(f"round {r} {op:10s} {name:8s} {out['ms']:8.1f} ms  loss {out['loss']:.6g}  "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    print("\nmedian over rounds:")
    for (op, name), t in times.items():
        eager = times.get((op, "eager"))
        ratio = f"  eager / this {statistics.median(eager) / statistics.median(t):.2f}x" if eager else ""
        print(f"{op:10s} {name:8s} {statistics.median(t):8.1f} ms  rounds {t}{ratio if name != 'eager' else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
