"""Outputs of bench_gpu.py: the JSON of raw numbers, the CSV, the text tables and the PNG plot.

Every row is one (op, N, V, provider) job as bench_gpu.run_job returns it; ``meta`` holds the device, the
versions, the command, the copy ceiling and the definition notes.
"""
from __future__ import annotations

import csv
import json
import os

CSV_FIELDS = ["op", "n", "v", "dtype", "provider", "ms", "ms_p20", "ms_p80", "reps", "gbps", "pct_ceiling",
              "extra_peak_mib", "extra_peak_x_logits", "speedup_of_rl", "vs", "first_call_s", "loss", "check",
              "check_detail", "error"]


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


def _row_cells(r: dict, with_shape: bool) -> list[str]:
    status = r.get("error") or r.get("skipped")
    cells = [r["op"]] + ([f"{r['n']}x{r['v']}"] if with_shape else []) + [r["provider"]]
    if status and r.get("ms") is None:
        return cells + ["-"] * 5 + [str(status)[:90]]
    mem = "-" if r.get("extra_peak_mib") is None else f"{r['extra_peak_mib']:.0f} ({r['extra_peak_x_logits']:.2f}x)"
    sp = "-" if r.get("speedup_of_rl") is None else f"{r['speedup_of_rl']:.2f}x"
    chk = r.get("check") or "-"
    return cells + [_fmt(r.get("ms"), ".3f"), _fmt(r.get("gbps"), ".0f"), _fmt(r.get("pct_ceiling"), ".1f"), mem,
                    sp, chk]


def format_table(rows: list[dict], with_shape: bool = True) -> str:
    head = ["op"] + (["N x V"] if with_shape else []) + ["provider", "ms", "GB/s", "%ceil", "extra MiB (x logits)",
                                                        "rl_losses speed-up", "check"]
    return text_table(head, [_row_cells(r, with_shape) for r in rows])


def text_table(head: list[str], body: list[list]) -> str:
    """Columns padded to their widest cell, ' | ' between them, a rule under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * w for w in widths)] + [line(b) for b in body])


def plot(path: str, rows: list[dict], meta: dict, ops: list[str], providers: list[str]) -> str | None:
    """One panel per op: % of the copy ceiling per shape, one bar per provider; lines at 90% and 75%."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    ops = [o for o in ops if any(r["op"] == o and r.get("pct_ceiling") is not None for r in rows)]
    if not ops:
        return "no plot: no timed rows"
    fig, axes = plt.subplots(len(ops), 1, figsize=(14, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        mine = [r for r in rows if r["op"] == op and r.get("pct_ceiling") is not None]
        shapes = sorted({(r["n"], r["v"]) for r in mine}, key=lambda s: (s[0] * s[1], s))
        provs = [p for p in providers if any(r["provider"] == p for r in mine)]
        width = 0.8 / max(1, len(provs))
        for i, p in enumerate(provs):
            vals = {(r["n"], r["v"]): r["pct_ceiling"] for r in mine if r["provider"] == p}
            xs = [j + i * width for j, s in enumerate(shapes) if s in vals]
            ax.bar(xs, [vals[s] for s in shapes if s in vals], width, label=p)
        ax.axhline(90, color="k", ls="--", lw=0.8)
        ax.axhline(75, color="gray", ls=":", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels([f"{n}x{v}" for n, v in shapes], fontsize=8)
        ax.set_ylabel("% of copy ceiling")
        ax.set_ylim(0, max([105.0] + [1.05 * r["pct_ceiling"] for r in mine]))
        ax.set_title(f"{op}: fwd+bwd effective bandwidth (minimal bytes) / D2D copy "
                     f"({meta.get('copy_ceiling_gbps', 0):.0f} GB/s)", fontsize=9)
        ax.legend(fontsize=7, ncol=len(provs))
    fig.suptitle(f"{meta.get('device')} · {meta.get('date')} · torch {meta.get('torch')}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
