"""Vocabulary-parallel losses on 2 GPUs over NCCL: correctness against one GPU, and the share of the
communication in the TP=2 fwd+bwd time at N = 16384, V = 128256, bf16 (the target: < 10%).

    python3 benchmarks/bench_tp.py --out OUT                  # 2 GPUs: spawns its 2 ranks (about a minute)
    python3 benchmarks/bench_tp.py --dry-run --out /tmp/x     # CPU + gloo, tiny shapes: checks the logic

Needs the extension built with its CUDA kernels. Phases, every rank in step:
  1. correctness at --check-shape (fp32): TP=2 (even and uneven shards) for cross-entropy (+ smoothing and
     z-loss), z-loss, GRPO (+ k3 and entropy), GSPO (both weightings), and SDP=2 GSPO with documents split
     across the ranks, each against the single-GPU op on the whole input (both ranks compute it): loss and
     metrics (relative error), this rank's gradient block (max error over the largest gradient entry);
  2. torch.compile(fullgraph=True, backend="aot_eager") and CUDA-graph capture of the TP=2 cross-entropy
     fwd+bwd, each compared with eager (reported, never fatal);
  3. timing at --shape (bf16) of the TP=2 fwd+bwd per op: median of --reps CUDA-event-timed steps after
     warm-up; inside them the two all-reduces of the row statistics, timed in situ with CUDA events around
     each collective (this includes waiting for the other rank); the same two all-reduces alone on the same
     buffers (pure communication); the statistics pass alone; and, on rank 0, the single-GPU op on the whole
     vocabulary; and the host's time to issue a step (a step whose host time reaches its device time is
     host-bound: its median is the host's). kernel ms = step ms - in-situ communication ms; the verdict
     compares both communication times with the kernel time.
Writes OUT/bench_tp.json and OUT/bench_tp.md (the tables), and prints the tables.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rl_losses
from rl_losses import distributed as rl_dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timer  # noqa: E402

COMM_LIMIT = 0.10  # communication / kernel time: the target
_ops = torch.ops.rl_losses


def _shape(text: str) -> tuple[int, int]:
    n, v = text.lower().split("x")
    return int(n), int(v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for bench_tp.json and bench_tp.md")
    p.add_argument("--world", type=int, default=2, help="TP size (GPUs)")
    p.add_argument("--shape", type=_shape, default=(16384, 128256), help="timing N x V")
    p.add_argument("--check-shape", type=_shape, default=(2048, 32000), help="correctness N x V")
    p.add_argument("--ops", default="ce,grpo,gspo", help="timed ops")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--doc-len", type=int, default=1024, help="GSPO document length in the timing")
    p.add_argument("--invariant", action="store_true",
                   help="time in the batch-invariant mode (its collectives are all-gathers, outside the probe)")
    p.add_argument("--dry-run", action="store_true", help="CPU + gloo, tiny shapes")
    p.add_argument("--timeout", type=int, default=170, help="seconds for the whole run")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shape, args.check_shape, args.reps, args.warmup, args.doc_len = (256, 1000), (96, 300), 3, 1, 40
    return args


# ------------------------------------------------------------------------------------------- timing helpers
class RankTimer(Timer):
    """timing.Timer's marks with the ranks started together. A step's collectives wait for the other ranks, so the
    host cannot be put ahead of the device by a sleep kernel as on one GPU: each rank marks its calls back to back,
    without a synchronisation between them."""

    def __call__(self, fn, reps: int, warmup: int, *, barrier: bool = True) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync()
        if barrier:  # start the ranks together
            dist.barrier()
        marks = []
        t0 = time.perf_counter()
        for _ in range(reps):
            start = self.event()
            fn()
            marks.append((start, self.event()))
        # The host's time to issue a call: where it reaches the call's device time, the steps are host-bound.
        self.host_ms = (time.perf_counter() - t0) * 1e3 / reps
        self.sync()
        return [self.elapsed(s, e) for s, e in marks]


class CommProbe:
    """Wraps torch.distributed.all_reduce (which rl_losses.distributed calls) with timing events, so that the
    communication inside a step is measured where it happens."""

    def __init__(self, timer: RankTimer):
        self.timer, self.marks, self.active = timer, [], False
        self._orig = dist.all_reduce

    def __enter__(self):
        probe = self

        def all_reduce(*a, **k):
            if not probe.active:
                return probe._orig(*a, **k)
            start = probe.timer.event()
            out = probe._orig(*a, **k)
            probe.marks[-1].append((start, probe.timer.event()))
            return out

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig

    def step(self, fn):
        def wrapped():
            self.marks.append([])
            self.active = True
            try:
                fn()
            finally:
                self.active = False
        return wrapped

    def per_step_ms(self, last: int) -> list[float]:
        self.timer.sync()
        return [sum(self.timer.elapsed(s, e) for s, e in marks) for marks in self.marks[-last:]]


# ------------------------------------------------------------------------------------------------ inputs
def make_full(n: int, v: int, dtype, device, seed: int, doc_len: int) -> dict:
    """Whole-vocabulary inputs, identical on every rank (seeded on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(n, v, generator=g)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target = torch.where(torch.rand(n, generator=g) < 0.25, -100, target)
    doc = torch.arange(n) // doc_len
    doc = torch.where(torch.arange(n) % doc_len >= doc_len - 3, -1, doc)  # 3 padding tokens per document
    lp = torch.log_softmax(logits.double(), -1).gather(1, target.clamp_min(0)[:, None]).squeeze(1)
    lp = torch.where(target >= 0, lp, 0.0)
    old = lp - 0.2 * torch.randn(n, generator=g, dtype=torch.float64)[doc.clamp_min(0)] \
        - 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = lp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g)
    t = dict(logits=logits, target=target, document_index=doc, old_log_probs=old.float(),
             ref_log_probs=ref.float(), advantages=adv)
    return {k: x.to(device) for k, x in t.items()}


