"""The fused lm_head against its peers: the loss step a trainer runs from hidden states, forward and backward
(the gradients of hidden and of the lm_head weight), bf16, every library side by side in one run.

    python3 benchmarks/bench_head_peers.py --out OUT                  # the 4 shapes below, every arm (GPU)
    python3 benchmarks/bench_head_peers.py --quick --out OUT          # 2 shapes
    python3 benchmarks/bench_head_peers.py --dry-run --out /tmp/x     # CPU, tiny shapes: checks the logic
    python3 benchmarks/report.py --add OUT/head_peers.json --write    # record a run in results/ and RESULTS.md

Shapes N x H x V: N = 16384 tokens (8 sequences of 2048) with (H, V) in (2048, 128256), (2048, 151936),
(4096, 151936), (4096, 262144); --quick: the second and third. The arms (head_peers.ARMS, NOTES) compute GRPO
(ppo_clip, epsilon 0.2, token mean) or cross-entropy; rl_losses in both modes, TRL 1.16's chunked log-prob kernel,
Liger 0.8.5, verl 0.9.1 (its PyTorch and Triton fused heads), Cut Cross-Entropy 25.1.1 and torch.compile of a
chunked eager loss. Per (shape, arm): the median ms of --reps steps (timing.median_ms: CUDA events) after a
checked call and a warm-up, its ratio to the GEMM floor (profile_linear.floor_ms: hidden @ W.T, G @ W,
G.T @ hidden, each timed alone), and the peak memory beyond the inputs and the gradients the step returns. Before
it is timed, each arm's loss and gradients are compared with rl_losses' fast mode on the same inputs (loss
within TOL_LOSS of max(|loss|, mean |A|), gradients' relative Frobenius error within TOL_GRAD); an arm that does
not agree is reported and not timed; one that fails to import or run prints why and is skipped. --time-budget
starts no arm that would end past it. OUT/head_peers.json (report.py's format) and OUT/head_peers.md are
rewritten after every arm.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
import traceback

if "--dry-run" in sys.argv:  # Triton's interpreter, set before triton loads: the Triton arms run on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import head_peers  # noqa: E402
import rl_losses  # noqa: E402
import run_output  # noqa: E402
from profile_linear import floor_ms, inputs  # noqa: E402
from report import head_peers_table  # noqa: E402
from timing import git_commit, median_ms, peak_beyond_grads_mib  # noqa: E402

SHAPES = [(16384, 2048, 128256), (16384, 2048, 151936), (16384, 4096, 151936), (16384, 4096, 262144)]
QUICK = SHAPES[1:3]
DRY = [(256, 64, 1000), (192, 48, 1200)]
TOL_LOSS, TOL_GRAD = 1e-2, 5e-2  # bf16 gradients; Liger's CE sums grad_weight in bf16, CCE filters entries
DRIFT = 0.1  # old log-probs = current + N(0, DRIFT²) (and profile_linear's 0.01): ~7% of the ratios clip


def make_inputs(n: int, h: int, v: int, device: str, dtype, seed: int = 0) -> dict:
    """profile_linear.inputs (hidden ~ N(0, 1), weight ~ N(0, 4/H), labels, old log-probs near the current ones)
    with DRIFT more between the old and current log-probs, and per-sequence advantages broadcast to their tokens."""
    x = inputs(n, h, v, device, dtype, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    adv_seq = torch.randn(head_peers.SEQS, device=device, generator=g)
    return {"hidden": x["hidden"], "weight": x["weight"], "target": x["target"], "device": device,
            "adv_seq": adv_seq, "adv": adv_seq.repeat_interleave(n // head_peers.SEQS),
            "old": x["old"].float() + DRIFT * torch.randn(n, device=device, generator=g)}


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_arm(name: str, x: dict, ref: dict | None, reps: int, device: str) -> tuple[dict, dict | None]:
    """(row, this arm's loss and gradients when it is its op's reference)."""
    op, make = head_peers.ARMS[name]
    hw, ww = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    fn = make(x)

    def step():
        hw.grad = ww.grad = None
        loss = fn(hw, ww)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    loss = step().detach().float()
    row = {"loss": loss.item(), "first_call_s": round(time.perf_counter() - t0, 2)}
    mine = {"loss": loss, "grad_hidden": hw.grad.clone(), "grad_weight": ww.grad.clone()}
    if ref is None:
        row["check"] = "ref"
    else:
        scale = max(abs(ref["loss"].item()), x["adv"].abs().mean().item() if op == "grpo" else 0.0)
        row["d_loss"] = abs(loss.item() - ref["loss"].item()) / scale
        row["d_grad_hidden"] = rel_err(mine["grad_hidden"], ref["grad_hidden"])
        row["d_grad_weight"] = rel_err(mine["grad_weight"], ref["grad_weight"])
        ok = row["d_loss"] <= TOL_LOSS and max(row["d_grad_hidden"], row["d_grad_weight"]) <= TOL_GRAD
        row["check"] = "ok" if ok else "MISMATCH"
        if not ok:
            return row, None
    del mine["grad_hidden"], mine["grad_weight"]  # kept only as the reference, below
    step()  # warm-up
    if device == "cuda":
        row["beyond_grads_mib"] = round(peak_beyond_grads_mib(step, (hw, ww)), 1)
    row["ms"] = round(median_ms(step, reps, device), 3)
    reference = {"loss": loss, "grad_hidden": hw.grad, "grad_weight": ww.grad} if ref is None else None
    return row, reference


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("trl", "liger-kernel", "verl", "cut-cross-entropy", "transformers", "triton"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="shapes 16384x2048x151936 and 16384x4096x151936")
    ap.add_argument("--shapes", default=None, help="NxHxV,... (default: the 4 shapes)")
    ap.add_argument("--arms", default=",".join(head_peers.ARMS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds: no arm starts that would end past it")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, fp32: checks the logic")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    reps = min(args.reps, 2) if args.dry_run else args.reps
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shapes = DRY if args.dry_run else [tuple(int(s) for s in shape.split("x")) for shape in args.shapes.split(",")] \
        if args.shapes else QUICK if args.quick else SHAPES
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in head_peers.ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {list(head_peers.ARMS)}")
    os.makedirs(args.out, exist_ok=True)
    meta = {"script": "bench_head_peers.py", "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python3", *map(shlex.quote, sys.argv)]), "git": git_commit(),
            "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "versions": versions(),
            "tolerance": {"loss": TOL_LOSS, "grad": TOL_GRAD}, "notes": head_peers.NOTES}
    print(f"bench_head_peers: {meta['device']} · torch {meta['torch']} · " +
          " · ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    rows: list[dict] = []

    def write():
        run_output.write_json(os.path.join(args.out, "head_peers.json"), meta, rows)
        with open(os.path.join(args.out, "head_peers.md"), "w") as f:
            f.write("\n".join(head_peers_table(rows)) + "\n")

    for n, h, v in shapes:
        x = make_inputs(n, h, v, device, dtype)
        floor, parts = floor_ms(x, reps, device)
        shape = {"n": n, "h": h, "v": v}
        rows.append({"op": "gemm", **shape, "provider": "gemm_floor", "ms": round(floor, 3),
                     "parts_ms": {k: round(t, 3) for k, t in parts.items()}})
        print(f"\n== N={n} H={h} V={v} {meta['dtype']}: GEMM floor {floor:.3f} ms")
        refs: dict[str, dict] = {}
        for name in arms:
            op = head_peers.ARMS[name][0]
            row = {"op": op, **shape, "provider": name}
            # The first call, a warm-up, the memory call and the timed ones, at up to 3x the floor each (more for
            # the eager and compiled arms: their compile is the first call).
            need = (reps + 3) * 3 * floor / 1e3 + (30 if name in ("liger_grpo", "torch_compile_chunked") else 5)
            if args.time_budget is not None and time.perf_counter() - t_start + need > args.time_budget:
                row["skipped"] = f"time budget ({need:.0f} s needed)"
            elif op not in refs and name not in ("rl_losses_fast", "rl_losses_ce_fast"):
                row["skipped"] = "its op's reference (rl_losses fast) did not run"
            else:
                try:
                    result, ref = run_arm(name, x, refs.get(op), reps, device)
                    row.update(result)
                    if ref is not None:
                        refs[op] = ref
                    if row.get("ms") is not None:
                        row["x_floor"] = round(row["ms"] / floor, 3)
                except Exception as e:  # noqa: BLE001  (an arm that cannot import or run is reported, not fatal)
                    where = traceback.extract_tb(e.__traceback__)[-1]
                    row["error"] = (f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} "
                                    f"({os.path.basename(where.filename)}:{where.lineno})")
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            status = row.get("error") or row.get("skipped") or (
                f"{row['ms']:9.3f} ms {row['x_floor']:6.3f} x floor" if row.get("ms") is not None else "not timed")
            print(f"  {name:22s} {status}  check {row.get('check', '-')}"
                  + "".join(f"  {k} {row[k]:.1e}" for k in ("d_loss", "d_grad_hidden", "d_grad_weight") if k in row)
                  + (f"  {row['beyond_grads_mib']:.0f} MiB beyond grads" if "beyond_grads_mib" in row else ""))
            write()
        del x, refs
    write()
    print("\n" + "\n".join(head_peers_table(rows)))
    print(f"\nwrote {os.path.join(args.out, 'head_peers.json')} and head_peers.md "
          f"({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
