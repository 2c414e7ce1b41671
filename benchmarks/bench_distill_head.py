"""Times distillation and the fused head on a GPU, side by side with their peers, in one run.

    python benchmarks/bench_distill_head.py [--n 16384] [--v 128256] [--dtype bfloat16] [--reps 20] \
        [--hidden 4096] [--only all|head_distill] [--out OUT.json]

Distillation (forward KL, reverse KL, JSD β=0.5; student and teacher logits of one dtype): rl_losses (and in
its batch-invariant mode, "b-inv") against torch.compile of the reference formula and Liger-Kernel's JSD kernel (liger_kernel.ops.jsd through LigerJSD,
when installed; it takes log-probabilities, so its time includes a log_softmax of each input), forward +
backward, with the floor (read the student, read the teacher, write the gradient) at the measured copy rate.
From a sparse teacher: topk_distillation (K = 20, 64, 256) against plain cross-entropy on the same logits (target:
at most 1.1x) and torch.compile of verl's forward_kl_topk, with the floor (read the logits, write the gradient).
From hidden states (``--hidden`` > 0): rl_losses.linear_distillation_loss after the teacher's matmul against
Liger's LigerFusedLinearJSD, which does both. The fused head: CE + z-loss + GRPO in one call against GRPO alone
and the three separate ops; CE + z-loss + GSPO (64 packed documents) against GSPO alone (both read the logits
twice: statistics, then the gradient) and the three separate ops. The fused head's
distillation term: CE + KL (and CE + z + GRPO + KL) against distillation alone (target: within +5%) and the
separate ops (``--only head_distill``: these rows alone; ``--only distill``: those and rl_losses' distillation
rows, no peers). CUDA-event timing after warm-up (benchmarks/timing.py), median of `reps` runs. Prints one line per
case; ``--out`` writes the rows as JSON for ``benchmarks/report.py --add``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys

import torch

import rl_losses
from rl_losses.fused_head import fused_head_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timer, copy_ceiling, git_commit  # noqa: E402


TIMER = Timer("cuda")


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() after 3 warm-up calls (timing.Timer)."""
    for _ in range(3):
        fn()
    TIMER.sync()
    return statistics.median(TIMER(fn, reps))


def timed_or_none(fn, reps: int, label: str) -> float | None:
    """timed(fn, reps), or None (printed under `label`) where the call fails: a peer failing (memory, compile)
    leaves the other rows."""
    try:
        return timed(fn, reps)
    except Exception as e:  # noqa: BLE001
        print(f"{label} failed: {type(e).__name__}: {e}"[:200])
        return None


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


def torch_forward_kl_topk(x, ids, log_p):
    # verl's compute_forward_kl_topk (fsdp/losses.py) without its clamp: the student's full log_softmax, gathered.
    log_q = torch.log_softmax(x.float(), -1).gather(-1, ids)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def policy_inputs(x):
    """Labels (20% unlabelled), advantages and old log-probs near the current ones, for the head's rows."""
    n, v = x.shape
    target = torch.randint(0, v, (n,), device="cuda")
    target[torch.rand(n, device="cuda") < 0.2] = -100
    adv = torch.randn(n, device="cuda")
    with torch.no_grad():
        old = torch.log_softmax(x.float(), -1).gather(-1, target.clamp_min(0)[:, None])[:, 0] + 0.1
    return target, adv, old


