"""Compare launch settings of the fused row kernel on one GPU: RL_LOSSES_ROW_CACHE_KB (shared-memory row
cache) and RL_LOSSES_ROW_GRID (persistent, or one block per row), given as KB[:grid] settings.

Each setting runs in its own process (the knobs are read once per process). Per setting: median ms of
fwd+bwd of cross-entropy and GRPO at the given shapes (bf16), as a fraction of the device-to-device copy
ceiling measured in the same process over the minimal bytes (read logits once + write the gradient once).

    python3 benchmarks/tune_row_cache.py --settings 0,100,200 --shapes 16384x128256,16384x32000
"""
import argparse
import json
import os
import subprocess
import sys


def child(shapes, reps):
    import torch

    import rl_losses

    def timed(fn, n=reps):
        for _ in range(3):
            fn()
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ceiling = 2 * src.numel() / (timed(lambda: dst.copy_(src)) * 1e-3) / 1e9
    del src, dst
    out = {"ceiling_GBps": ceiling, "rows": []}
    for n, v in shapes:
        logits = (torch.randn(n, v, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
        target = torch.randint(0, v, (n,), device="cuda")
        adv = torch.randn(n, device="cuda")
        old = torch.randn(n, device="cuda") - 10
        def run(loss_fn):
            def fn():
                logits.grad = None  # a fresh gradient each time: no accumulation pass
                loss_fn().backward()
            return fn

        def split_ce():
            # statistics pass, then the gradient pass (the tensor-parallel path with one rank)
            stats = torch.ops.rl_losses.row_stats(logits.detach(), target)
            return torch.ops.rl_losses.cross_entropy(logits, target, row_stats=stats)[0]

        ops = {
            "ce": run(lambda: rl_losses.cross_entropy(logits, target)),
            "ce_split": run(split_ce),
            "grpo": run(lambda: rl_losses.grpo_loss(logits, target, adv, old, divisor=float(n)).loss),
        }
        for name, fn in ops.items():
            ms = timed(fn)
            logits.grad = None
            gbps = 2 * logits.numel() * logits.element_size() / (ms * 1e-3) / 1e9
            out["rows"].append({"op": name, "N": n, "V": v, "ms": ms, "GBps": gbps, "pct": 100 * gbps / ceiling})
        del logits
    print("RESULT " + json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default="0,100,200")
    ap.add_argument("--shapes", default="16384x128256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.child:
        return child(shapes, args.reps)
    print(f"{'cache KB':>8} {'op':>5} {'N':>6} {'V':>7} {'ms':>7} {'GB/s':>6} {'%ceil':>6}")
    for kb in args.settings.split(","):
        cache_kb, _, grid = kb.partition(":")
        env = dict(os.environ, RL_LOSSES_ROW_CACHE_KB=cache_kb, RL_LOSSES_ROW_GRID=grid or "persistent")
        r = subprocess.run([sys.executable, __file__, "--child", "--shapes", args.shapes, "--reps", str(args.reps)],
                           env=env, capture_output=True, text=True)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            print(f"{kb:>8} failed: {r.stderr[-800:]}")
            continue
        res = json.loads(lines[0][7:])
        for row in res["rows"]:
            print(f"{kb:>8} {row['op']:>5} {row['N']:>6} {row['V']:>7} {row['ms']:7.3f} {row['GBps']:6.0f} "
                  f"{row['pct']:6.1f}   (ceiling {res['ceiling_GBps']:.0f} GB/s)")


if __name__ == "__main__":
    main()
