"""Outputs of the benchmarks, and the page of current numbers generated from the recorded ones.

1. For bench_gpu.py (and bench_linear.py): the JSON of raw numbers, the CSV and the text tables (the PNG: plot.py).
   bench_policy.py and bench_distill_head.py write their own JSON (one row per case and provider), recorded the same way.
   Every row is one (op, N, V, provider) job as bench_gpu.run_job returns it; ``meta`` holds the device, the
   versions, the command, the copy ceiling and the definition notes.
2. ``benchmarks/results/<device>-<date>.json`` (one file per device and date: device, date, torch, and its
   runs, each with its script, time, command, commit and rows) -> ``benchmarks/RESULTS.md`` and the headline
   table of the top-level README.md, between its marker comments. Neither is edited by hand:

       python benchmarks/report.py --results benchmarks/results --write      # regenerate both
       python benchmarks/report.py --add OUT/bench.json --results benchmarks/results   # record a new run

   Where runs of one file measure the same case, the latest run's row is the one shown (a later run that
   re-measures part of the grid supersedes those cells only). tests/test_benchmark_results.py fails when
   RESULTS.md or the README table differ from what the results files generate.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import sys

CSV_FIELDS = ["op", "n", "v", "dtype", "provider", "ms", "ms_p20", "ms_p80", "reps", "gbps", "pct_ceiling",
              "extra_peak_mib", "extra_peak_x_logits", "speedup_of_rl", "vs", "first_call_s", "loss", "check",
              "check_detail", "kernels", "chain_us", "beyond_copy_us", "target", "error"]


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1, default=str)
    os.replace(tmp, path)  # a run killed mid-write still leaves the previous complete file


def write_csv(path: str, rows: list[dict], fields: list[str] = CSV_FIELDS) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in fields})
    os.replace(tmp, path)


def add_speedups(rows: list[dict], counterpart) -> None:
    """speedup_of_rl = peer ms / ms of its rl_losses counterpart (same case): > 1 means rl_losses is faster."""
    by_case = {}
    for r in rows:
        by_case.setdefault((r["op"], r["n"], r["v"]), {})[r["provider"]] = r
    for r in rows:
        if r["provider"].startswith("rl_losses") or r.get("ms") is None:
            continue
        base = by_case[(r["op"], r["n"], r["v"])].get(counterpart(r["provider"], r["op"]))
        if base and base.get("ms"):
            r["speedup_of_rl"] = round(r["ms"] / base["ms"], 3)
            r["vs"] = base["provider"]


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _row_cells(r: dict, with_shape: bool, launches: bool = False) -> list[str]:
    status = r.get("error") or r.get("skipped")
    cells = [r["op"]] + ([f"{r['n']}x{r['v']}"] if with_shape else []) + [r["provider"]]
    if status and r.get("ms") is None:
        return cells + ["-"] * (8 if launches else 5) + [str(status)[:90]]
    mem = "-" if r.get("extra_peak_mib") is None else f"{r['extra_peak_mib']:.0f} ({r['extra_peak_x_logits']:.2f}x)"
    sp = "-" if r.get("speedup_of_rl") is None else f"{r['speedup_of_rl']:.2f}x"
    chk = r.get("check") or "-"
    extra = [_fmt(r.get("kernels"), "d"), _fmt(r.get("chain_us"), ".1f"), r.get("target") or "-"] if launches else []
    return cells + [_fmt(r.get("ms"), ".3f"), _fmt(r.get("gbps"), ".0f"), _fmt(r.get("pct_ceiling"), ".1f"), mem,
                    sp] + extra + [chk]


def format_table(rows: list[dict], with_shape: bool = True) -> str:
    """One line per row; with the kernels per call, the empty chain's µs and the target where rows have them
    (bench_gpu.py --grid)."""
    launches = any(r.get("kernels") is not None for r in rows)
    head = ["op"] + (["N x V"] if with_shape else []) + ["provider", "ms", "GB/s", "%ceil", "extra MiB (x logits)",
                                                        "rl_losses speed-up"]
    head += ["kernels", "chain us", "target"] if launches else []
    return text_table(head + ["check"], [_row_cells(r, with_shape, launches) for r in rows])


def grid_summary(rows: list[dict]) -> str:
    """The targets of a grid run: rl_losses cases at >= 85% of the ceiling or within 5 µs of their empty launch
    chain, and the cases where a peer was faster."""
    mine = [r for r in rows if r["provider"] == "rl_losses" and r.get("target")]
    missed = [r for r in mine if r["target"] == "missed"]
    lost = [r for r in rows if r.get("speedup_of_rl") is not None and r["speedup_of_rl"] < 1]
    lines = [f"targets: {len(mine) - len(missed)} of {len(mine)} rl_losses cases met "
             f"(>= 85% of the copy ceiling, or within 5 us of the empty chain of their launches)"]
    lines += [f"  missed: {r['op']} {r['n']}x{r['v']} {r['ms']:.3f} ms, {r['pct_ceiling']}%, {r['kernels']} kernels, "
              f"{r['beyond_copy_us']:.1f} us beyond the copy vs chain {r['chain_us']:.1f} us" for r in missed]
    lines.append(f"cases where a peer was faster: {len(lost)}")
    lines += [f"  {r['op']} {r['n']}x{r['v']} {r['provider']}: {r['speedup_of_rl']:.2f}x of {r['vs']}" for r in lost]
    return "\n".join(lines)


def text_table(head: list[str], body: list[list]) -> str:
    """Columns padded to their widest cell, ' | ' between them, a rule under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * w for w in widths)] + [line(b) for b in body])