CHECKS = {
    # name: (op, options, layout) — layout "tp" (even shards), "tp_uneven" (one extra column on rank 0's
    # shard, through vocab_start/vocab_size) or "sdp" (rows split at an awkward point, documents across it).
    "ce_smoothing_zloss": ("ce", dict(label_smoothing=0.1, z_loss_factor=1e-3), "tp"),
    "z_loss": ("z_loss", dict(logits_scale_factor=0.9), "tp"),
    "grpo_kl_entropy": ("grpo", dict(beta=0.05, compute_entropy=True, epsilon_high=0.28), "tp"),
    "gspo_document": ("gspo", dict(compute_entropy=True), "tp"),
    "gspo_token": ("gspo", dict(weighting="token"), "tp"),
    "ce_uneven": ("ce", dict(label_smoothing=0.1), "tp_uneven"),
    "gspo_sdp_document": ("gspo", dict(compute_entropy=True), "sdp"),
    "gspo_sdp_token": ("gspo", dict(weighting="token", token_advantages=True), "sdp"),
}


def call(op: str, inp: dict, x: torch.Tensor, options: dict, **group):
    """(loss, metrics) of one op on logits x; through the public wrappers, or rl_losses.distributed when the
    shard is explicit."""
    direct = "vocab_start" in group
    if op == "ce":
        fn = rl_dist.cross_entropy if direct else rl_losses.cross_entropy
        return fn(x, inp["target"], **options, **group), {}
    if op == "z_loss":
        if direct:
            return rl_dist.cross_entropy(x, torch.where(inp["target"] >= 0, 0, -1), z_loss_factor=1.0,
                                         label_weight=0.0, **options, **group), {}
        return rl_losses.z_loss(x, loss_mask=inp["target"] >= 0, **options, **group), {}
    args = (x, inp["target"], inp["advantages"], inp["old_log_probs"])
    if op == "grpo":
        fn = rl_dist.grpo_loss if direct else rl_losses.grpo_loss
        out = fn(*args, ref_log_probs=inp["ref_log_probs"], **options, **group)
    else:
        fn = rl_dist.gspo_loss if direct else rl_losses.gspo_loss
        n_docs = int(inp["num_documents"])
        out = fn(*args, inp["document_index"], num_documents=n_docs, **options, **group)
    return out.loss, {k: v for k, v in out._asdict().items() if k != "loss" and isinstance(v, torch.Tensor)}


