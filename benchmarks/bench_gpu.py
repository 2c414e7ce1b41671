"""Side-by-side GPU benchmark of the loss heads, fwd+bwd as a user runs them.

    python3 benchmarks/bench_gpu.py --quick --out OUT [--time-budget S]   # headline shape + a few
    python3 benchmarks/bench_gpu.py --out OUT                              # the whole grid
    python3 benchmarks/bench_gpu.py --grid --out OUT                       # every op over GRID4 vs Liger (~4 min)
    python3 benchmarks/bench_gpu.py --dry-run --out /tmp/x                 # CPU, tiny shapes: checks the logic

Per (op, shape, provider): the median of >= 20 CUDA-event-timed fwd+bwd runs after warm-up, effective GB/s
over the minimal bytes (CE/GRPO 2·N·V·bytes, GSPO 3·N·V·bytes), % of the device-to-device copy bandwidth
measured in the same run, the extra peak memory over the inputs, the speed-up of rl_losses over each peer,
and a check that the peer computes the same loss (and first gradient rows) as the first provider.
--grid: every op over N in {1024, 4096, 16384, 32768} x V in {32000, 128256, 151936, 262144}, rl_losses against
Liger only, few repetitions at large shapes, and for each rl_losses case the kernels of one call and the device
time of an empty chain of as many launches (the fixed cost no call of that many kernels can go below).
Jobs run in priority order (headline shape first) and the JSON/CSV are rewritten after each job, so a run
cut short by --time-budget or a kill still leaves every finished number. The printed table comes last.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import zlib

if "--dry-run" in sys.argv:
    # Liger's Triton kernels run on the CPU through Triton's interpreter (must be set before triton loads).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402
import plot  # noqa: E402
import profile_calls  # noqa: E402
import run_output  # noqa: E402
from timing import Timer, copy_ceiling, git_commit  # noqa: E402

HEADLINE = (16384, 128256)
GRID = [(n, v) for n in (4096, 16384, 32768) for v in (32000, 128256, 151936, 262144)]
# --grid: every op of the grid, rl_losses and Liger side by side (CE: Liger writes in place, so rl_losses in place
# too); a job's timed calls fill about GRID_JOB_MS of device time, between 5 and --reps calls.
GRID4 = [(n, v) for n in (1024, 4096, 16384, 32768) for v in (32000, 128256, 151936, 262144)]
GRID4_PROVIDERS = {"ce": ["rl_losses", "rl_losses_inplace", "liger"], "grpo": ["rl_losses", "liger"],
                   "gspo": ["rl_losses", "liger"]}
GRID_JOB_MS = 200.0
QUICK_SHAPES = [(16384, 32000), (16384, 262144), (4096, 128256), (32768, 128256)]
QUICK_OPS = ["ce", "grpo"]
MAIN_PROVIDERS = ["rl_losses", "rl_losses_inplace", "torch_eager", "liger", "liger_inplace"]
GRID_PROVIDERS = ["rl_losses", "rl_losses_inplace", "torch_eager", "liger"]
# Dry run: tiny shapes, sequence/document lengths divided by 32 (2048 -> 64, 64 -> 2).
DRY = {"headline": (128, 1000), "grid": [(64, 300), (128, 300), (64, 1000), (128, 1000)],
       "quick": [(128, 300), (64, 1000)], "seq_scale": 32}
GRAD_ROWS = 4  # gradient rows compared across providers


def peak_extra_bytes(step, device) -> int | None:
    """Peak allocated bytes during one fwd+bwd over what was allocated before it (the inputs and any state);
    the gradient handed to the LM head (cases.GradSink) counts: it is part of what the op costs."""
    if device.type != "cuda":
        return None
    cases.GradSink.last = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ------------------------------------------------------------------------------------------------ one job

def run_job(op, n, v, provider, args, device, timer, refs, ceiling_gbps) -> dict:
    itemsize = torch.empty((), dtype=args.dtype).element_size()
    logits_bytes = n * v * itemsize
    row = {"op": op.name, "n": n, "v": v, "dtype": str(args.dtype).replace("torch.", ""),
           "provider": provider.name, "min_bytes": op.passes * logits_bytes}
    key = (op.name, n, v)
    seq_len = max(1, op.seq_len // args.seq_scale)
    s = loss = restore = None
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            if 2 * logits_bytes > free:  # the logits and their gradient alone do not fit
                row["skipped"] = f"does not fit: 2 x {logits_bytes / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free"
                return row
        inp = cases.make_inputs(op, n, v, args.dtype, device, zlib.crc32(repr(key).encode()), seq_len)
        s = provider.prepare(op, inp)
        del inp
        # An in-place provider leaves its gradient in the logits: each timed step first gets the original
        # logits back (untimed), rather than the previous step's gradient as its logits. The copy is taken
        # here, before the first call overwrites them.
        restore = cases.logits_restorer(provider, s)

        def step():
            cases.GradSink.last = None  # the previous step's gradient is consumed and gone
            provider.loss(op, s, cases.head_output(s["base"])).backward()

        # First call on fresh inputs: the correctness check (and, for torch.compile, the compile).
        t0 = time.perf_counter()
        cases.GradSink.last = None
        loss = provider.loss(op, s, cases.head_output(s["base"]))
        loss.backward()
        timer.sync()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        row["loss"] = float(loss)
        grad = provider.grad_rows(s, GRAD_ROWS)
        loss = None
        if key not in refs:
            refs[key] = (provider.name, row["loss"], grad, provider.bf16_loss)
            row["check"], row["check_detail"] = "ref", f"first provider of the case ({provider.name})"
        else:
            ref_name, ref_loss, ref_grad, ref_loose = refs[key]
            ok, detail = cases.check_agreement(row["loss"], grad, ref_loss, ref_grad, ref_loose or provider.bf16_loss)
            row["check"], row["check_detail"] = ("ok" if ok else "MISMATCH"), f"{detail} (vs {ref_name})"
        for _ in range(args.warmup):
            step()
        extra = peak_extra_bytes(step, device)
        if extra is not None:
            row["extra_peak_mib"] = round(extra / 2**20, 1)
            row["extra_peak_x_logits"] = round(extra / logits_bytes, 3)
        timer.sync()
        reps = args.reps
        if args.grid and ceiling_gbps:  # about GRID_JOB_MS of device time at the op's ideal speed
            reps = max(5, min(reps, int(GRID_JOB_MS / (row["min_bytes"] / ceiling_gbps / 1e6))))
        times = timer(step, reps, before=restore)
        ms = statistics.median(times)
        q = statistics.quantiles(times, n=5) if len(times) >= 2 else [ms] * 4
        row.update(ms=round(ms, 4), ms_p20=round(q[0], 4), ms_p80=round(q[3], 4), reps=len(times),
                   times_ms=[round(t, 4) for t in times])
        if timer.host_ms is not None:
            row["host_ms"] = round(timer.host_ms, 4)
        row["gbps"] = round(row["min_bytes"] / ms / 1e6, 1)
        row["pct_ceiling"] = round(100 * row["gbps"] / ceiling_gbps, 1) if ceiling_gbps else None
        if args.grid and device.type == "cuda" and provider.name.startswith("rl_losses") and ceiling_gbps:
            if restore is not None:
                restore()
            profile_calls.add_launches(row, step, ceiling_gbps)
    except torch.cuda.OutOfMemoryError as e:
        row["error"] = "OOM: " + str(e).splitlines()[0][:120]
    except Exception as e:  # noqa: BLE001  (one provider failing must not stop the run)
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    finally:
        s = loss = restore = cases.GradSink.last = None  # noqa: F841  (frees them before the cache is emptied)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def cuda_alive() -> bool:
    """False once the CUDA context is lost (an illegal access or a device-side assert is sticky)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:  # noqa: BLE001
        return False