# ----------------------------------------------------------------------------- RESULTS.md and the README table

HEADLINE = (16384, 128256)
GPU_OPS = {"ce": "cross-entropy", "grpo": "GRPO β=0", "grpo_kl": "GRPO β>0", "gspo_2048": "GSPO docs of 2048",
           "gspo_64": "GSPO docs of 64", "grpo_masked": "GRPO, half the tokens unlabelled",
           "gspo_masked": "GSPO, half the tokens unlabelled"}
# The minimal traffic of each op in passes over the logits (read + write = 2): what its "% of the ceiling" is of.
PASSES = {"gspo_2048": "3 passes", "gspo_64": "3 passes", "grpo_masked": "1.5 passes", "gspo_masked": "2 passes"}
README_BEGIN = "<!-- headline table: generated by benchmarks/report.py from benchmarks/results; do not edit -->"
README_END = "<!-- end of the generated headline table -->"
GENERATED = ("<!-- Generated by benchmarks/report.py from benchmarks/results/*.json; do not edit. Regenerate with\n"
             "     python benchmarks/report.py --results benchmarks/results --write -->")


def load_results(results_dir: str) -> list[dict]:
    """Every results/<device>-<date>.json, in file-name order; each checked for the fields the page needs."""
    docs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        doc["file"] = os.path.basename(path)
        for key in ("device", "date", "torch", "runs"):
            if key not in doc:
                raise ValueError(f"{path}: no {key!r}")
        for run in doc["runs"]:
            for key in ("script", "time", "command", "rows"):
                if key not in run:
                    raise ValueError(f"{path}: a run without {key!r} ({run.get('time')})")
        docs.append(doc)
    return sorted(docs, key=lambda d: (d["file"].startswith("cpu"), d["file"]))  # the GPUs first


def latest_rows(doc: dict, script: str, key) -> dict:
    """key(row) -> the row of the latest run of `script` in `doc` that measured it."""
    out = {}
    for run in sorted((r for r in doc["runs"] if r["script"] == script), key=lambda r: r["time"]):
        for row in run["rows"]:
            out[key(row)] = row
    return out


def _gpu_key(r):
    return r["op"], r["n"], r["v"], r["provider"]


def _ms(r):
    return None if r is None or r.get("ms") is None else r["ms"]


def _cell(r, fmt=".3f"):
    if r is None:
        return "–"
    if r.get("ms") is None:
        return str(r.get("error") or r.get("skipped") or "–")[:40]
    return format(r["ms"], fmt)


