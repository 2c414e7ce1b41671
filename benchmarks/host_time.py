"""Host time per call at a tiny shape: each functional wrapper against the raw op it calls.

At 8 × 64 logits the kernels take next to nothing, so the time of a forward + backward call is the host's: the
dispatcher, the autograd node, the Python layer. The difference wrapper − raw op is what the Python layer adds (the
goal: ≤ 10 µs). Every functional wrapper, the configs' loss modules (against the op call each makes, with its
arguments) and verl's drop-in for its fused lm_head are timed; the TRL trainer's per-step calls are the linear
wrappers timed here. The no-autograd form (rl_losses.forward_backward, rows "fwd_bwd <op>") is timed against the raw
op's forward + backward through autograd. On CUDA the calls are timed on the host clock without a synchronisation
(one every 64 calls, untimed), so the numbers stay host time while the GPU keeps up.

    python benchmarks/host_time.py                 # CPU
    python benchmarks/host_time.py --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import rl_losses

ops = torch.ops.rl_losses


def _recorded(call, op: str):
    """The raw op call that `call` makes (its one call of ops.<op>), with the arguments it gives: the options a
    loss module or an integration passes are its own, so its raw op takes the same ones (at the schema's defaults
    too). Returns (raw call, its result)."""
    packet = getattr(ops, op)
    seen = []

    def record(*args, **kwargs):
        seen.append((args, kwargs))
        return packet(*args, **kwargs)

    record._op = record  # the wrappers call the packet's C++ function, its `_op`, outside torch.compile
    setattr(ops, op, record)
    try:
        call()
    finally:
        setattr(ops, op, packet)
    (args, kwargs), = seen
    return lambda: packet(*args, **kwargs)


def cases(device: str, n: int = 8, v: int = 64, h: int = 32):
    """(name, wrapper call, raw-op call): each a forward + backward of a fresh graph."""
    from rl_losses.integrations import verl

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, v, generator=g).to(device).requires_grad_()
    teacher = torch.randn(n, v, generator=g).to(device)
    hidden = torch.randn(n, h, generator=g).to(device).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(device).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)
    adv = torch.randn(n, generator=g).to(device)
    old = torch.full((n,), -4.0, device=device)
    lp = torch.full((n,), -3.9, device=device).requires_grad_()
    doc = (torch.arange(n) // 4).to(device)
    pairs = torch.tensor([[0, 1]], device=device)
    ref = torch.zeros(1, device=device)
    batch = {"labels": t, "advantages": adv, "old_log_probabilities": old, "document_index": doc, "num_documents": 2}
    module = {name: rl_losses.LanguageModelLossConfig.from_dict({"type": name}).get_loss()
              for name in ("label", "grpo", "gspo")}
    ppo = verl.FusedLinearForPPO(chunk_size=None)
    out = [
        ("cross_entropy", lambda: rl_losses.cross_entropy(x, t).backward(),
         lambda: ops.cross_entropy(x, t)[0].backward()),
        ("grpo_loss", lambda: rl_losses.grpo_loss(x, t, adv, old).loss.backward(),
         lambda: ops.grpo(x, t, adv, old)[0].backward()),
        ("gspo_loss", lambda: rl_losses.gspo_loss(x, t, adv, old, doc, num_documents=2).loss.backward(),
         lambda: ops.gspo(x, t, adv, old, doc, num_documents=2)[0].backward()),
        ("token_log_probs", lambda: rl_losses.token_log_probs(x, t)[0].sum().backward(),
         lambda: ops.token_log_probs(x, t)[0].sum().backward()),
        ("linear_cross_entropy", lambda: rl_losses.linear_cross_entropy(hidden, weight, t).backward(),
         lambda: ops.linear_cross_entropy(hidden, weight, t)[0].backward()),
        ("linear_grpo_loss", lambda: rl_losses.linear_grpo_loss(hidden, weight, t, adv, old).loss.backward(),
         lambda: ops.linear_grpo(hidden, weight, t, adv, old)[0].backward()),
        ("linear_gspo_loss",
         lambda: rl_losses.linear_gspo_loss(hidden, weight, t, adv, old, doc, num_documents=2).loss.backward(),
         lambda: ops.linear_gspo(hidden, weight, t, adv, old, doc, num_documents=2)[0].backward()),
        ("linear_token_log_probs", lambda: rl_losses.linear_token_log_probs(hidden, weight, t)[0].sum().backward(),
         lambda: ops.linear_token_log_probs(hidden, weight, t)[0].sum().backward()),
        ("distillation_loss", lambda: rl_losses.distillation_loss(x, teacher).loss.backward(),
         lambda: ops.distillation(x, teacher)[0].backward()),
        ("dpo_loss", lambda: rl_losses.dpo_loss(x, t, doc, pairs, ref, ref).loss.backward(),
         lambda: ops.dpo(x, t, doc, pairs, ref, ref)[0].backward()),
        ("fused_head_loss", lambda: rl_losses.fused_head_loss(x, t, label_weight=1.0).loss.backward(),
         lambda: ops.fused_head(x, t, label_weight=1.0)[0].backward()),
        ("policy_token_loss", lambda: rl_losses.policy_token_loss(lp, old, adv).loss.sum().backward(),
         lambda: ops.policy_token_loss(lp, old, adv)[0].sum().backward()),
    ]
    # The loss and its gradient without autograd (rl_losses.forward_backward) against the raw op's forward + backward:
    # "added" is then what the no-autograd form saves (negative).
    fb, raw = rl_losses.forward_backward, {name: r for name, _, r in out}
    ids = torch.arange(4, device=device).expand(n, 4).contiguous()  # as an engine returns them
    top = torch.log_softmax(torch.randn(n, 4, generator=g), -1).to(device)
    out += [
        ("fwd_bwd cross_entropy", lambda: fb(rl_losses.cross_entropy, x, t), raw["cross_entropy"]),
        ("fwd_bwd grpo_loss", lambda: fb(rl_losses.grpo_loss, x, t, adv, old), raw["grpo_loss"]),
        ("fwd_bwd gspo_loss", lambda: fb(rl_losses.gspo_loss, x, t, adv, old, doc, num_documents=2), raw["gspo_loss"]),
        # compute_metrics=False: the loss, new_logprobs and log_probs alone (4 outputs fewer to make).
        ("fwd_bwd grpo_loss no metrics", lambda: fb(rl_losses.grpo_loss, x, t, adv, old, compute_metrics=False),
         raw["grpo_loss"]),
        ("fwd_bwd gspo_loss no metrics",
         lambda: fb(rl_losses.gspo_loss, x, t, adv, old, doc, num_documents=2, compute_metrics=False),
         raw["gspo_loss"]),
        ("fwd_bwd distillation_loss", lambda: fb(rl_losses.distillation_loss, x, teacher), raw["distillation_loss"]),
        ("fwd_bwd dpo_loss", lambda: fb(rl_losses.dpo_loss, x, t, doc, pairs, ref, ref), raw["dpo_loss"]),
        ("fwd_bwd fused_head_loss", lambda: fb(rl_losses.fused_head_loss, x, t, label_weight=1.0),
         raw["fused_head_loss"]),
        ("fwd_bwd topk_distillation", lambda: fb(rl_losses.topk_distillation_loss, x, t, ids, top),
         lambda: ops.topk_distillation(x, t, ids, top)[0].backward()),
        ("fwd_bwd linear_cross_entropy", lambda: fb(rl_losses.linear_cross_entropy, hidden, weight, t),
         raw["linear_cross_entropy"]),
        ("fwd_bwd linear_grpo_loss", lambda: fb(rl_losses.linear_grpo_loss, hidden, weight, t, adv, old),
         raw["linear_grpo_loss"]),
    ]
    # The configs' loss modules (metrics "none") and verl's drop-in for its fused lm_head, against the op call they
    # make.
    for name, op in (("label", "cross_entropy"), ("grpo", "grpo"), ("gspo", "gspo")):
        call = (lambda m: lambda: m(x, batch)[0].backward())(module[name])
        raw = _recorded(call, op)
        out.append((f"config {name}", call, (lambda r: lambda: r()[0].backward())(raw)))
    call = lambda: sum(ppo(hidden, weight, t)).sum().backward()  # noqa: E731
    raw = _recorded(call, "linear_token_log_probs")
    out.append(("verl FusedLinearForPPO", call, lambda: sum(raw()).sum().backward()))
    return out


def paired_us(wrapper, raw, calls: int, device: str) -> tuple[float, float, float]:
    """Median µs of the wrapper's calls, of the raw op's, and of their difference, the two called alternately so
    that a busy machine's drift falls on both alike. The first call of a pair costs more than the second (the raw
    op against itself reads 0.5-2 µs on a CPU host), so the pairs alternate their order too, and the difference is
    the mean of its medians over the two orders."""
    w, r = [], []
    for i in range(calls):
        if device == "cuda" and i % 64 == 0:
            torch.cuda.synchronize()
        first, second = (wrapper, raw) if i % 2 == 0 else (raw, wrapper)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        w.append(t1 - t0 if i % 2 == 0 else t2 - t1)
        r.append(t2 - t1 if i % 2 == 0 else t1 - t0)
    added = [statistics.median(a - b for a, b in zip(w[k::2], r[k::2])) for k in (0, 1)]
    return statistics.median(w) * 1e6, statistics.median(r) * 1e6, sum(added) / 2 * 1e6


def launches(fn, calls: int = 20) -> str:
    """The CUDA runtime calls of one call of fn, counted by torch.profiler over `calls` calls: kernel launches,
    memsets and copies, and synchronisations (a copy to the host waits for the device)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    counts = {"launch": 0, "memset/copy": 0, "sync": 0}
    for e in prof.key_averages():
        if e.key.startswith("cudaLaunch"):
            counts["launch"] += e.count
        elif e.key.startswith(("cudaMemset", "cudaMemcpy")):
            counts["memset/copy"] += e.count
        elif e.key.startswith("cudaStreamSynchronize"):
            counts["sync"] += e.count
    return " ".join(f"{v / calls:g}" for v in counts.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the one with the lowest wrapper median is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    ap.add_argument("--only", default="", help="the rows whose name contains this text (default: every row)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    print(f"host time per call, forward + backward at 8 x 64 on {args.device} (µs, medians of {args.calls} alternate "
          f"calls, the round with the lowest wrapper time of {args.rounds})")
    print(f"{'op':<30} {'wrapper':>9} {'raw op':>9} {'added':>8}"
          + ("  wrapper's launches, memsets/copies, synchronisations per call" if cuda else ""))
    for name, wrapper, raw in cases(args.device):
        if args.only not in name:
            continue
        paired_us(wrapper, raw, args.calls // 10, args.device)  # warm-up
        best = min(paired_us(wrapper, raw, args.calls, args.device) for _ in range(args.rounds))
        print(f"{name:<30} {best[0]:9.1f} {best[1]:9.1f} {best[2]:8.1f}" + (f"  {launches(wrapper)}" if cuda else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
