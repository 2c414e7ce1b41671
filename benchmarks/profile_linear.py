"""Where the time of the fused lm_head goes: for each shape and chunk size, the fwd+bwd time of
``linear_grpo_loss`` (or ``linear_cross_entropy``), its GEMM kernels, its row pass and the rest, against the
three full-size cuBLAS GEMMs that no fused head avoids (the floor).

    python3 benchmarks/profile_linear.py [--shapes 16384x2048x128256,...] [--chunks 1024,2048,4096,0]
    python3 benchmarks/profile_linear.py --dry-run        # CPU, tiny shape: checks the logic

Per shape N x H x V (bf16): the floor (hidden @ W.T, G @ W, G.T @ hidden, each timed alone; G.T @ hidden also
with a float32 output where torch.mm takes out_dtype), then per chunk size (0: the op's default) the median
fwd+bwd time, the extra peak memory, and the kernel time of one profiled call by kind (gemm: cuBLAS kernels;
row: rl_losses' row kernels; other), with the largest kernels listed.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

import rl_losses


def median_ms(fn, reps: int, cuda: bool) -> float:
    import time

    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


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
    per_kind: dict[str, float] = {}
    per_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.name and not e.name.startswith("cuda"):
            us = e.time_range.elapsed_us()
            per_kind[kind_of(e.name)] = per_kind.get(kind_of(e.name), 0.0) + us / 1e3
            per_name.setdefault(e.name, []).append(us / 1e3)
    top = sorted(((sum(v), len(v), k) for k, v in per_name.items()), reverse=True)[:8]
    return per_kind, top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16384x2048x128256,16384x2048x151936,16384x4096x128256")
    ap.add_argument("--chunks", default="1024,2048,4096,8192,0")
    ap.add_argument("--op", default="grpo", choices=("grpo", "ce"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    cuda = not args.dry_run
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = ["256x64x1000"] if args.dry_run else args.shapes.split(",")
    chunks = [32, 0] if args.dry_run else [int(c) for c in args.chunks.split(",")]
    if cuda:
        print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__}")
    for shape in shapes:
        n, h, v = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        hidden = torch.randn(n, h, device=dev, generator=g).to(dtype)
        weight = (torch.randn(v, h, device=dev, generator=g) * (2.0 / h**0.5)).to(dtype)
        target = torch.randint(0, v, (n,), device=dev, generator=g)
        adv = torch.randn(n, device=dev, generator=g)
        with torch.no_grad():
            old, _ = rl_losses.linear_token_log_probs(hidden, weight, target)
            old = old + 0.01 * torch.randn(n, device=dev, generator=g)
            logits = hidden @ weight.t()
            grad = torch.randn_like(logits)
        floor = {
            "hidden@W.T": lambda: torch.mm(hidden, weight.t()),
            "G@W": lambda: torch.mm(grad, weight),
            "G.T@hidden": lambda: torch.mm(grad.t(), hidden),
        }
        try:
            torch.mm(grad.t(), hidden, out_dtype=torch.float32)
            floor["G.T@hidden->fp32"] = lambda: torch.mm(grad.t(), hidden, out_dtype=torch.float32)
        except (TypeError, RuntimeError) as e:
            print(f"  (no out_dtype GEMM: {str(e)[:80]})")
        times = {}
        with torch.no_grad():
            for k, f in floor.items():
                f()
                times[k] = median_ms(f, args.reps, cuda)
        gemm3 = sum(times[k] for k in ("hidden@W.T", "G@W", "G.T@hidden"))
        print(f"\n== {args.op} N={n} H={h} V={v} {dtype}: GEMM floor {gemm3:.3f} ms  "
              + "  ".join(f"{k} {t:.3f}" for k, t in times.items()))
        del logits, grad
        hw = hidden.clone().requires_grad_()
        ww = weight.clone().requires_grad_()
        for c in chunks:
            def step():
                hw.grad = ww.grad = None
                if args.op == "ce":
                    loss = rl_losses.linear_cross_entropy(hw, ww, target, chunk_size=c or None)
                else:
                    loss = rl_losses.linear_grpo_loss(hw, ww, target, adv, old, chunk_size=c or None).loss
                loss.backward()

            for _ in range(2):
                step()
            peak = ""
            if cuda:
                hw.grad = ww.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                grads = hw.grad.nbytes + ww.grad.nbytes
                peak = f"extra peak {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB " \
                       f"({(torch.cuda.max_memory_allocated() - base - grads) / 2**20:.0f} beyond the gradients)"
            ms = median_ms(step, args.reps, cuda)
            print(f"  chunk {c or 'default'}: {ms:.3f} ms = {ms / gemm3:.3f} x floor  {peak}")
            if cuda:
                per_kind, top = kernel_times(step)
                print("    by kind: " + "  ".join(f"{k} {t:.3f} ms" for k, t in sorted(per_kind.items())))
                for total, count, name in top:
                    print(f"    {total:8.3f} ms {count:4d} x  {name[:110]}")
        del hw, ww
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