def _times(r):
    """'1.42×' for a peer row: its ms over its rl_losses counterpart's, in the same run."""
    return "–" if r is None or r.get("speedup_of_rl") is None else f"{r['speedup_of_rl']:.2f}×"


def _peer(r):
    return "–" if _ms(r) is None else f"{_fmt_ms(r['ms'])} ms ({_times(r)})"


def _fmt_ms(ms):
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3f}" if ms < 1 else f"{ms:.2f}"


def _pct(r):
    return "–" if r is None or r.get("pct_ceiling") is None else f"{r['pct_ceiling']:.1f}%"


def runs_list(doc: dict) -> list[str]:
    lines = []
    for run in sorted(doc["runs"], key=lambda r: r["time"]):
        bits = [run["time"], run["script"]]
        if run.get("git"):
            bits.append(f"rl_losses at {run['git']}")
        bits.append(f"torch {run.get('torch', doc['torch'])}")
        if run.get("liger_kernel"):
            bits.append(f"Liger-Kernel {run['liger_kernel']}")
        if run.get("copy_ceiling_gbps"):
            bits.append(f"copy ceiling {run['copy_ceiling_gbps']} GB/s")
        line = f"- {', '.join(bits)}: `{run['command']}`"
        if run.get("note"):
            line += f" ({run['note']})"
        lines.append(line)
    return lines


def gpu_section(doc: dict) -> list[str]:
    rows = latest_rows(doc, "bench_gpu.py", _gpu_key)
    if not rows:
        return []
    get = lambda op, n, v, p: rows.get((op, n, v, p))  # noqa: E731
    out = []
    n0, v0 = HEADLINE
    head_ops = [op for op in GPU_OPS if get(op, n0, v0, "rl_losses")]
    if head_ops:
        out += [f"### Loss heads from logits at N = {n0}, V = {v0} (bench_gpu.py, bf16, fwd+bwd)", "",
                "ms · % of the copy ceiling (of the op's minimal passes where noted); peers: ms (their time over "
                "ours: > 1 means rl_losses is faster; Liger's CE writes in place, so it is compared with "
                "rl_losses in place).", "",
                "| op | rl_losses | in place | eager PyTorch | torch.compile | Liger-Kernel | Liger in place |",
                "|---|---|---|---|---|---|---|"]
        for op in head_ops:
            rl, ip = get(op, n0, v0, "rl_losses"), get(op, n0, v0, "rl_losses_inplace")
            pct = _pct(rl) + (f" of {PASSES[op]}" if op in PASSES else "")
            ipc = "–" if _ms(ip) is None else f"{_cell(ip)} · {_pct(ip)}"
            out.append(f"| {GPU_OPS[op]} | {_cell(rl)} · {pct} | {ipc} | "
                       + " | ".join(_peer(get(op, n0, v0, p))
                                    for p in ("torch_eager", "torch_compile", "liger", "liger_inplace")) + " |")
        out.append("")
    shapes = sorted({(n, v) for (op, n, v, p) in rows if p == "rl_losses"}, key=lambda s: (s[0] * s[1], s))
    grid_ops = [op for op in ("ce", "grpo", "grpo_kl", "gspo_2048", "gspo_64")
                if any(get(op, n, v, "rl_losses") for n, v in shapes)]
    if len(shapes) > 1 and grid_ops:
        out += ["### Every shape measured (bench_gpu.py)", "",
                "ms · % of the ceiling (in place in brackets) · Liger-Kernel's time over ours (CE: Liger, always "
                "in place, against rl_losses in place). GSPO's % is of its 3-pass floor.", "",
                "| N × V | " + " | ".join(GPU_OPS[op] for op in grid_ops) + " |",
                "|---" * (len(grid_ops) + 1) + "|"]
        for n, v in shapes:
            cells = []
            for op in grid_ops:
                rl, ip = get(op, n, v, "rl_losses"), get(op, n, v, "rl_losses_inplace")
                if _ms(rl) is None:
                    cells.append(_cell(rl))
                    continue
                liger = get(op, n, v, "liger") or get(op, n, v, "liger_inplace")
                ipc = "" if _ms(ip) is None else f" ({_pct(ip)})"
                cells.append(f"{_cell(rl)} · {_pct(rl)}{ipc} · {_times(liger)}")
            shape = f"{n} × {v}"
            if (n, v) == HEADLINE:
                shape, cells = f"**{shape}**", [f"**{c}**" for c in cells]
            out.append(f"| {shape} | " + " | ".join(cells) + " |")
        timed = [r for (op, n, v, p), r in rows.items() if p == "rl_losses" and op in grid_ops and _ms(r)]
        lost = [r for (op, n, v, p), r in rows.items() if p != "rl_losses" and _ms(r)
                and r.get("speedup_of_rl") is not None and r["speedup_of_rl"] < 1]
        out += launches_table(rows, shapes, grid_ops)
        if timed:
            out += ["", f"{len(timed)} cases timed for rl_losses, at {min(r['pct_ceiling'] for r in timed):.1f}–"
                        f"{max(r['pct_ceiling'] for r in timed):.1f}% of the ceiling (or floor); cases where a "
                        f"peer was faster: {len(lost)}."]
        out.append("")
    return out


