"""The fused lm_head's modes side by side (docs/performance.md): for each shape, linear_grpo_loss fwd+bwd in every
mode against the three full-size cuBLAS GEMMs that no fused head avoids (the floor), its extra memory, and where
its time goes; then each mode's grad_weight error against a float64 reference.

    python3 benchmarks/profile_linear.py                 # the grid below, every mode (about 3 minutes on an H100)
    python3 benchmarks/profile_linear.py --shapes 16384x4096x128256 --modes fast,lean --reps 20
    python3 benchmarks/profile_linear.py --errors-only --device cpu --dtype float32   # the error table alone
    python3 benchmarks/profile_linear.py --dry-run       # CPU, tiny shapes: checks the logic
    python3 benchmarks/profile_linear.py --shapes 8192x4096x128256,16384x4096x128256 --modes fast,lean,fast+main_grad \
        --loss-types ppo_clip,clip_cov,kl_cov --reps 20   # clip_cov / kl_cov beside plain GRPO in each mode

Per shape N x H x V (bf16; default N = 16384, H in {1536, 2048, 4096}, V in {128256, 151936}): the floor
(hidden @ W.T, G @ W, G.T @ hidden, each timed alone), then per mode the median fwd+bwd time, its ratio to the
floor, the extra peak memory beyond the gradients the call returns, and the kernel time of one profiled call by
kind (gemm: cuBLAS; row: rl_losses' row kernels; other). Modes:
    fast, lean                  the op's modes, every row labelled
    fast+main_grad, lean+...    the same with weight_main_grad (a float32 (V, H) buffer the weight's gradient is
                                added into; beyond-the-gradients memory then excludes only grad_hidden)
    fast/half, lean/half        half the rows unlabelled (skipped): also the time over the same mode's labelled one
    512MiB-chunks               fast mode with the chunk rule of the previous release (512 MiB of logits), for
                                comparison
--loss-types: each mode with each loss type (verl's defaults: clip_cov's and kl_cov's ratio 2e-4, whose subset
revisits max(⌊2e-4·N⌋, 1) rows; docs/policy_losses.md), timed after the mode's plain (ppo_clip) row, with the
ratio to it. The error table (one small shape, --error-shape): max|ours - ref| / max|ref| and the Frobenius ratio of grad_weight
for each way of forming it, ref = the float64 gradient of the float64 loss of the same (rounded) inputs; last, for
contrast, the gradient of the rounded logits summed over 4 chunks in fp32 and in bf16 (a bf16 accumulator).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rl_losses  # noqa: E402
from rl_losses import reference  # noqa: E402
from timing import median_ms, peak_beyond_grads_mib  # noqa: E402

SHAPES = [(16384, h, v) for h in (1536, 2048, 4096) for v in (128256, 151936)]
MODES = {  # name: (mode, weight_main_grad, half the rows unlabelled, chunk_size rule)
    "fast": ("fast", False, False, None),
    "lean": ("lean", False, False, None),
    "fast+main_grad": ("fast", True, False, None),
    "lean+main_grad": ("lean", True, False, None),
    "fast/half": ("fast", False, True, None),
    "lean/half": ("lean", False, True, None),
    "512MiB-chunks": ("fast", False, False, "512MiB"),
}


def fast_chunk_rows(n: int, v: int, itemsize: int, budget: int = 5 << 29) -> int:
    """Fast mode's default rows per chunk (csrc/linear/linear_source.cpp: part_size over kFastLogitsBytes): the
    fewest chunks of at most `budget` bytes of logits, as equal as multiples of 1024 rows (128 below 1024) allow."""
    max_rows = max(1, budget // (v * itemsize))
    if n <= max_rows:
        return max(n, 1)
    multiple = 1024 if max_rows >= 1024 else 128
    if max_rows >= multiple:
        max_rows -= max_rows % multiple
    else:
        multiple = 1
    parts = -(-n // max_rows)
    return min(max_rows, -(-(-(-n // parts)) // multiple) * multiple)


def old_chunk_rows(n: int, v: int, itemsize: int) -> int:
    """The previous release's default: rows of 512 MiB of logits, a multiple of 128, at most N."""
    rows = max(1, (512 << 20) // (v * itemsize))
    return min(rows - rows % 128 if rows >= 128 else rows, n)


def kind_of(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_")):
        return "gemm"
    if "rl_losses" in low or "row_" in low or "grad_rows" in low:
        return "row"
    return "other"


def kernel_times(fn) -> tuple[dict, list]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name and not e.name.startswith("cuda"):
            per_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
            spans.setdefault(kind_of(e.name), []).append((e.time_range.start, e.time_range.end))
    # Busy time per kind: overlapping kernels counted once (the cluster kernel's tail launch runs beside its main
    # launch, and a dependent launch starts before the kernel ahead of it ends: their durations overlap).
    per_kind = {kind: busy_us(s) / 1e3 for kind, s in spans.items()}
    every = [iv for s in spans.values() for iv in s]
    if every:
        per_kind["idle"] = (max(e for _, e in every) - min(b for b, _ in every) - busy_us(every)) / 1e3
    top = sorted(((sum(v), len(v), k) for k, v in per_name.items()), reverse=True)[:6]
    return per_kind, top


def busy_us(intervals: list[tuple[int, int]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for b, e in sorted(intervals):
        if end is None or b > end:
            total += e - b
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def inputs(n: int, h: int, v: int, dev: str, dtype, seed: int = 0) -> dict:
    """bf16 hidden ~ N(0, 1) and weight ~ N(0, 4/H) (logits std ~2), labels, advantages, old log-probs one step of
    drift from the current ones (computed a block of rows at a time), and the half-unlabelled labels."""
    g = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(n, h, device=dev, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=dev, generator=g) * (2.0 / h**0.5)).to(dtype)
    target = torch.randint(0, v, (n,), device=dev, generator=g)
    with torch.no_grad():
        old, _ = rl_losses.linear_token_log_probs(hidden, weight, target, strategy="lean")
    old = old + 0.01 * torch.randn(n, device=dev, generator=g)
    half = target.clone()
    half[torch.randperm(n, device=dev, generator=g)[: n // 2]] = -100
    return {"hidden": hidden, "weight": weight, "target": target, "half": half, "old": old,
            "adv": torch.randn(n, device=dev, generator=g)}


def floor_ms(x: dict, reps: int, dev: str) -> tuple[float, dict]:
    hidden, weight = x["hidden"], x["weight"]
    with torch.no_grad():
        logits = hidden @ weight.t()
        grad = torch.randn_like(logits)
        gemms = {"hidden@W.T": lambda: torch.mm(hidden, weight.t(), out=logits),
                 "G@W": lambda: torch.mm(grad, weight), "G.T@hidden": lambda: torch.mm(grad.t(), hidden)}
        times = {}
        for k, f in gemms.items():
            f()
            times[k] = median_ms(f, reps, dev)
    return sum(times.values()), times


def run_mode(name: str, x: dict, reps: int, dev: str, loss_type: str = "ppo_clip") -> dict:
    mode, main_grad, half, chunk_rule = MODES[name]
    hw = x["hidden"].clone().requires_grad_()
    ww = x["weight"].clone().requires_grad_()
    n, v = x["target"].numel(), ww.shape[0]
    buffer = torch.zeros(ww.shape, device=dev, dtype=torch.float32 if ww.dtype != torch.float64 else ww.dtype) \
        if main_grad else None
    chunk = old_chunk_rows(n, v, ww.element_size()) if chunk_rule == "512MiB" else None
    target = x["half"] if half else x["target"]

    def step():
        hw.grad = ww.grad = None
        rl_losses.linear_grpo_loss(hw, ww, target, x["adv"], x["old"], strategy=mode, chunk_size=chunk,
                                   weight_main_grad=buffer, loss_type=loss_type).loss.backward()

    for _ in range(2):
        step()
    row = {"ms": None, "beyond_mib": None, "kinds": None, "top": None}
    if dev == "cuda":
        row["beyond_mib"] = peak_beyond_grads_mib(step, (hw, ww))
    row["ms"] = median_ms(step, reps, dev)
    if dev == "cuda":
        row["kinds"], row["top"] = kernel_times(step)
    return row


def grad_weight_errors(shape: tuple, dev: str, dtype) -> list[tuple[str, float, float]]:
    """(way, max|ours - ref| / max|ref|, ||ours - ref|| / ||ref||) of grad_weight, linear_grpo_loss on `shape`."""
    n, h, v = shape
    x = inputs(n, h, v, dev, dtype, seed=1)
    w64 = x["weight"].double().requires_grad_()
    logits64 = x["hidden"].double() @ w64.T
    reference.grpo_loss(logits64, x["target"], x["adv"].double(), x["old"].double()).loss.backward()
    ref = w64.grad
    quarter = max(1, n // 4)
    ways = {"fast, one chunk (written once)": dict(strategy="fast"),
            "fast, 4 chunks (fp32 accumulator)": dict(strategy="fast", chunk_size=quarter),
            "lean, two sweeps (blocks written once)": dict(strategy="lean", chunk_size=quarter),
            "fast, 4 chunks, weight_main_grad": dict(strategy="fast", chunk_size=quarter, main_grad=True),
            "lean, two sweeps, weight_main_grad": dict(strategy="lean", chunk_size=quarter, main_grad=True)}
    out = []
    for way, kw in ways.items():
        ww = x["weight"].clone().requires_grad_()
        buffer = torch.zeros(ww.shape, device=dev, dtype=torch.float64 if dtype == torch.float64 else torch.float32) \
            if kw.pop("main_grad", False) else None
        rl_losses.linear_grpo_loss(x["hidden"], ww, x["target"], x["adv"], x["old"], weight_main_grad=buffer,
                                   **kw).loss.backward()
        out.append((way, buffer if buffer is not None else ww.grad))
    # For contrast, the summation alone: the gradient the row pass writes (that of the logits rounded to the input
    # dtype, itself rounded to it), 4 chunks' products summed in fp32 and in the input dtype.
    rounded = logits64.detach().to(dtype).double().requires_grad_()
    loss = reference.grpo_loss(rounded, x["target"], x["adv"].double(), x["old"].double()).loss
    g = torch.autograd.grad(loss, rounded)[0].to(dtype)
    for acc_dtype in dict.fromkeys((torch.float32, dtype)):
        acc = torch.zeros(x["weight"].shape, device=dev, dtype=acc_dtype)
        for r0 in range(0, n, quarter):
            acc += (g[r0:r0 + quarter].t().float() @ x["hidden"][r0:r0 + quarter].float()).to(acc_dtype)
        out.append((f"contrast: that G, 4 chunks summed in {str(acc_dtype).removeprefix('torch.')}", acc))
    scale, norm = ref.abs().max().item(), ref.norm().item()
    return [(way, (gw.double() - ref).abs().max().item() / scale, (gw.double() - ref).norm().item() / norm)
            for way, gw in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{h}x{v}" for n, h, v in SHAPES))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--loss-types", default="ppo_clip", help="comma-separated linear_grpo loss types per mode")
    ap.add_argument("--error-shape", default="4096x1024x32768")
    ap.add_argument("--errors-only", action="store_true")
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the logic")
    args = ap.parse_args()
    dev = "cpu" if args.dry_run else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    shapes = [(256, 64, 1000), (256, 48, 1200)] if args.dry_run else \
        [tuple(int(s) for s in shape.split("x")) for shape in args.shapes.split(",")]
    error_shape = (256, 32, 1000) if args.dry_run else tuple(int(s) for s in args.error_shape.split("x"))
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {list(MODES)}")
    if dev == "cuda":
        print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__}")
    for n, h, v in [] if args.errors_only else shapes:
        x = inputs(n, h, v, dev, dtype)
        floor, parts = floor_ms(x, args.reps, dev)
        print(f"\n== linear_grpo N={n} H={h} V={v} {args.dtype}: GEMM floor {floor:.3f} ms  "
              + "  ".join(f"{k} {t:.3f}" for k, t in parts.items())
              + f"  | fast chunk {fast_chunk_rows(n, v, x['weight'].element_size())} rows")
        done: dict[str, dict] = {}
        for name, loss_type in [(m, t) for m in modes for t in args.loss_types.split(",")]:
            key = name if loss_type == "ppo_clip" else f"{name} {loss_type}"
            r = done[key] = run_mode(name, x, args.reps, dev, loss_type)
            line = f"  {key:24s} {r['ms']:9.3f} ms = {r['ms'] / floor:.3f} x floor"
            if key != name and name in done:
                line += f"  {r['ms'] / done[name]['ms']:.4f} x plain"
            if r["beyond_mib"] is not None:
                line += f"  {r['beyond_mib']:7.0f} MiB beyond the gradients"
            labelled = name.split("/")[0]
            if name.endswith("/half") and key == name and labelled in done:
                line += f"  {r['ms'] / done[labelled]['ms']:.3f} x the labelled batch"
            print(line)
            if r["kinds"]:
                print("      busy by kind (overlaps once), idle: " + "  ".join(f"{k} {t:.3f} ms" for k, t in sorted(r["kinds"].items())))
                for total, count, kname in r["top"]:
                    print(f"      {total:8.3f} ms {count:4d} x  {kname[:100]}")
        del x
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(f"\n== grad_weight error against float64, linear_grpo N x H x V = {'x'.join(map(str, error_shape))} "
          f"{args.dtype} on {dev}: max|err|/max|ref|, ||err||/||ref||")
    for way, max_rel, fro in grad_weight_errors(error_shape, dev, dtype):
        print(f"  {way:45s} {max_rel:9.2e} {fro:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
