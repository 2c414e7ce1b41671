"""GRPO with each option of the policy family (docs/policy_losses.md) against plain GRPO and against Liger's
``triton_grpo_loss`` with the same option, fwd+bwd, side by side in one run.

    python3 benchmarks/bench_policy.py --out OUT              # N = 16384 (16 x 1024), V = 128256, bf16, CUDA
    python3 benchmarks/bench_policy.py --dry-run --out /tmp/x # CPU, a tiny shape: checks the logic only

Per option: the median of --repeats CUDA-event-timed fwd+bwd calls after warm-up, its ratio to plain GRPO's
time (the family promises no extra pass over the vocabulary: within 3%, except an on-policy sequence-level
rollout correction, which reads the logits twice by design), and Liger's time where Liger has the option
(it has no k1/k2 estimator, no entropy bonus and no mask bounds: those rows show '-'). Writes OUT/policy.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import rl_losses


def options(b, t, device, old, rollout, ref):
    """name -> (rl_losses kwargs, Liger kwargs or None)."""
    return {
        "plain": (dict(), dict()),
        "cispo": (dict(loss_type="cispo", epsilon_high=4.0), dict(loss_type="cispo", eps_high=4.0)),
        "sapo": (dict(loss_type="sapo"), dict(loss_type="sapo")),
        "on_policy": (dict(on_policy=True), dict(on_policy=True)),
        "token_truncate": (dict(rollout_log_probs=rollout, rollout_correction="token_truncate"),
                           dict(vllm_is_ratio=True)),
        "token_mask": (dict(rollout_log_probs=rollout, rollout_correction="token_mask"), None),
        "sequence_truncate": (dict(rollout_log_probs=rollout, rollout_correction="sequence_truncate"),
                              dict(vllm_is_ratio=True)),
        "k3_beta": (dict(ref_log_probs=ref, beta=0.04), dict(beta=0.04)),
        "k3_importance_weighted": (dict(ref_log_probs=ref, beta=0.04, kl_importance_weighted=True),
                                   dict(beta=0.04, use_bias_correction_kl=True)),
        "k1_beta": (dict(ref_log_probs=ref, beta=0.04, kl_estimator="k1"), None),
        "entropy_bonus": (dict(entropy_coefficient=0.01), None),
        "everything": (dict(loss_type="sapo", rollout_log_probs=rollout, rollout_correction="token_truncate",
                            ref_log_probs=ref, beta=0.04, kl_importance_weighted=True, entropy_coefficient=0.01),
                       None),
    }


def time_ms(fn, repeats, device):
    for _ in range(3):
        fn()
    if device == "cpu":
        import time
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    b, t, v = (2, 8, 64) if args.dry_run else (16, 1024, 128256)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    logits = (torch.randn(b, t + 1, v, device=device) * 2).to(dtype)  # Liger's layout: one more position
    target = torch.randint(0, v, (b, t), device=device)
    advantages = torch.randn(b, device=device)
    old = -torch.rand(b, t, device=device) * 5 - 8
    rollout = old + 0.1 * torch.randn_like(old)
    ref = old + 0.1 * torch.randn_like(old)
    liger = None
    if not args.dry_run:
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss as liger
        except ImportError:
            print("liger-kernel not installed: rl_losses only")
    x = logits[:, :-1].detach().clone().requires_grad_()
    rows = []
    for name, (ours, theirs) in options(b, t, device, old, rollout, ref).items():
        ours = dict(ours)
        old_arg = None if ours.pop("on_policy", False) else old

        def run_ours():
            rl_losses.grpo_loss(x, target, advantages, old_arg, **ours).loss.backward()
            x.grad = None

        row = dict(option=name, rl_losses_ms=time_ms(run_ours, args.repeats, device))
        if liger is not None and theirs is not None:
            theirs = dict(theirs)
            is_ratio = torch.exp(old - rollout).clamp(max=3.0) if theirs.pop("vllm_is_ratio", False) else None
            liger_old = None if theirs.pop("on_policy", False) else old
            beta = theirs.pop("beta", 0.0)
            y = logits.detach().clone().requires_grad_()

            def run_liger():
                loss = liger(y, liger_old, ref if beta else None, target, advantages, temperature=1.0, beta=beta,
                             inplace=True, vllm_is_ratio=is_ratio, reduce=True, **theirs)
                (loss[0] if isinstance(loss, tuple) else loss).backward()
                y.grad = None

            row["liger_ms"] = time_ms(run_liger, args.repeats, device)
        rows.append(row)
    plain = rows[0]["rl_losses_ms"]
    print(f"{'option':24s} {'rl_losses ms':>12s} {'vs plain':>9s} {'Liger ms':>9s} {'speed-up':>9s}")
    for r in rows:
        r["vs_plain"] = r["rl_losses_ms"] / plain
        lg = r.get("liger_ms")
        liger_ms = "-" if lg is None else f"{lg:.3f}"
        speedup = "-" if lg is None else f"{lg / r['rl_losses_ms']:.2f}x"
        print(f"{r['option']:24s} {r['rl_losses_ms']:12.3f} {r['vs_plain']:9.3f} {liger_ms:>9s} {speedup:>9s}")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", shape=[b * t, v],
                dtype=str(dtype), torch=torch.__version__)
    with open(os.path.join(args.out, "policy.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