def launches_table(rows: dict, shapes, ops) -> list[str]:
    """Where a grid run (bench_gpu.py --grid) recorded them: per shape and op, the kernels of one rl_losses call,
    the device time of an empty chain of as many launches, the time beyond the copy of the minimal bytes, and
    the target met (>= 85% of the ceiling, or within 5 µs of the chain)."""
    get = lambda op, n, v: rows.get((op, n, v, "rl_losses"))  # noqa: E731
    if not any((get(op, n, v) or {}).get("kernels") is not None for n, v in shapes for op in ops):
        return []
    out = ["", "Launches per call (rl_losses): kernels · empty chain of as many launches · time beyond the copy "
               "of the minimal bytes · target (≥ 85% of the ceiling, or within 5 µs of the chain).", "",
           "| N × V | " + " | ".join(GPU_OPS[op] for op in ops) + " |", "|---" * (len(ops) + 1) + "|"]
    for n, v in shapes:
        cells = []
        for op in ops:
            r = get(op, n, v)
            cells.append("–" if r is None or r.get("kernels") is None else
                         f"{r['kernels']} · {r['chain_us']:.0f} µs · {r['beyond_copy_us']:.0f} µs · {r['target']}")
        out.append(f"| {n} × {v} | " + " | ".join(cells) + " |")
    return out


def linear_section(doc: dict) -> list[str]:
    """One table per shape measured (bench_linear.py; --cce runs several), with a Cut Cross-Entropy column where
    it was measured."""
    rows = latest_rows(doc, "bench_linear.py",
                       lambda r: (r["op"], r["provider"], r.get("chunk"), r.get("n"), r.get("h"), r.get("v")))
    if not rows:
        return []
    shapes = sorted({k[3:] for k in rows if k[1] == "rl_losses" and None not in k[3:]})
    x = lambda r: "–" if _ms(r) is None else f"{_fmt_ms(r['ms'])} ({r['x_floor']:.2f}×)"  # noqa: E731
    mib = lambda r: ("–" if r is None or r.get("beyond_grads_mib") is None  # noqa: E731
                     else f"{r['beyond_grads_mib']:.0f} MiB")
    out = []
    for n, h, v in shapes:
        get = lambda op, p: rows.get((op, p, None, n, h, v))  # noqa: E731
        cce = any(get(op, "cce") for op in ("ce", "grpo", "gspo"))
        out += [f"### Fused lm_head from hidden states (bench_linear.py: N = {n}, H = {h}, V = {v}, bf16)", "",
                "ms (× the GEMMs no implementation avoids); memory beyond the inputs and their gradients.", "",
                "| op | GEMM floor | rl_losses (default chunk) | beyond grads | unfused (logits + our op) | "
                "eager PyTorch | Liger-Kernel |"
                + (" Cut Cross-Entropy · beyond grads | CCE exact · beyond grads |" if cce else ""),
                "|---|---|---|---|---|---|---|" + ("---|---|" if cce else "")]
        for op in ("ce", "grpo", "gspo"):
            rl, floor = get(op, "rl_losses"), get(op, "gemm_floor")
            if rl is None:
                continue
            line = (f"| {op} | {_cell(floor, '.1f')} | {x(rl)} | {mib(rl)} | {x(get(op, 'rl_losses_unfused'))} | "
                    f"{x(get(op, 'torch_eager'))} | {x(get(op, 'liger'))} |")
            if cce:
                line += "".join(f" {x(get(op, p))} · {mib(get(op, p))} |" for p in ("cce", "cce_exact"))
            out.append(line)
        out.append("")
    return out


