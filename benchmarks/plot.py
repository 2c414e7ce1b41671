"""The PNG of a bench_gpu.py run: one panel per op, % of the copy ceiling per shape, one bar per provider."""
from __future__ import annotations


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
