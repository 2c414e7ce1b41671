"""GPU benchmark of rl_losses.linear_token_log_probs (per-token log-probs and entropies from hidden states)
against its GEMM floor and verl's fused kernels, side by side in one run.

    python3 benchmarks/bench_token_log_probs.py --out OUT            # GPU, bf16: the SHAPES below
    python3 benchmarks/bench_token_log_probs.py --shapes 16384x4096x151936 --out OUT
    python3 benchmarks/bench_token_log_probs.py --dry-run --out /tmp/x   # CPU, tiny shapes: checks the logic

Each provider runs forward and backward (log-probs and entropy, random upstream gradients for both; hidden and
weight require grad): median ms of CUDA-event-timed calls after warm-up, the ratio to the GEMM floor (the three
GEMMs no fused form avoids: hidden @ W.T, G @ W, G.T @ hidden, as plain bf16 matmuls), extra peak memory, and
the agreement of log-probs, entropy and grad_weight with rl_losses. Shapes (N x H x V): the actor's micro-batch of
16384 packed tokens at Qwen2.5-1.5B's (H=1536), Qwen2.5-7B's (H=3584, V=152064) and an H=4096 head. Providers:
rl_losses with strategy "fast" and "lean" (what rl_losses.integrations.verl runs, per its lm_head strategy); verl's
FusedLinearForPPO (its PyTorch implementation, chunks of 512 rows) and verl's Triton linear_cross_entropy, from
verl or, where verl's package does not import (its dependencies missing), from its files (``--verl-kernels``, by
default the installed package's verl/utils/kernel; their one import from the rest of verl, verl.utils.device, is
provided by a shim here). OUT/bench_token_log_probs.json
holds the results.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch

import rl_losses
from timing import median_ms, write_results

SHAPES = "16384x1536x151936,16384x3584x152064,16384x4096x151936"
DRY = "256x64x1000"


def load_verl_kernels(folder):
    """verl's Triton kernel modules from copies of their files, as ``verl.utils.kernel`` (a namespace made here,
    with the four verl.utils.device functions the kernels use)."""
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_name = lambda: "cuda" if torch.cuda.is_available() else "cpu"
    device.get_torch_device = lambda: torch.cuda
    device.get_device_capability = lambda device_id=0: (torch.cuda.get_device_capability(device_id)
                                                        if torch.cuda.is_available() else (None, None))
    for name, path in (("verl", []), ("verl.utils", []), ("verl.utils.kernel", [os.path.abspath(folder)])):
        module = types.ModuleType(name)
        module.__path__ = path
        sys.modules[name] = module
    sys.modules["verl.utils.device"] = device
    import importlib

    return importlib.import_module("verl.utils.kernel.linear_cross_entropy")


def providers(verl_kernels):
    out = {f"rl_losses{'' if s == 'fast' else '_' + s}": (lambda s: lambda h, w, t: rl_losses.linear_token_log_probs(
        h, w, t, compute_entropy=True, strategy=s))(s) for s in ("fast", "lean")}
    from head_peers import _load_file, _verl_dir  # verl's files from its installed package, without its __init__

    try:
        try:
            from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction
        except ImportError:
            FusedLinearForPPOFunction = _load_file("verl_experimental_torch_functional", os.path.join(
                _verl_dir(), "utils", "experimental", "torch_functional.py")).FusedLinearForPPOFunction

        out["verl_torch"] = lambda h, w, t: FusedLinearForPPOFunction.apply(h, w, t, 1.0, 512)
    except ImportError as e:
        print(f"verl_torch skipped: {e}")
    try:
        try:
            from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy
        except ImportError:
            folder = verl_kernels or os.path.join(_verl_dir(), "utils", "kernel")
            LinearCrossEntropy = load_verl_kernels(folder).LinearCrossEntropy
            print(f"verl_triton: verl's kernel files loaded from {folder}")

        out["verl_triton"] = lambda h, w, t: LinearCrossEntropy.apply(h, w, t, 1.0, "none", None)
    except Exception as e:  # noqa: BLE001  (ImportError, or Triton failing without a GPU)
        print(f"verl_triton skipped: {e}")
    return out


def gemm_floor(h, w):
    logits = h @ w.t()
    torch.mm(logits, w)
    torch.mm(logits.t(), h)


def bench_shape(n, hs, v, args, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, hs, device=device, generator=gen).to(dtype)
    weight = (torch.randn(v, hs, device=device, generator=gen) * (2.0 / hs**0.5)).to(dtype)
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    g_lp, g_h = torch.randn(n, device=device, generator=gen), torch.randn(n, device=device, generator=gen)
    results = {"shape": dict(n=n, h=hs, v=v)}
    with torch.no_grad():
        gemm_floor(hidden, weight)
        results["gemm_floor_ms"] = median_ms(lambda: gemm_floor(hidden, weight), args.reps, device)
    reference = None
    for name, fn in providers(args.verl_kernels).items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def step():
            h.grad = w.grad = None
            lp, ent = fn(h, w, target)
            torch.autograd.backward([lp, ent], [g_lp.to(lp.dtype), g_h.to(ent.dtype)])
            return lp, ent

        try:
            for _ in range(3):
                lp, ent = step()
        except Exception as e:  # noqa: BLE001  (a provider that cannot run here is reported, not fatal)
            results[name] = {"error": repr(e)}
            continue
        if device == "cuda":
            torch.cuda.synchronize()
            h.grad = w.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = median_ms(step, args.reps, device)
        entry = {"ms": ms, "vs_gemm_floor": ms / results["gemm_floor_ms"]}
        if device == "cuda":
            lp, ent = step()
            torch.cuda.synchronize()
            entry["extra_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        outputs = (lp.float(), ent.float(), w.grad.float())
        if reference is None:
            reference = outputs
        else:
            entry["max_rel_diff_vs_rl_losses"] = {
                k: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for k, a, b in zip(("log_probs", "entropy", "grad_weight"), outputs, reference)}
        results[name] = entry
        print(n, hs, v, name, entry, flush=True)
        del h, w, lp, ent
    for name in ("verl_torch", "verl_triton"):
        for ours in ("rl_losses", "rl_losses_lean"):
            if "ms" in results.get(name, {}) and "ms" in results.get(ours, {}):
                results[f"{ours}_speedup_vs_{name}"] = results[name]["ms"] / results[ours]["ms"]
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--shapes", default=None, help=f"NxHxV,... (default {SHAPES})")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--verl-kernels", default=os.environ.get("RL_LOSSES_VERL_KERNELS"),
                        help="folder with verl's kernels.py and linear_cross_entropy.py (used when verl does not "
                             "import; default: those of the installed verl package)")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shapes or (DRY if args.dry_run else SHAPES)).split(",")]
    results = {"dtype": str(dtype), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "shapes": []}
    for n, hs, v in shapes:
        results["shapes"].append(bench_shape(n, hs, v, args, device, dtype))
        write_results(args.out, "bench_token_log_probs.json", results)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
