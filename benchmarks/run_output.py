"""What one benchmark run writes: its JSON of raw numbers and CSV, the speed-ups against rl_losses, and the text
tables it prints (report.py re-exports these for the bench scripts)."""
from __future__ import annotations

import csv
import json
import os

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