def head_distillation(x, teacher, target, adv, old, times, record, step, reps) -> None:
    """The fused head's distillation term: CE + KL (and CE + z + GRPO + KL) in one call against distillation
    alone on the same logits and teacher (the target: within +5% of it), and the separate ops summed."""
    n, v = x.shape
    for kind in ("forward_kl", "jsd"):
        kd = dict(distillation_weight=1.0, teacher_logits=teacher, kind=kind, distillation_beta=0.5)
        rows = {f"fused CE+{kind}": step(lambda: fused_head_loss(x, target, label_weight=1.0, **kd).loss),
                f"fused CE+z+GRPO+{kind}": step(lambda: fused_head_loss(
                    x, target, label_weight=1.0, z_loss_weight=1e-4, z_loss_mask=target >= 0, grpo_weight=1.0,
                    advantages=adv, old_log_probs=old, **kd).loss),
                f"distillation alone {kind}": step(lambda: rl_losses.distillation_loss(
                    x, teacher, kind=kind, beta=0.5).loss),
                f"CE + distillation {kind}": step(lambda: rl_losses.cross_entropy(x, target) + rl_losses.distillation_loss(
                    x, teacher, kind=kind, beta=0.5).loss)}
        for name, fn in rows.items():
            times[name] = timed(fn, reps)
            record("head_distill", name, times[name], n, v)
            print(f"head {name:28s} {times[name]:8.3f} ms")
        base = times[f"distillation alone {kind}"]
        for name in (f"fused CE+{kind}", f"fused CE+z+GRPO+{kind}"):
            print(f"head {name} over distillation alone: {100 * (times[name] / base - 1):+.1f}% (target: within +5%)")
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size of the linear cases (0: skip them)")
    ap.add_argument("--linear-n", type=int, default=4096, help="tokens of the linear cases")
    ap.add_argument("--out", help="write the rows as JSON (benchmarks/report.py --add)")
    ap.add_argument("--only", choices=["all", "head_distill", "distill"], default="all",
                    help="head_distill: the fused head's distillation rows alone; distill: those and rl_losses' "
                         "distillation rows (no peers)")
    args = ap.parse_args()
    dtype, n, v = getattr(torch, args.dtype), args.n, args.v
    print(f"device {torch.cuda.get_device_name()}, N={n}, V={v}, {args.dtype}, torch {torch.__version__}")
    x = (torch.randn(n, v, device="cuda") * 2).to(dtype).requires_grad_()
    teacher = (x.detach().float() + torch.randn(n, v, device="cuda")).to(dtype)
    elem = x.element_size()
    rate = copy_ceiling("cuda", TIMER, 2 * n * v * elem, args.reps)["gbps"] * 1e6  # bytes per ms
    floor_ms = 3 * n * v * elem / rate
    results = []

    def record(op, provider, ms, n_rows, vocab, floor=None):
        row = {"op": op, "n": n_rows, "v": vocab, "dtype": args.dtype, "provider": provider, "ms": round(ms, 4)}
        if floor is not None:
            row["floor_ms"] = round(floor, 4)
            row["pct_ceiling"] = round(100 * floor / ms, 1)
        results.append(row)
        return row

    def step(loss_fn, *tensors):
        def run():
            for t in tensors or (x,):
                t.grad = None
            loss_fn().backward()
        return run

    if args.only == "distill":
        for kind in ("forward_kl", "reverse_kl", "jsd"):
            ms = timed(step(lambda: rl_losses.distillation_loss(x, teacher, kind=kind, beta=0.5).loss), args.reps)
            record(f"distill_{kind}", "rl_losses", ms, n, v, floor_ms)
            print(f"distillation {kind:11s} rl_losses      {ms:8.3f} ms   floor {floor_ms:.3f} ms "
                  f"({100 * floor_ms / ms:5.1f}% of it)")
    if args.only in ("head_distill", "distill"):
        target, adv, old = policy_inputs(x)
        head_distillation(x, teacher, target, adv, old, {}, record, step, args.reps)
        write_out(args, results, rate, None)
        return
    compiled = torch.compile(torch_distillation)
    try:
        from importlib.metadata import version

        from liger_kernel.transformers import LigerFusedLinearJSD, LigerJSD
        liger_version = version("liger-kernel")
    except ImportError:
        LigerJSD = LigerFusedLinearJSD = liger_version = None

    def invariant(kind):
        # The batch-invariant mode, whose rows run the separate passes (statistics, JSD's sums, gradient).
        with rl_losses.batch_invariant():
            return rl_losses.distillation_loss(x, teacher, kind=kind, beta=0.5).loss

    for kind in ("forward_kl", "reverse_kl", "jsd"):
        rows = {"rl_losses": step(lambda: rl_losses.distillation_loss(x, teacher, kind=kind, beta=0.5).loss),
                "rl_losses b-inv": step(lambda: invariant(kind)),
                "torch.compile": step(lambda: compiled(x, teacher, kind))}
        if LigerJSD is not None:
            beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}[kind]
            jsd = LigerJSD(beta=beta)
            rows["liger"] = step(lambda: jsd(torch.log_softmax(x.float(), -1).to(dtype),
                                             torch.log_softmax(teacher.float(), -1).to(dtype)))
        for name, fn in rows.items():
            ms = timed_or_none(fn, args.reps, f"distillation {kind:11s} {name:14s}")
            if ms is None:
                continue
            record(f"distill_{kind}", name, ms, n, v, floor_ms)
            print(f"distillation {kind:11s} {name:14s} {ms:8.3f} ms   floor {floor_ms:.3f} ms "
                  f"({100 * floor_ms / ms:5.1f}% of it)")
        torch.cuda.empty_cache()

    # From a sparse teacher: topk_distillation (K in 20, 64, 256; forward KL with tails none and tail, reverse KL
    # and JSD with tail) against plain cross-entropy
    # on the same logits (the target: within 1.1x of it) and torch.compile of verl's compute_forward_kl_topk formula.
    labels = torch.randint(0, v, (n,), device="cuda")
    ce_ms = timed(step(lambda: rl_losses.cross_entropy(x, labels)), args.reps)
    record("cross_entropy", "rl_losses", ce_ms, n, v, 2 * n * v * elem / rate)
    print(f"cross_entropy            rl_losses      {ce_ms:8.3f} ms")
    compiled_topk = torch.compile(torch_forward_kl_topk)
    for k in (20, 64, 256):
        top, teacher_ids = teacher.topk(k, -1)
        teacher_lp = top.float() - torch.logsumexp(teacher.float(), -1, keepdim=True)
        rows = {f"rl_losses {tail}": step(lambda tail=tail: rl_losses.topk_distillation_loss(
            x, labels, teacher_ids, teacher_lp, tail=tail).loss) for tail in ("none", "tail")}
        rows.update({f"rl_losses {kind} tail": step(lambda kind=kind: rl_losses.topk_distillation_loss(
            x, labels, teacher_ids, teacher_lp, tail="tail", kind=kind).loss) for kind in ("reverse_kl", "jsd")})
        rows["torch.compile"] = step(lambda: compiled_topk(x, teacher_ids, teacher_lp))
        for name, fn in rows.items():
            ms = timed_or_none(fn, args.reps, f"topk K={k} {name:18s}")
            if ms is None:
                continue
            record(f"topk_distill_k{k}", name, ms, n, v, 2 * n * v * elem / rate)
            print(f"topk distillation K={k:<4d} {name:18s} {ms:8.3f} ms   {ms / ce_ms:5.2f}x cross_entropy")
        torch.cuda.empty_cache()

    if args.hidden > 0:
        # From hidden states: the teacher's logits are its matmul (no gradient), the student's never whole.
        ln, h = args.linear_n, args.hidden
        hs = (torch.randn(ln, h, device="cuda") / h ** 0.5).to(dtype).requires_grad_()
        ws = (torch.randn(v, h, device="cuda")).to(dtype).requires_grad_()
        ht = (hs.detach().float() + 0.1 * torch.randn(ln, h, device="cuda")).to(dtype)
        wt = (ws.detach().float() + 0.1 * torch.randn(v, h, device="cuda")).to(dtype)
        rows = {"rl_losses": step(lambda: rl_losses.linear_distillation_loss(
            hs, ws, ht @ wt.t(), kind="jsd", beta=0.5), hs, ws)}
        if LigerFusedLinearJSD is not None:
            fused = LigerFusedLinearJSD(jsd_beta=0.5)
            rows["liger"] = step(lambda: fused(hs, ws, ht, wt, None), hs, ws)
        for name, fn in rows.items():
            ms = timed_or_none(fn, args.reps, f"linear jsd {name:14s}")
            if ms is None:
                continue
            record(f"linear_distill_jsd_h{h}", name, ms, ln, v)
            print(f"linear jsd (N={ln}, H={h}) {name:14s} {ms:8.3f} ms")
        del hs, ws, ht, wt
        torch.cuda.empty_cache()

    target, adv, old = policy_inputs(x)
    # The z-loss over the labelled tokens (Fast-LLM's loss_mask), as the separate ops below: then the head reads
    # the rows GRPO alone reads, and the target is within 5% of it.
    head = dict(label_weight=1.0, z_loss_weight=1e-4, z_loss_mask=target >= 0, grpo_weight=1.0, advantages=adv,
                old_log_probs=old)
    rows = {"fused CE+z+GRPO": step(lambda: fused_head_loss(x, target, **head).loss),
            "fused CE+GRPO": step(lambda: fused_head_loss(x, target, label_weight=1.0, grpo_weight=1.0,
                                                          advantages=adv, old_log_probs=old).loss),
            "GRPO alone": step(lambda: rl_losses.grpo_loss(x, target, adv, old).loss),
            "3 separate ops": step(lambda: rl_losses.cross_entropy(x, target) + 1e-4 * rl_losses.z_loss(
                x, loss_mask=target >= 0) + rl_losses.grpo_loss(x, target, adv, old).loss)}
    times = {}
    for name, fn in rows.items():
        times[name] = timed(fn, args.reps)
        record("head", name, times[name], n, v)
        print(f"head {name:18s} {times[name]:8.3f} ms")
    base = times["GRPO alone"]
    for name in ("fused CE+z+GRPO", "fused CE+GRPO"):
        print(f"head {name} over GRPO alone: {100 * (times[name] / base - 1):+.1f}% (target: within +5%)")
    doc = torch.arange(n, device="cuda") * 64 // n
    gspo = dict(advantages=adv, old_log_probs=old, document_index=doc, num_documents=64)
    rows = {"fused CE+z+GSPO": step(lambda: fused_head_loss(x, target, label_weight=1.0, z_loss_weight=1e-4,
                                                            z_loss_mask=target >= 0, gspo_weight=1.0, **gspo).loss),
            "GSPO alone": step(lambda: rl_losses.gspo_loss(x, target, adv, old, doc, num_documents=64).loss),
            "3 separate ops (GSPO)": step(lambda: rl_losses.cross_entropy(x, target) + 1e-4 * rl_losses.z_loss(
                x, loss_mask=target >= 0) + rl_losses.gspo_loss(x, target, adv, old, doc, num_documents=64).loss)}
    for name, fn in rows.items():
        times[name] = timed(fn, args.reps)
        record("head", name, times[name], n, v)
        print(f"head {name:18s} {times[name]:8.3f} ms")
    print(f"head fused CE+z+GSPO over GSPO alone: {100 * (times['fused CE+z+GSPO'] / times['GSPO alone'] - 1):+.1f}% "
          "(target: within +5%)")
    head_distillation(x, teacher, target, adv, old, times, record, step, args.reps)

    write_out(args, results, rate, liger_version)


def write_out(args, results, rate, liger_version) -> None:
    if args.out:
        meta = {"script": "bench_distill_head.py", "device": torch.cuda.get_device_name(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "command": " ".join(["python", *map(shlex.quote, sys.argv)]), "git": git_commit(),
                "torch": torch.__version__, "liger_kernel": liger_version,
                "copy_ceiling_gbps": round(rate / 1e6)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