def tp_section(doc: dict) -> list[str]:
    rows = latest_rows(doc, "bench_tp.py", lambda r: (r["op"], r["n"], r["v"]))
    if not rows:
        return []
    out = ["### Vocabulary-parallel over 2 GPUs (bench_tp.py, TP = 2, NCCL, bf16)", "",
           "| op | N × V | step ms (TP = 2) | one GPU ms | all-reduces in the step | their share of the kernel time "
           "| matches one GPU |", "|---|---|---|---|---|---|---|"]
    for (op, n, v), r in rows.items():
        out.append(f"| {op} | {n} × {v} | {r['step_ms']:.3f} | {r['single_gpu_ms']:.3f} | "
                   f"{r['comm_in_situ_ms'] * 1000:.0f} µs | {100 * r['comm_share_in_situ']:.1f}% | "
                   f"{'yes' if r.get('pass') else 'no'} |")
    checks = [c for run in doc["runs"] if run["script"] == "bench_tp.py" for c in run.get("checks", [])]
    if checks:
        worst = max(c["worst_rel_err"] for c in checks)
        out += ["", f"{sum(c['ok'] for c in checks)} of {len(checks)} layouts match the single-rank result "
                    f"(worst relative error {worst:.1e})."]
    return out + [""]


def distill_head_section(doc: dict) -> list[str]:
    """bench_distill_head.py: distillation against its floor and peers, the fused head against GRPO alone."""
    rows = latest_rows(doc, "bench_distill_head.py", _gpu_key)
    if not rows:
        return []
    out = ["### Distillation and the fused head (bench_distill_head.py)", "",
           "Milliseconds, forward + backward; % of the floor (read the student, read the teacher, write the "
           "gradient, at the copy ceiling) for the distillation rows.", "",
           "| case | N × V | dtype | provider | ms | % of floor |", "|---|---|---|---|---|---|"]
    for r in rows.values():
        out.append(f"| {r['op']} | {r['n']} × {r['v']} | {r['dtype']} | {r['provider']} | {_cell(r)} | {_pct(r)} |")
    return out + [""]


def policy_section(doc: dict) -> list[str]:
    rows = latest_rows(doc, "bench_policy.py", lambda r: (r["option"], r["provider"]))
    if not rows:
        return []
    run = max((r for r in doc["runs"] if r["script"] == "bench_policy.py"), key=lambda r: r["time"])
    shape = run.get("shape", {})
    out = [f"### The policy family's options (bench_policy.py: N = {shape.get('n')}, V = {shape.get('v')}, "
           f"{shape.get('dtype')}, fwd+bwd)", "",
           "ms (× plain GRPO's, or plain GSPO's for the GSPO rows; 2 passes: the option reads the logits twice) · "
           "Liger-Kernel's triton_grpo_loss with the same option (its time over ours).", "",
           "| option | rl_losses | × plain | Liger-Kernel |", "|---|---|---|---|"]
    for option in dict.fromkeys(o for o, _ in rows):
        rl, liger = rows.get((option, "rl_losses")), rows.get((option, "liger"))
        x = "–" if rl is None or rl.get("vs_plain") is None else f"{rl['vs_plain']:.3f}"
        if rl is not None and rl.get("passes") == 2:
            x += " (2 passes)"
        out.append(f"| {option} | {_cell(rl)} | {x} | {_peer(liger)} |")
    return out + [""]


