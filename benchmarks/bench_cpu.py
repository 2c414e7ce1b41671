"""CPU section of the benchmark: the C++ CPU kernels against eager PyTorch, fwd+bwd, fp32.

    python benchmarks/bench_cpu.py [--n 2048 --v 32000 --ops ce,grpo,... --out DIR]

Each (op, provider) runs in a fresh subprocess, so that its peak memory can be read off the process's
resident-set high-water mark (getrusage ru_maxrss), which sees every allocation torch makes on the CPU:
    extra peak = maxrss after the first full fwd+bwd - resident set just before it (inputs allocated and
    written, a tiny warm-up of the same op already run so one-time set-up is excluded).
It is exact when the run raises the high-water mark (the usual case: every N x V buffer is mmap'ed by glibc
and returned on free, so the mark is the live peak); otherwise it is an upper bound, flagged "<=". The
gradient handed back (cases.GradSink) counts, as on the GPU. Time: the median of --reps runs after
--warmup, host clock (perf_counter), torch's intra-op threads (--threads, default torch's). Every provider's
loss and first gradient rows are checked against the first provider's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402
from timing import Timer  # noqa: E402

PROVIDERS = {"ce": ["rl_losses", "rl_losses_inplace", "torch_eager", "reference"]}
DEFAULT_PROVIDERS = ["rl_losses", "rl_losses_inplace", "torch_eager"]  # torch_eager = reference for GRPO/GSPO


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(args) -> dict:
    """One (op, provider) in this process: memory of the first full call, then the timing."""
    op = cases.OPS[args.op]
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {"op": args.op, "provider": args.provider, "n": args.n, "v": args.v, "threads": torch.get_num_threads()}
    provider = cases.build_provider(args.provider)

    def run(s):
        cases.GradSink.last = None
        loss = provider.loss(op, s, cases.head_output(s["base"]))
        loss.backward()
        return float(loss)

    # Tiny warm-up of the same op: loads kernels, starts the thread pool, fills dispatcher caches.
    small = min(op.seq_len, 64)
    run(provider.prepare(op, cases.make_inputs(op, small, 512, torch.float32, "cpu", 1, small)))
    s = provider.prepare(op, cases.make_inputs(op, args.n, args.v, torch.float32, "cpu", args.seed,
                                               min(op.seq_len, args.n)))
    cases.GradSink.last = None
    rss0, high0 = _rss_bytes(), _maxrss_bytes()
    out["loss"] = run(s)
    high1 = _maxrss_bytes()
    grad = provider.grad_rows(s, 4)
    out["grad_rows"] = None if grad is None else grad.tolist()
    logits_bytes = args.n * args.v * 4
    out["extra_peak_mib"] = round((high1 - rss0) / 2**20, 1)
    out["extra_peak_x_logits"] = round((high1 - rss0) / logits_bytes, 3)
    out["exact"] = high1 > high0  # else only an upper bound: the run stayed under an earlier high-water mark
    out["baseline_slack_mib"] = round((high0 - rss0) / 2**20, 1)
    for _ in range(args.warmup):
        run(s)
    times = Timer("cpu")(lambda: run(s), args.reps)
    out["ms"] = round(statistics.median(times), 3)
    out["times_ms"] = [round(t, 3) for t in times]
    return out


def run_worker(args, op: str, provider: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", op, provider, "--n", str(args.n), "--v",
           str(args.v), "--reps", str(args.reps), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--threads", str(args.threads)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"op": op, "provider": provider, "error": f"timeout after {args.timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"op": op, "provider": provider, "error": err[:200]}
    return json.loads(lines[-1])


def format_rows(rows: list[dict]) -> str:
    head = ["op", "provider", "ms", "extra peak MiB (x logits)", "rl_losses speed-up", "check"]
    body = []
    for r in rows:
        if r.get("error"):
            body.append([r["op"], r["provider"], r["error"][:70], "", "", ""])
            continue
        mib, x = max(0.0, r["extra_peak_mib"]), max(0.0, r["extra_peak_x_logits"])  # -0: counter rounding
        mem = f"{'' if r['exact'] else '<='}{mib:.0f} ({x:.2f}x)"
        sp = "-" if r.get("speedup_of_rl") is None else f"{r['speedup_of_rl']:.2f}x"
        body.append([r["op"], r["provider"], f"{r['ms']:.2f}", mem, sp, r.get("check", "-")])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(b) for b in body])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--ops", default=",".join(cases.OPS))
    ap.add_argument("--providers", help="comma list (default: rl_losses, rl_losses_inplace, torch_eager; "
                                        "+ reference for CE)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile (slow to compile on a CPU)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per (op, provider) subprocess")
    ap.add_argument("--out", help="folder for bench_cpu.json")
    ap.add_argument("--worker", nargs=2, metavar=("OP", "PROVIDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.op, args.provider = args.worker
        try:
            print(json.dumps(worker(args)))
        except Exception as e:  # noqa: BLE001  (report the op's own error, e.g. not implemented yet)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(json.dumps({"op": args.op, "provider": args.provider, "error": f"{type(e).__name__}: {msg}"}))
        return 0

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_avg_start": os.getloadavg(),
            "command": " ".join(["python"] + sys.argv), "torch": torch.__version__,
            "threads": args.threads or torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "n": args.n, "v": args.v, "dtype": "float32", "reps": args.reps,
            "warmup": args.warmup}
    print(f"bench_cpu: N={args.n} V={args.v} fp32 fwd+bwd · {meta['cores']} cores, {meta['threads']} torch threads "
          f"· torch {meta['torch']} · {meta['date']}", flush=True)
    rows = []
    for op in args.ops.split(","):
        provs = args.providers.split(",") if args.providers else PROVIDERS.get(op, DEFAULT_PROVIDERS)
        provs = provs + (["torch_compile"] if args.compile and "torch_compile" not in provs else [])
        ref = None
        for prov in provs:
            r = run_worker(args, op, prov)
            grad = r.pop("grad_rows", None)
            if not r.get("error"):
                g = None if grad is None else torch.tensor(grad)
                if ref is None:
                    ref, r["check"] = (prov, r["loss"], g), "ref"
                else:
                    ok, detail = cases.check_agreement(r["loss"], g, ref[1], ref[2], loose=False)
                    r["check"], r["check_detail"] = ("ok" if ok else "MISMATCH"), f"{detail} (vs {ref[0]})"
            rows.append(r)
            print(f"  {op} {prov}: " + (r.get("error") or f"{r['ms']:.2f} ms, +{r['extra_peak_mib']:.0f} MiB, "
                                                          f"{r['check']} {r.get('check_detail', '')}"), flush=True)
    for r in rows:
        base = next((b for b in rows if b["op"] == r["op"] and b["provider"] == "rl_losses" and b.get("ms")), None)
        if base and r.get("ms") and not r["provider"].startswith("rl_losses"):
            r["speedup_of_rl"] = round(r["ms"] / base["ms"], 2)
    meta["load_avg_end"] = os.getloadavg()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_cpu.json"), "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    print(f"\n{meta['date']} · {meta['cpu']}, {meta['cores']} cores ({meta['threads']} torch threads) · torch "
          f"{meta['torch']} · load average {meta['load_avg_start'][0]:.1f} -> {meta['load_avg_end'][0]:.1f}"
          f"\nN={args.n} V={args.v} fp32, fwd+bwd, median of {args.reps} · extra peak = resident-set "
          f"high-water mark over the inputs (subprocess per row)\n" + format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