def restart_without(args, t_start: float, pair: str) -> None:
    """Go on in a fresh process (a lost CUDA context cannot be recovered in this one): --resume keeps every
    finished row, --exclude drops the (provider:op) that broke the context."""
    argv = [a for a in sys.argv[1:]]
    argv += ["--resume", "--exclude", pair, "--t0", repr(t_start)]
    print(f"CUDA context lost in {pair}: restarting in a fresh process without it", flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + argv)


# ------------------------------------------------------------------------------------------------ plan

def plan_jobs(args) -> list[tuple[str, int, int, str]]:
    """(op, N, V, provider) in priority order: the headline shape first, so a cut-short run still has it."""
    head, grid, quick = (DRY["headline"], DRY["grid"], DRY["quick"]) if args.dry_run else (HEADLINE, GRID, QUICK_SHAPES)
    ops = list(cases.OPS)
    grid_ops = [o for o in ops if not cases.OPS[o].headline_only]
    if args.grid:  # the headline first, then the smallest shapes first: a run cut short loses the largest
        shapes = DRY["grid"] if args.dry_run else GRID4
        order = [head] + sorted((sh for sh in shapes if sh != head), key=lambda sh: (sh[0] * sh[1], sh))
        jobs = [(o, n, v, p) for n, v in order for o in grid_ops for p in GRID4_PROVIDERS[cases.OPS[o].kind]]
        return filter_jobs(jobs, args)
    jobs = [(o, *head, p) for o in ops for p in MAIN_PROVIDERS]
    if args.compile != "none":
        jobs += [("ce", *head, "torch_compile")]
    if args.quick:
        extra = [(o, *sh) for o in QUICK_OPS for sh in quick]
    else:
        extra = [(o, *sh) for sh in grid if sh != head for o in grid_ops]
    grid_provs = GRID_PROVIDERS + (["torch_compile"] if args.compile == "all" else [])
    jobs += [(o, n, v, p) for o, n, v in extra for p in grid_provs]
    if args.compile != "none":
        jobs += [(o, *head, "torch_compile") for o in ops if o != "ce"]
    if args.shapes:
        keep = {tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")}
        extra_shapes = [sh for sh in keep if sh != head and not any((n, v) == sh for _, n, v, _ in jobs)]
        jobs += [(o, *sh, p) for sh in extra_shapes for o in grid_ops for p in grid_provs]
        jobs = [j for j in jobs if (j[1], j[2]) in keep]
    return filter_jobs(jobs, args)


def filter_jobs(jobs, args):
    """--shapes, --ops and --providers applied to a plan; duplicates dropped, order kept."""
    if args.grid and args.shapes:
        keep = {tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")}
        jobs = [j for j in jobs if (j[1], j[2]) in keep]
    if args.ops:
        jobs = [j for j in jobs if j[0] in args.ops.split(",")]
    if args.providers:
        jobs = [j for j in jobs if j[3] in args.providers.split(",")]
    seen, out = set(), []
    for j in jobs:
        if j not in seen:
            seen.add(j)
            out.append(j)
    return out


def collect_meta(args, device) -> dict:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "dtype": str(args.dtype),
            "liger_kernel": cases.liger_version(), "reps": args.reps, "warmup": args.warmup,
            "definition_notes": cases.DEFINITION_NOTES}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    meta["git"] = git_commit()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(device=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    memory_gib=round(p.total_memory / 2**30, 1), l2_mib=getattr(p, "L2_cache_size", 0) / 2**20)
    else:
        meta["device"] = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return meta


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/gpu", help="folder for bench.json/.csv/.png and table.md")
    ap.add_argument("--quick", action="store_true", help="headline shape (all ops) + 4 shapes for CE and GRPO")
    ap.add_argument("--grid", action="store_true",
                    help="every op over GRID4 against Liger, few repetitions at large shapes, launches per call")
    ap.add_argument("--ops", help=f"comma list of {','.join(cases.OPS)}")
    ap.add_argument("--shapes", help="comma list of NxV, e.g. 16384x128256,4096x32000 (restricts the plan)")
    ap.add_argument("--providers", help=f"comma list of {','.join(cases.PROVIDER_ORDER)}")
    ap.add_argument("--compile", choices=["none", "headline", "all"], default="headline",
                    help="shapes that also run torch.compile (each compile costs tens of seconds)")
    ap.add_argument("--reps", type=int, default=25, help="timed runs per job (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs after the first (checked) call")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; jobs that would not fit are skipped")
    ap.add_argument("--copy-gib", type=float, default=1.0, help="size of the copy-ceiling buffer")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Liger through TRITON_INTERPRET")
    ap.add_argument("--list", action="store_true", help="print the planned jobs and exit")
    # Set by restart_without() after a lost CUDA context:
    ap.add_argument("--resume", action="store_true", help="keep the rows of OUT/bench.json and skip their jobs")
    ap.add_argument("--exclude", action="append", default=[], help="provider:op pairs not to run again")
    ap.add_argument("--t0", type=float, help="start time of the first process (for --time-budget)")
    args = ap.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.seq_scale = DRY["seq_scale"] if args.dry_run else 1
    if args.grid:
        args.warmup, args.compile = min(args.warmup, 1), "none"
    if args.dry_run:
        args.reps, args.warmup, args.copy_gib = min(args.reps, 3), min(args.warmup, 1), 1 / 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = args.t0 or time.time()
    if args.list:
        for j in plan_jobs(args):
            print(*j)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    os.makedirs(args.out, exist_ok=True)
    timer = Timer(device)
    json_path, csv_path = os.path.join(args.out, "bench.json"), os.path.join(args.out, "bench.csv")
    rows, refs, done = [], {}, set()
    if args.resume and os.path.exists(json_path):
        import json

        with open(json_path) as f:
            saved = json.load(f)
        meta = saved["meta"]
        rows = [r for r in saved["results"] if r.get("skipped") != "time budget"]  # those run now
        meta["restarts"] = meta.get("restarts", []) + args.exclude[-1:]
        for r in rows:
            done.add((r["op"], r["n"], r["v"], r["provider"]))
            if r.get("check") == "ref":  # resumed checks compare the loss only (gradient rows are not saved)
                refs[(r["op"], r["n"], r["v"])] = (r["provider"], r["loss"], None, False)
        copy0 = meta["copy_start"]
    else:
        meta = collect_meta(args, device)
        copy0 = None
    print(f"bench_gpu: {meta['device']} · torch {meta['torch']} (CUDA {meta['torch_cuda']}) · triton "
          f"{meta['triton']} · liger-kernel {meta['liger_kernel']} · {meta['date']}", flush=True)
    if copy0 is None:
        copy0 = copy_ceiling(device, timer, int(args.copy_gib * 2**30))
        meta["copy_start"] = copy0
        meta["copy_ceiling_gbps"] = copy0["gbps"]
    print(f"copy ceiling: {copy0['gbps']:.0f} GB/s (read+write of {copy0['bytes'] / 2**30:.2f} GiB in "
          f"{copy0['ms']:.3f} ms)", flush=True)

    providers, unavailable = {}, {}
    for name in cases.PROVIDER_ORDER:
        try:
            providers[name] = cases.build_provider(name)
        except Exception as e:  # noqa: BLE001
            unavailable[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
    meta["unavailable"] = unavailable
    if "rl_losses" in providers:
        meta["rl_losses_cuda_kernels"] = providers["rl_losses"].rl.cuda_kernels_available()
    if "liger" in providers:
        from liger_kernel.ops import LigerCrossEntropyFunction

        meta["liger_ce_impl"] = LigerCrossEntropyFunction.__module__
    for name, why in unavailable.items():
        print(f"  {name}: {why}", flush=True)

    jobs = plan_jobs(args)
    print(f"{len(jobs)} jobs planned" + (f", time budget {args.time_budget:.0f} s" if args.time_budget else ""),
          flush=True)
    for op_name, n, v, pname in jobs:
        op = cases.OPS[op_name]
        base = {"op": op_name, "n": n, "v": v, "provider": pname}
        elapsed = time.time() - t_start
        # rough seconds a job takes (compiles are the long ones; the grid's jobs time fewer calls)
        need = 75 if pname == "torch_compile" else 2 if args.grid else 6
        if (op_name, n, v, pname) in done:
            continue
        if f"{pname}:{op_name}" in args.exclude:
            row = dict(base, skipped="excluded: an earlier job of this provider and op lost the CUDA context")
        elif pname in unavailable:
            row = dict(base, skipped=unavailable[pname])
        elif args.time_budget and elapsed + need > args.time_budget:
            row = dict(base, skipped="time budget")
        elif not providers[pname].supports(op):
            continue
        else:
            row = run_job(op, n, v, providers[pname], args, device, timer, refs, meta["copy_ceiling_gbps"])
        rows.append(row)
        run_output.add_speedups(rows, lambda p, o: cases.counterpart(p, cases.OPS[o]))
        run_output.write_json(json_path, meta, rows)
        run_output.write_csv(csv_path, rows)
        status = row.get("error") or row.get("skipped")
        if row.get("ms") is not None:
            mem = "-" if row.get("extra_peak_mib") is None else f"+{row['extra_peak_mib']:.0f} MiB"
            status = f"{row['ms']:.3f} ms {row['gbps']:.0f} GB/s {row['pct_ceiling']}% {mem} {row['check']}"
            if row.get("check") == "MISMATCH":
                status += f" ({row['check_detail']})"
            if row.get("kernels") is not None:
                status += (f" | {row['kernels']} kernels, empty chain {row['chain_us']:.1f} us, "
                           f"{row['beyond_copy_us']:.1f} us beyond the copy: {row['target']}")
        if row.get("skipped") != "time budget":
            print(f"[{time.time() - t_start:6.1f}s] {op_name} {n}x{v} {pname}: {status}", flush=True)
        if row.get("error") and device.type == "cuda" and not cuda_alive() and len(args.exclude) < 8:
            restart_without(args, t_start, f"{pname}:{op_name}")

    copy1 = copy_ceiling(device, timer, int(args.copy_gib * 2**30))
    meta["copy_end"] = copy1
    meta["total_s"] = round(time.time() - t_start, 1)
    skipped = sum(1 for r in rows if r.get("skipped") == "time budget")
    run_output.write_json(json_path, meta, rows)
    run_output.write_csv(csv_path, rows)
    why_no_plot = plot.plot(os.path.join(args.out, "bench.png"), rows, meta, list(cases.OPS), cases.PROVIDER_ORDER)

    head = DRY["headline"] if args.dry_run else HEADLINE
    order = {p: i for i, p in enumerate(cases.PROVIDER_ORDER)}
    key = lambda r: (list(cases.OPS).index(r["op"]), r["n"] * r["v"], r["n"], order.get(r["provider"], 99))  # noqa
    shown = sorted((r for r in rows if r.get("skipped") != "time budget"), key=key)
    headline = [r for r in shown if (r["n"], r["v"]) == head]
    others = [r for r in shown if (r["n"], r["v"]) != head]
    notes = "\n".join(f"- {x}" for x in cases.DEFINITION_NOTES)
    header = (f"{meta['device']} · {meta['date']} · torch {meta['torch']} · liger-kernel {meta['liger_kernel']}\n"
              f"command: {meta['command']}\ncopy ceiling: {copy0['gbps']:.0f} GB/s at start, {copy1['gbps']:.0f} "
              f"GB/s at end (the start value is the 100% of %ceil)\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(f"# bench_gpu results\n\n{header}\n## Headline N x V = {head[0]} x {head[1]}\n\n```\n"
                f"{run_output.format_table(headline, with_shape=False)}\n```\n\n## Other shapes\n\n```\n"
                f"{run_output.format_table(others)}\n```\n\n## Definitions\n\n{notes}\n")
    print("\nDefinitions:\n" + notes)
    if others:
        print("\nOther shapes:\n" + run_output.format_table(others))
    print(f"\nwrote {args.out}/bench.json, bench.csv, table.md" + ("" if why_no_plot else ", bench.png")
          + (f" ({why_no_plot})" if why_no_plot else "") + f"; {meta['total_s']} s"
          + (f"; {skipped} jobs skipped for the time budget" if skipped else ""))
    if args.grid:
        print("\n" + run_output.grid_summary(rows))
    print(f"\n{header}Headline N x V = {head[0]} x {head[1]}, {meta['dtype']}, fwd+bwd "
          f"(rl_losses speed-up = peer ms / rl_losses ms):\n" + run_output.format_table(headline, with_shape=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