def cpu_section(doc: dict) -> list[str]:
    rows = latest_rows(doc, "bench_cpu.py", lambda r: (r["op"], r["provider"]))
    if not rows:
        return []
    n, v = next(iter(rows.values()))["n"], next(iter(rows.values()))["v"]
    out = [f"### CPU (bench_cpu.py: N = {n}, V = {v}, fp32, fwd+bwd)", "",
           "ms (eager's time over ours) · extra peak memory in units of the logits.", "",
           "| op | rl_losses | in place | eager PyTorch | float64 reference |", "|---|---|---|---|---|"]
    mem = lambda r: "" if r is None or r.get("extra_peak_x_logits") is None else (  # noqa: E731
        f" · {'' if r.get('exact', True) else '≤ '}{max(0.0, r['extra_peak_x_logits']):.2f}×")
    for op in sorted({op for op, _ in rows}, key=list(GPU_OPS).index):
        cells = []
        for p in ("rl_losses", "rl_losses_inplace", "torch_eager", "reference"):
            r = rows.get((op, p))
            if _ms(r) is None:
                cells.append("–")
                continue
            sp = "" if r.get("speedup_of_rl") is None else f" ({r['speedup_of_rl']:.1f}×)"
            cells.append(f"{r['ms']:.1f}{sp}{mem(r)}")
        out.append(f"| {GPU_OPS[op]} | " + " | ".join(cells) + " |")
    return out + [""]


def render_results(docs: list[dict]) -> str:
    out = [GENERATED, "", "# Benchmark results", "",
           "The current numbers of each device, from `results/` (one JSON file per device and date). How they are "
           "measured: README.md beside this file; what they are measured against (bytes, floors, the copy "
           "ceiling): `docs/performance.md`; how the kernels got there: `docs/design.md`.", ""]
    for doc in docs:
        out += [f"## {doc['host']} — {doc['date']} (`results/{doc['file']}`)", "", "Runs:", ""] + runs_list(doc) + [""]
        out += (gpu_section(doc) + linear_section(doc) + policy_section(doc) + distill_head_section(doc)
                + tp_section(doc) + cpu_section(doc))
    return "\n".join(out).rstrip() + "\n"


def render_readme_table(docs: list[dict]) -> str:
    """The README's headline: the first GPU file with bench_gpu.py rows at the headline shape."""
    n0, v0 = HEADLINE
    for doc in docs:
        rows = latest_rows(doc, "bench_gpu.py", _gpu_key)
        if not rows.get(("ce", n0, v0, "rl_losses")):
            continue
        run = max((r for r in doc["runs"] if r["script"] == "bench_gpu.py"), key=lambda r: r["time"])
        out = [README_BEGIN,
               f"On an {doc['device']} at N = {n0}, V = {v0} (bf16, fwd+bwd; `benchmarks/RESULTS.md`, "
               f"`benchmarks/results/{doc['file']}`):", "",
               "| op | rl_losses | % of the memory ceiling | eager PyTorch (× ours) | Liger-Kernel (× ours) |",
               "|---|---|---|---|---|"]
        for op in ("ce", "grpo", "gspo_2048", "gspo_64", "grpo_masked", "gspo_masked"):
            rl = rows.get((op, n0, v0, "rl_losses"))
            if _ms(rl) is None:
                continue
            pct = _pct(rl) + (f" ({PASSES[op]})" if op in PASSES else "")
            liger = rows.get((op, n0, v0, "liger"))
            out.append(f"| {GPU_OPS[op]} | {rl['ms']:.2f} ms | {pct} | {_peer(rows.get((op, n0, v0, 'torch_eager')))}"
                       f" | {_peer(liger)} |")
        out += ["", f"The ceiling is a device-to-device copy of the same bytes in the same run "
                    f"({run.get('copy_ceiling_gbps')} GB/s); × ours is the peer's time over ours (Liger's CE writes "
                    "in place and is compared with ours in place). Every device and shape: `benchmarks/RESULTS.md`.",
                README_END]
        return "\n".join(out)
    raise ValueError("no results file has bench_gpu.py rows at the headline shape")


def replace_between_markers(text: str, block: str) -> str:
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        raise ValueError(f"README.md lacks the marker comments {README_BEGIN!r} ... {README_END!r}")
    return text[:i] + block + text[j + len(README_END):]