def fwd_bwd(op, inp, logits, options, **group):
    x = logits.detach().clone().requires_grad_()
    loss, metrics = call(op, inp, x, options, **group)
    loss.backward()
    return loss.detach(), x.grad, metrics


def rel_err(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def check_case(name, rank, world, device, args) -> dict:
    op, options, layout = CHECKS[name]
    n, v = args.check_shape
    if layout == "tp_uneven":
        v += 1
    doc_len = max(n // 5, 4)
    full = make_full(n, v, torch.float32, device, seed=sum(map(ord, name)), doc_len=doc_len)
    full["num_documents"] = int(full["document_index"].max()) + 1
    loss1, grad1, metrics1 = fwd_bwd(op, full, full["logits"], options)

    group = {}
    rows, cols = slice(None), slice(None)
    if layout == "sdp":
        cuts = [0] + [(n * (r + 1)) // world + doc_len // 3 for r in range(world - 1)] + [n]
        rows = slice(cuts[rank], cuts[rank + 1])
        group["sdp_group"] = dist.group.WORLD
    else:
        widths = [v // world + (1 if r < v % world else 0) for r in range(world)]
        start = sum(widths[:rank])
        cols = slice(start, start + widths[rank])
        group["tp_group"] = dist.group.WORLD
        if layout == "tp_uneven":
            group.update(vocab_start=start, vocab_size=v)
    local = {k: (x[rows] if isinstance(x, torch.Tensor) else x) for k, x in full.items()}
    loss, grad, metrics = fwd_bwd(op, local, full["logits"][rows, cols].contiguous(), options, **group)
    if layout == "sdp":
        dist.all_reduce(loss)  # the rank losses sum to the loss
    errors = {"loss": rel_err(loss, loss1), "grad": rel_err(grad, grad1[rows, cols])}
    for k, m in metrics1.items():
        errors[k] = rel_err(metrics[k], m[rows] if k == "log_probs" else m)
    worst = max(errors.values())
    return {"case": name, "op": op, "layout": layout, "n": n, "v": v, "worst_rel_err": worst,
            "errors": errors, "ok": worst < 1e-4}


def check_compile_and_graph(device, cuda: bool) -> dict:
    n, v = 256, 4096
    inp = make_full(n, v, torch.float32, device, seed=5, doc_len=64)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = inp["logits"][:, rank * v // world:(rank + 1) * v // world].contiguous()
    opts = dict(label_smoothing=0.1)
    eager_loss, eager_grad, _ = fwd_bwd("ce", inp, shard, opts, tp_group=dist.group.WORLD)
    out = {}
    try:
        compiled = torch.compile(lambda x: rl_losses.cross_entropy(x, inp["target"], tp_group=dist.group.WORLD,
                                                                   **opts), fullgraph=True, backend="aot_eager")
        x = shard.clone().requires_grad_()
        loss = compiled(x)
        loss.backward()
        err = max(rel_err(loss.detach(), eager_loss), rel_err(x.grad, eager_grad))
        out["compile_fullgraph_aot_eager"] = f"ok (max rel err {err:.1e})" if err < 1e-5 else f"MISMATCH {err:.1e}"
    except Exception as e:  # noqa: BLE001  (reported, not fatal)
        out["compile_fullgraph_aot_eager"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if not cuda:
        out["cuda_graph_capture"] = "skipped (CPU)"
        return out
    try:
        x = shard.clone().requires_grad_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's documentation asks
            for _ in range(2):
                x.grad = None
                rl_losses.cross_entropy(x, inp["target"], tp_group=dist.group.WORLD, **opts).backward()
        torch.cuda.current_stream().wait_stream(side)
        x.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = rl_losses.cross_entropy(x, inp["target"], tp_group=dist.group.WORLD, **opts)
            loss.backward()
        x.data.copy_(shard)
        graph.replay()
        torch.cuda.synchronize()
        err = max(rel_err(loss.detach(), eager_loss), rel_err(x.grad, eager_grad))
        out["cuda_graph_capture"] = f"ok (max rel err {err:.1e})" if err < 1e-5 else f"MISMATCH {err:.1e}"
    except Exception as e:  # noqa: BLE001
        out["cuda_graph_capture"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


# --------------------------------------------------------------------------------------------- timing
def time_op(op, rank, world, device, timer, args) -> dict:
    n, v = args.shape
    dtype = torch.bfloat16
    v_loc = v // world
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    shard = (2.0 * torch.randn(n, v_loc, generator=g, device=device)).to(dtype)
    gt = torch.Generator(device=device).manual_seed(99)  # the same labels etc. on every rank
    target = torch.randint(0, v, (n,), generator=gt, device=device)
    target = torch.where(torch.rand(n, generator=gt, device=device) < 0.25, -100, target)
    doc = torch.arange(n, device=device) // args.doc_len
    inp = dict(target=target, document_index=doc, num_documents=(n + args.doc_len - 1) // args.doc_len,
               advantages=torch.randn(n, generator=gt, device=device))
    tp = dict(tp_group=dist.group.WORLD)
    if op in ("grpo", "gspo"):  # old log-probs near the current ones, from a no-grad TP forward
        with torch.no_grad():
            lp = rl_losses.grpo_loss(shard, target, inp["advantages"], torch.zeros(n, device=device), **tp).log_probs
        inp["old_log_probs"] = lp + 0.1 * torch.randn(n, generator=gt, device=device)
        inp["ref_log_probs"] = lp
    options = {}
    x = shard.detach().clone().requires_grad_()

    def step():
        x.grad = None
        call(op, inp, x, options, **tp)[0].backward()

    with CommProbe(timer) as probe:
        total = timer(probe.step(step), args.reps, args.warmup)
        host_ms = timer.host_ms
        comm_in_situ = probe.per_step_ms(args.reps)
    x.grad = None

    # The same two collectives alone, on buffers of the same sizes (pure communication).
    buf_max = torch.randn(n, device=device)
    buf_sum = torch.randn(n, 4, device=device)

    def comm():
        dist.all_reduce(buf_max, op=dist.ReduceOp.MAX)
        dist.all_reduce(buf_sum)

    comm_alone = timer(comm, args.reps, args.warmup)
    stats_alone = timer(lambda: _ops.row_stats(shard, target, vocab_start=rank * v_loc, vocab_size=v),
                        args.reps, args.warmup)
    row = {"op": op, "n": n, "v": v, "v_local": v_loc, "dtype": "bfloat16", "world": world,
           "step_ms": statistics.median(total), "host_ms": host_ms, "comm_in_situ_ms": statistics.median(comm_in_situ),
           "comm_alone_ms": statistics.median(comm_alone), "stats_pass_ms": statistics.median(stats_alone),
           "comm_bytes": n * 5 * 4}
    x = shard = None  # free this rank's shard and its gradient before the single-GPU run
    # Rank 0: the single-GPU op on the whole vocabulary, for comparison (rank 1 waits at the barrier).
    if rank == 0:
        full = (2.0 * torch.randn(n, v, generator=g, device=device)).to(dtype)
        y = full.detach().clone().requires_grad_()
        del full

        def single():
            y.grad = None
            call(op, inp, y, options)[0].backward()

        row["single_gpu_ms"] = statistics.median(timer(single, args.reps, args.warmup, barrier=False))
        del y
        if timer.cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    return row


def gather_max(row: dict, keys) -> dict:
    """Across ranks: the max of each timing key (the step is as slow as its slowest rank)."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    out = dict(rows[0])
    for k in keys:
        values = [r[k] for r in rows if k in r]
        if values:
            out[k] = max(values)
    return out


# ------------------------------------------------------------------------------------------------ report
def tables(result: dict) -> str:
    lines = [f"## TP={result['world']} losses over {result['backend']} — {result['device']}, "
             f"{result['date']}" + (" (batch-invariant mode)" if result.get("batch_invariant") else ""), "",
             f"Command: `{result['command']}`", "",
             "### Correctness against one device (fp32; worst relative error over loss, gradient block, "
             "metrics)", "", "| case | layout | N x V | worst rel err | ok |", "|---|---|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['case']} | {c['layout']} | {c['n']}x{c['v']} | {c['worst_rel_err']:.1e} | "
                     f"{'ok' if c['ok'] else 'FAIL'} |")
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result["capture"].items()]
    lines += ["", f"### Timing, fwd+bwd, bf16 (median of {result['reps']}; ms, slowest rank)", "",
              "| op | N x V | 1 GPU | TP step | host / step | stats pass | comm in situ | comm alone | kernel | "
              "comm / kernel (in situ, alone) | < 10% |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in result["timing"]:
        lines.append(f"| {t['op']} | {t['n']}x{t['v']} | {t.get('single_gpu_ms', float('nan')):.3f} | "
                     f"{t['step_ms']:.3f} | {t.get('host_ms', float('nan')):.3f} | {t['stats_pass_ms']:.3f} | "
                     f"{t['comm_in_situ_ms']:.3f} | "
                     f"{t['comm_alone_ms']:.3f} | {t['kernel_ms']:.3f} | {100 * t['comm_share_in_situ']:.1f}%, "
                     f"{100 * t['comm_share_alone']:.1f}% | {'yes' if t['pass'] else 'NO'} |")
    lines += ["", "kernel = TP step - in-situ communication; comm alone = the same two all-reduces (MAX of N, SUM "
              "of 4N fp32) by themselves; 1 GPU = the op on the whole vocabulary on rank 0; host / step = the "
              "host's time to issue one step (no synchronisation): near the TP step or above it, the steps were "
              "host-bound and the TP step is the host's time."]
    return "\n".join(lines) + "\n"


def write(result: dict, out: str, *, echo: bool) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_tp.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = tables(result)
    with open(os.path.join(out, "bench_tp.md"), "w") as f:
        f.write(text)
    if echo:
        print(text, flush=True)


def worker(rank: int, args, workdir: str) -> None:
    faulthandler.dump_traceback_later(args.timeout - 15, exit=False)  # where a stuck rank is, before the kill
    try:
        cuda = not args.dry_run
        if cuda:
            torch.cuda.set_device(rank)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            torch.set_num_threads(1)
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{workdir}/store", rank=rank,
                                world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
        timer = RankTimer("cuda" if cuda else "cpu")
        t0 = time.perf_counter()
        checks = [check_case(name, rank, args.world, device, args) for name in CHECKS]
        checks = [gather_max(c, ["worst_rel_err"]) for c in checks]
        for c in checks:
            c["ok"] = c["worst_rel_err"] < 1e-4
        t_checks = time.perf_counter() - t0
        timing = []
        keys = ["step_ms", "host_ms", "comm_in_situ_ms", "comm_alone_ms", "stats_pass_ms", "single_gpu_ms"]
        for op in args.ops.split(","):
            with rl_losses.batch_invariant(args.invariant):
                t = gather_max(time_op(op, rank, args.world, device, timer, args), keys)
            t["kernel_ms"] = t["step_ms"] - t["comm_in_situ_ms"]
            t["comm_share_in_situ"] = t["comm_in_situ_ms"] / t["kernel_ms"]
            t["comm_share_alone"] = t["comm_alone_ms"] / (t["step_ms"] - t["comm_alone_ms"])
            t["pass"] = max(t["comm_share_in_situ"], t["comm_share_alone"]) < COMM_LIMIT
            timing.append(t)
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python3 " + " ".join(sys.argv), "world": args.world,
            "backend": "NCCL" if cuda else "gloo (dry run)",
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "reps": args.reps, "checks": checks, "batch_invariant": args.invariant,
            "capture": {"compile_fullgraph_aot_eager": "not run yet", "cuda_graph_capture": "not run yet"},
            "timing": timing, "checks_s": round(t_checks, 1),
        }
        if rank == 0:
            write(result, args.out, echo=False)
        # Last, since a failed capture can leave the CUDA context unusable (what came before is written).
        result["capture"] = check_compile_and_graph(device, cuda)
        if rank == 0:
            write(result, args.out, echo=True)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(workdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()} (use --dry-run on the CPU)")
        return 2
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rl_losses_tp_") as workdir:
        procs = [ctx.Process(target=worker, args=(r, args, workdir)) for r in range(args.world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
        failed = False
        for r, p in enumerate(procs):
            err = os.path.join(workdir, f"rank{r}.err")
            if os.path.exists(err):
                print(f"rank {r} failed:\n{open(err).read()}", file=sys.stderr)
                failed = True
            elif p.exitcode != 0:
                print(f"rank {r}: exit code {p.exitcode} (timed out after {args.timeout} s?)", file=sys.stderr)
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
