"""Times distillation and the fused head on a GPU, side by side with their peers, in one run.

    python benchmarks/bench_distill_head.py [--n 16384] [--v 128256] [--dtype bfloat16] [--reps 20]

Distillation (forward KL, reverse KL, JSD β=0.5; student and teacher logits of one dtype): rl_losses against
torch.compile of the float64-free reference formula, and Liger-Kernel's LigerJSD (when installed; it takes
log-probabilities, so its time includes a log_softmax of each input), forward + backward, with the floor
(read the student, read the teacher, write the gradient) at the measured copy rate. The fused head:
CE + z-loss + GRPO in one call against GRPO alone and the three separate ops. CUDA-event timing after warm-up,
median of `reps` runs. Prints one line per case.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import rl_losses
from rl_losses.head import fused_head_loss


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_rate(nbytes: int, reps: int) -> float:
    """Bytes per millisecond of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), reps)


def torch_distillation(x, t, kind):
    log_q = torch.log_softmax(x.float(), -1)
    log_p = torch.log_softmax(t.float(), -1)
    if kind == "forward_kl":
        per = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif kind == "reverse_kl":
        per = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        log_m = torch.logaddexp(log_p, log_q) - 0.6931471805599453
        per = 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1)
    return per.mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dtype, n, v = getattr(torch, args.dtype), args.n, args.v
    print(f"device {torch.cuda.get_device_name()}, N={n}, V={v}, {args.dtype}, torch {torch.__version__}")
    x = (torch.randn(n, v, device="cuda") * 2).to(dtype).requires_grad_()
    teacher = (x.detach().float() + torch.randn(n, v, device="cuda")).to(dtype)
    elem = x.element_size()
    rate = copy_rate(2 * n * v * elem, args.reps)
    floor_ms = 3 * n * v * elem / rate
    compiled = torch.compile(torch_distillation)
    try:
        from liger_kernel.transformers import LigerJSD
    except ImportError:
        LigerJSD = None

    def step(loss_fn):
        def run():
            x.grad = None
            loss_fn().backward()
        return run

    for kind in ("forward_kl", "reverse_kl", "jsd"):
        rows = {"rl_losses": step(lambda: rl_losses.distillation_loss(x, teacher, kind=kind, beta=0.5).loss),
                "torch.compile": step(lambda: compiled(x, teacher, kind))}
        if LigerJSD is not None:
            beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}[kind]
            jsd = LigerJSD(beta=beta)
            rows["liger"] = step(lambda: jsd(torch.log_softmax(x.float(), -1).to(dtype),
                                             torch.log_softmax(teacher.float(), -1).to(dtype)))
        for name, fn in rows.items():
            ms = timed(fn, args.reps)
            print(f"distillation {kind:11s} {name:14s} {ms:8.3f} ms   floor {floor_ms:.3f} ms "
                  f"({100 * floor_ms / ms:5.1f}% of it)")
        torch.cuda.empty_cache()

    target = torch.randint(0, v, (n,), device="cuda")
    target[torch.rand(n, device="cuda") < 0.2] = -100
    adv = torch.randn(n, device="cuda")
    with torch.no_grad():
        old = torch.log_softmax(x.float(), -1).gather(-1, target.clamp_min(0)[:, None])[:, 0] + 0.1
    head = dict(label_weight=1.0, z_loss_weight=1e-4, grpo_weight=1.0, advantages=adv, old_log_probs=old)
    rows = {"fused CE+z+GRPO": step(lambda: fused_head_loss(x, target, **head).loss),
            "GRPO alone": step(lambda: rl_losses.grpo_loss(x, target, adv, old).loss),
            "3 separate ops": step(lambda: rl_losses.cross_entropy(x, target) + 1e-4 * rl_losses.z_loss(
                x, loss_mask=target >= 0) + rl_losses.grpo_loss(x, target, adv, old).loss)}
    for name, fn in rows.items():
        print(f"head {name:18s} {timed(fn, args.reps):8.3f} ms")


if __name__ == "__main__":
    main()