# ----------------------------------------------------------------------------- recording a run

def _slug(device: str, world: int | None) -> str:
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", device or "")
    if (device or "CPU").upper().startswith("CPU"):
        name = "cpu"
    else:
        name = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "", device.lower())[:12]
    return f"{name}x{world}" if world and world > 1 else name


def run_from_output(path: str) -> tuple[dict, dict]:
    """(file header, run) from a bench_gpu / bench_linear / bench_cpu / bench_tp JSON output."""
    with open(path) as f:
        d = json.load(f)
    if "timing" in d:  # bench_tp.py
        run = {"script": "bench_tp.py", "time": d["date"], "command": d["command"], "torch": d["torch"],
               "world": d["world"], "backend": d["backend"], "capture": d.get("capture"),
               "checks": [{k: c[k] for k in ("case", "op", "layout", "n", "v", "worst_rel_err", "ok")}
                          for c in d["checks"]], "rows": d["timing"]}
        head = {"device": d["device"], "host": f"{d['world']} × {d['device']} ({d['backend']})", "world": d["world"]}
        return head, run
    m, rows = d["meta"], d["results"]
    script = m.get("script") or ("bench_linear.py" if "gemm_floor" in {r.get("provider") for r in rows}
                                 else "bench_cpu.py" if "threads" in m else "bench_gpu.py")
    run = {"script": script, "time": m["date"], "command": m["command"], "git": m.get("git"), "torch": m["torch"],
           "liger_kernel": m.get("liger_kernel"), "rows": [{k: v for k, v in r.items() if k != "times_ms"}
                                                           for r in rows]}
    if m.get("copy_ceiling_gbps"):
        run["copy_ceiling_gbps"] = round(m["copy_ceiling_gbps"])
    if "shape" in m:
        run["shape"] = m["shape"]
    device = "CPU" if script == "bench_cpu.py" else m["device"]
    return {"device": device, "host": device}, {k: v for k, v in run.items() if v is not None}


def add_run(path: str, results_dir: str) -> str:
    head, run = run_from_output(path)
    date = run["time"][:10]
    target = os.path.join(results_dir, f"{_slug(head['device'], head.pop('world', None))}-{date}.json")
    if os.path.exists(target):
        with open(target) as f:
            doc = json.load(f)
    else:
        doc = {**head, "date": date, "torch": run["torch"], "runs": []}
    doc["runs"] = [r for r in doc["runs"] if (r["script"], r["time"]) != (run["script"], run["time"])] + [run]
    write_json_doc(target, doc)
    return target


def write_json_doc(path: str, doc: dict) -> None:
    """Indented JSON with each row on one line, so that replacing a run gives a readable diff."""
    text = json.dumps({k: v for k, v in doc.items() if k != "file"}, indent=1, ensure_ascii=False)
    text = re.sub(r"\{\n\s+(\"op\"[^{}\[\]]*?)\n\s+\}", lambda mo: "{" + re.sub(r"\n\s+", " ", mo.group(1)) + "}",
                  text)
    with open(path, "w") as f:
        f.write(text + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="RESULTS.md and the README's headline table from benchmarks/results.")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--add", metavar="OUTPUT_JSON", action="append", default=[],
                    help="record a run: a bench_gpu/bench_linear/bench_cpu/bench_tp JSON output")
    ap.add_argument("--write", action="store_true", help="rewrite benchmarks/RESULTS.md and README.md's table")
    args = ap.parse_args(argv)
    for path in args.add:
        print("recorded in", add_run(path, args.results))
    docs = load_results(args.results)
    here = os.path.dirname(os.path.abspath(__file__))
    results_md, readme = os.path.join(here, "RESULTS.md"), os.path.join(here, "..", "README.md")
    page, table = render_results(docs), render_readme_table(docs)
    if not args.write:
        print(page)
        return 0
    with open(results_md, "w") as f:
        f.write(page)
    with open(readme) as f:
        text = f.read()
    with open(readme, "w") as f:
        f.write(replace_between_markers(text, table))
    print(f"wrote {results_md} and the table in {os.path.normpath(readme)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
