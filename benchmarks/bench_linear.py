"""GPU benchmark of the fused lm_head losses: rl_losses.linear_{cross_entropy,grpo_loss,gspo_loss}.

    python3 benchmarks/bench_linear.py --out OUT [--quick] [--time-budget S]
    python3 benchmarks/bench_linear.py --cce --out OUT    # CE against Cut Cross-Entropy, N=16384, H x V grid
    python3 benchmarks/bench_linear.py --dry-run --out /tmp/x      # CPU, tiny shapes: checks the logic

N=16384, H=4096, V=128256, bf16 hidden and weight requiring grad, fwd+bwd (loss.backward()). Per op (ce, grpo,
gspo with 8 documents of 2048 tokens) and provider: median ms of >= 20 CUDA-event-timed calls, the ratio to the
GEMM floor (the 3 GEMMs, 4 for GSPO, that no fused op avoids, as plain bf16 matmuls), extra peak memory (and
beyond the gradients), speed-ups, and loss / |grad_weight| agreement with rl_losses_unfused; rl_losses_fp32 is
the fused op with fp32 logits (head_dtype="float32") beside the default's bf16 ones, rl_losses_lean the
strategy "lean" beside the default "fast". Jobs run in
priority order; OUT/bench_linear.{json,csv} are rewritten after each job (a cut-short run keeps its numbers).
--cce (or --shapes NxHxV,...): the CE case at each shape of CCE_SHAPES against Cut Cross-Entropy
(`cut_cross_entropy.linear_cross_entropy`, its default gradient filtering and exact), time and extra memory.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# bench_gpu sets TRITON_INTERPRET=1 on --dry-run before triton loads (Liger's kernels then run on the CPU).
import bench_gpu  # noqa: E402
import cases  # noqa: E402
import run_output  # noqa: E402
import torch  # noqa: E402
from bench_gpu import peak_extra_bytes  # noqa: E402
from timing import Timer  # noqa: E402

HEADLINE = {"n": 16384, "h": 4096, "v": 128256, "seq": 2048, "chunks": (1024, 2048, 4096)}
DRY = {"n": 256, "h": 64, "v": 1000, "seq": 64, "chunks": (32, 64, 128)}  # chunks < N: chunking is exercised
CCE_SHAPES = [(16384, h, v) for h in (2048, 4096) for v in (128256, 151936)]
OPS = {"ce": cases.OPS["ce"], "grpo": cases.OPS["grpo"], "gspo": cases.OPS["gspo_2048"]}
EPS = cases.EPS_LOW  # = EPS_HIGH = 0.2
TOL_LOSS, TOL_GRAD = 1e-3, 1e-2  # relative; the gradients are bf16, the loss fp32 from the same bf16 logits
NOTES = {
    "gemm_floor": "torch.mm bf16 with out=: hidden@W.T, G@W, G.T@hidden (GSPO: the first twice); no loss",
    "rl_losses": "fused, mode 'fast': chunks of rows from a 2.5 GiB logits budget, fp32 grad_weight accumulator "
                 "(V x H x 4 bytes) across chunks",
    "rl_losses_lean": "fused, mode 'lean': <= 256 MiB beyond the gradients, 4 GEMMs (vocabulary blocks write "
                      "grad_weight once)",
    "rl_losses_fp32": "fused, mode 'fast', head_dtype='float32': fp32 logits (chunks of half the rows), the "
                      "gradient rounded to bf16 once for GEMM 2 and GEMM 3",
    "rl_losses_unfused": "logits = hidden @ W.T (bf16, N x V) + rl_losses logits op; autograd matmul backward",
    "torch_eager": "CE: F.cross_entropy(logits.float()); GRPO/GSPO: rl_losses.reference on bf16 logits",
    "liger": "see definition notes (Liger's defaults: bf16 grad_weight accumulation for CE)",
    "liger_fp32acc": "Liger CE with accum_dtype=float32 (fp32 grad_weight accumulator, like ours)",
    "cce": "cut_cross_entropy.linear_cross_entropy, defaults (filter_eps='high': gradient entries below bf16 "
           "resolution skipped)",
    "cce_exact": "cut_cross_entropy.linear_cross_entropy(filter_eps=None): no gradient filtering",
}
DEFINITION_NOTES = [
    "Same seeded inputs for every provider of an op: hidden ~ N(0,1), weight ~ N(0, 4/H) (logits std ~2), every "
    "token labelled, eps_low = eps_high = 0.2, beta = 0, logits_scale_factor = 1 (Liger temperature 1); "
    "advantages drawn per sequence/document. Loss: token mean (CE, GRPO); GSPO weighting='document', divisor = "
    "#documents, num_documents given (no host sync).",
    "liger CE: liger_kernel.transformers.functional.liger_fused_linear_cross_entropy (= LigerFusedLinearCross"
    "EntropyLoss): same loss; chunks of next_pow2(N / ceil(V/H)) rows (512 at the headline); gradients computed "
    "in the forward; grad_weight accumulated in bf16 (accum_dtype=None) or fp32 (liger_fp32acc); one .item() "
    "host sync per call.",
    "liger GRPO: liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss(beta=0, use_ref_model=False, loss_type='bnpo',"
    " importance_sampling_level='token') on hidden (B, T, H) = (N/2048, 2048, H), mask of ones, advantages (B,), "
    "old_per_token_logps (B, T); 'bnpo' = sum(mask*loss)/sum(mask) = our token mean. Its loss math runs under "
    "torch.compile (first call, untimed); bf16 logits tiles of 2048 x 4096 upcast to fp32, computed twice "
    "(LSE pass, gradient pass); gradient GEMMs in fp32 (torch's default: no TF32); grad_weight summed over the "
    "B sequences in bf16.",
    "liger GSPO: the same with importance_sampling_level='sequence', loss_type='grpo' (mean over sequences of "
    "the token mean) = our gspo_loss(weighting='document', divisor=#documents); its documents are the B rows of "
    "(B, T, H), ours are packed (document_index).",
    "Extra peak memory: max_memory_allocated during one fwd+bwd minus what was allocated before it (the inputs, "
    "no .grad); it includes the .grad the autograd engine allocates (bf16 grad_hidden + grad_weight = (N + V) * "
    "H * 2 bytes), which 'beyond grads' subtracts.",
]
FIELDS = ["op", "provider", "chunk", "chunk_rows", "n", "h", "v", "ms", "ms_p20", "ms_p80", "reps", "x_floor",
          "extra_mib", "beyond_grads_mib", "speedup_vs_unfused", "speedup_vs_eager", "speedup_vs_liger",
          "speedup_vs_cce", "speedup_vs_cce_exact", "loss",
          "gw_norm", "d_loss", "d_gw", "check", "first_call_s", "note", "error", "skipped"]


def default_chunk(n: int, v: int, itemsize: int) -> int:
    """The op's default rows per chunk (fast mode; profile_linear.fast_chunk_rows mirrors the C++ rule). Printed
    so that the chunk-size rows can be read against the default."""
    from profile_linear import fast_chunk_rows

    return fast_chunk_rows(n, v, itemsize)


# ------------------------------------------------------------------------------------------------ inputs

def make_inputs(op, shape: dict, device) -> dict:
    """Fresh inputs of one op, the same for every provider (seed from the op's name). GRPO/GSPO's old
    log-probs are the current ones plus per-token and per-document drift, so that some tokens/documents clip."""
    n, h, v, seq = shape["n"], shape["h"], shape["v"], shape["seq"]
    g = torch.Generator(device=device).manual_seed(zlib.crc32(op.name.encode()))
    hidden = torch.randn(n, h, device=device, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, h, device=device, generator=g) * (2 / h**0.5)).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device=device, generator=g)
    b = n // seq
    s = {"target": target, "num_seqs": b, "seq_len": seq, "ref_log_probs": None}
    if op.kind != "ce":
        rows = max(1, (256 << 20) // (v * 4))  # label log-probs a block of rows at a time: no N x V temporary
        lp = torch.cat([cases.label_logprobs(hidden[i:i + rows] @ weight.T, target[i:i + rows])
                        for i in range(0, n, rows)])
        noise = lambda *size: torch.randn(*size, device=device, generator=g)  # noqa: E731
        s["advantages_seq"] = noise(b)
        s["advantages"] = s["advantages_seq"].repeat_interleave(seq)
        s["old_log_probs"] = lp + 0.1 * noise(n) + 0.1 * noise(b).repeat_interleave(seq)
        s["document_index"] = torch.arange(n, device=device) // seq
    s["hidden"], s["weight"] = hidden.requires_grad_(True), weight.requires_grad_(True)
    return s


# ------------------------------------------------------------------------------------------------ providers
# Each: loss(op, s, chunk) -> scalar loss tensor differentiable w.r.t. s["hidden"] and s["weight"].

def fused_loss(op, s, chunk, head_dtype="weight", strategy="fast"):
    import rl_losses as rl

    h, w, t = s["hidden"], s["weight"], s["target"]
    head = dict(chunk_size=chunk, head_dtype=head_dtype, strategy=strategy)
    if op.kind == "ce":
        return rl.linear_cross_entropy(h, w, t, **head)
    if op.kind == "grpo":
        return rl.linear_grpo_loss(h, w, t, s["advantages"], s["old_log_probs"], epsilon_low=EPS, epsilon_high=EPS,
                                   **head).loss
    return rl.linear_gspo_loss(h, w, t, s["advantages"], s["old_log_probs"], s["document_index"],
                               num_documents=s["num_seqs"], divisor=float(s["num_seqs"]), epsilon_low=EPS,
                               epsilon_high=EPS, **head).loss


def unfused_loss(op, s, chunk):
    # The logits op with the same options as bench_gpu's rl_losses provider (cases.RlLosses).
    if "rl" not in s:
        s["rl"] = cases.RlLosses(False)
    return s["rl"].loss(op, s, s["hidden"] @ s["weight"].T)


def eager_loss(op, s, chunk):
    # cases.TorchEager: F.cross_entropy on fp32-upcast logits (CE), rl_losses.reference (GRPO/GSPO).
    if "te" not in s:
        s["te"] = cases.TorchEager(False)
        s["fn"] = s["te"].make_fn(op, s)
    return s["te"].loss(op, s, s["hidden"] @ s["weight"].T)


def liger_loss(op, s, chunk, fp32_acc=False):
    if op.kind == "ce":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(s["hidden"], s["weight"], s["target"],
                                                accum_dtype=torch.float32 if fp32_acc else None)
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    level, loss_type = ("token", "bnpo") if op.kind == "grpo" else ("sequence", "grpo")
    b, t = s["num_seqs"], s["seq_len"]  # Liger takes (B, T, H) hidden states and per-sequence advantages
    if "liger" not in s:  # a module made once per job: its torch.compile happens on the first (untimed) call
        s["liger"] = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=EPS, epsilon_high=EPS,
                                              loss_type=loss_type, importance_sampling_level=level)
        s["mask"] = torch.ones(b, t, device=s["target"].device)
    return s["liger"](s["hidden"].view(b, t, -1), s["weight"], s["target"].view(b, t), s["mask"],
                      s["advantages_seq"], old_per_token_logps=s["old_log_probs"].view(b, t))[0]  # (loss, metrics)


def cce_loss(op, s, chunk, filter_eps="high"):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(s["hidden"], s["weight"], s["target"], filter_eps=filter_eps)


PROVIDERS = {"rl_losses": fused_loss, "rl_losses_fp32": lambda op, s, c: fused_loss(op, s, c, head_dtype="float32"),
             "rl_losses_lean": lambda op, s, c: fused_loss(op, s, c, strategy="lean"),
             "rl_losses_unfused": unfused_loss, "torch_eager": eager_loss,
             "liger": liger_loss, "liger_fp32acc": lambda op, s, c: liger_loss(op, s, c, fp32_acc=True),
             "cce": cce_loss, "cce_exact": lambda op, s, c: cce_loss(op, s, c, filter_eps=None)}
CE_ONLY = ("liger_fp32acc", "cce", "cce_exact")


def floor_step(op, s):
    """The GEMM floor: one sequence of the op's unavoidable GEMMs into preallocated outputs (no allocation)."""
    h, w = s["hidden"].detach(), s["weight"].detach()
    grad = torch.randn(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)  # stands for dL/dlogits
    logits, gh, gw = h.new_empty(h.shape[0], w.shape[0]), torch.empty_like(h), torch.empty_like(w)
    passes = 2 if op.kind == "gspo" else 1  # GSPO computes the logits twice

    def step():
        for _ in range(passes):
            torch.mm(h, w.T, out=logits)
        torch.mm(grad, w, out=gh)
        torch.mm(grad.T, h, out=gw)
    return step


# ------------------------------------------------------------------------------------------------ one job

def run_job(op_name, provider, chunk, shape, args, device, timer) -> dict:
    op = OPS[op_name]
    row = {"op": op_name, "provider": provider, "chunk": chunk, "n": shape["n"], "h": shape["h"], "v": shape["v"],
           "note": NOTES.get(provider)}
    s = loss = None
    try:
        s = make_inputs(op, shape, device)
        if provider == "gemm_floor":
            step = floor_step(op, s)
        else:
            fn = PROVIDERS[provider]

            def step():
                s["hidden"].grad = s["weight"].grad = None  # no accumulation pass into an existing .grad
                fn(op, s, chunk).backward()

            t0 = time.perf_counter()  # first call: the agreement values (and Liger's torch.compile, untimed)
            loss = fn(op, s, chunk)
            loss.backward()
            timer.sync()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
            row["loss"], row["gw_norm"] = float(loss.detach()), float(s["weight"].grad.float().norm())
            loss = None
        for _ in range(args.warmup):
            step()
        if provider != "gemm_floor":
            s["hidden"].grad = s["weight"].grad = None  # the base of the measure holds no gradient
            extra = peak_extra_bytes(step, device)
            if extra is not None:
                grads = (shape["n"] + shape["v"]) * shape["h"] * 2
                row["extra_mib"] = round(extra / 2**20, 1)
                row["beyond_grads_mib"] = round((extra - grads) / 2**20, 1)
        timer.sync()
        times = timer(step, args.reps)
        q = statistics.quantiles(times, n=5) if len(times) >= 2 else times * 4
        row.update(ms=round(statistics.median(times), 4), ms_p20=round(q[0], 4), ms_p80=round(q[3], 4),
                   reps=len(times))
    except torch.cuda.OutOfMemoryError:
        row["error"] = "OOM"
    except Exception as e:  # noqa: BLE001  (one provider failing must not stop the run)
        msg = str(e).strip().splitlines()
        row["error"] = f"{type(e).__name__}: {msg[0][:200] if msg else ''}"
    finally:
        s = step = loss = None  # noqa: F841  (free the inputs and any graph before emptying the cache)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def derive(rows: list[dict]) -> None:
    """Ratios against the other rows of the same op (recomputed after each job: any order of jobs works)."""
    shape = lambda r: (r.get("n"), r.get("h"), r.get("v"))  # noqa: E731
    by = {(r["op"], r["provider"], shape(r)): r for r in rows if r.get("chunk") is None}
    for r in rows:
        get = lambda p: by.get((r["op"], p, shape(r)), {})  # noqa: E731
        # The agreement reference: the unfused op where it ran (the --cce runs leave it out), else the fused one.
        floor, ref = get("gemm_floor").get("ms"), get("rl_losses_unfused") or get("rl_losses")
        if r.get("ms") and floor and r["provider"] != "gemm_floor":
            r["x_floor"] = round(r["ms"] / floor, 3)
        if r.get("ms") and r["provider"] == "rl_losses":
            for peer, key in (("rl_losses_unfused", "unfused"), ("torch_eager", "eager"), ("liger", "liger"),
                              ("cce", "cce"), ("cce_exact", "cce_exact")):
                if get(peer).get("ms"):
                    r[f"speedup_vs_{key}"] = round(get(peer)["ms"] / r["ms"], 3)
        if r.get("loss") is not None and ref.get("loss") is not None:
            if r is ref:
                r["check"] = "ref"
                continue
            r["d_loss"] = abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
            r["d_gw"] = abs(r["gw_norm"] - ref["gw_norm"]) / max(ref["gw_norm"], 1e-30)
            ok = r["d_loss"] <= TOL_LOSS and r["d_gw"] <= TOL_GRAD  # NaN fails both
            r["check"] = "ok" if ok else "MISMATCH"


def format_rows(rows: list[dict]) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    head = ["op", "H x V", "provider", "chunk", "ms", "x floor", "extra MiB", "beyond grads", "vs unfused", "vs eager",
            "vs liger", "vs cce", "d_loss", "d_|gw|", "check / status"]
    body = []
    for r in rows:
        chunk = "-" if "chunk_rows" not in r else f"{r['chunk_rows']}" + (" (default)" if r["chunk"] is None else "")
        status = r.get("error") or r.get("skipped") or r.get("check") or "-"
        body.append([r["op"], f"{r.get('h')}x{r.get('v')}", r["provider"], chunk, f(r.get("ms"), ".2f"),
                     f(r.get("x_floor"), ".3f"), f(r.get("extra_mib"), ".0f"), f(r.get("beyond_grads_mib"), ".0f")]
                    + [f(r.get(f"speedup_vs_{k}"), ".2f") for k in ("unfused", "eager", "liger", "cce")]
                    + [f(r.get("d_loss"), ".1e"), f(r.get("d_gw"), ".1e"), str(status)[:100]])
    return run_output.text_table(head, body)


# ------------------------------------------------------------------------------------------------ plan, main

def plan(args, shape) -> list[tuple[str, str, int | None]]:
    """(op, provider, chunk) in priority order: what a short session must get comes first."""
    ops = [o for o in OPS if not args.ops or o in args.ops.split(",")]
    chunks = shape["chunks"][1:2] if args.quick else shape["chunks"]  # --quick: 2048 (and the default)
    order = [("rl_losses", None), ("gemm_floor", None), ("rl_losses_lean", None), ("rl_losses_fp32", None),
             ("liger", None), ("rl_losses_unfused", None),
             ("rl_losses", shape["chunks"][1]), ("torch_eager", None), ("liger_fp32acc", None)]
    order += [("rl_losses", c) for c in chunks if ("rl_losses", c) not in order]
    if args.cce:
        order = [("rl_losses", None), ("gemm_floor", None), ("cce", None), ("cce_exact", None), ("liger", None)]
    jobs = [(o, p, c) for p, c in order for o in ops if not (p in CE_ONLY and o != "ce")]
    return [j for j in jobs if not args.providers or j[1] in args.providers.split(",")]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/out/linear", help="folder for bench_linear.{json,csv,md}")
    ap.add_argument("--quick", action="store_true", help="chunk sizes: the default and 2048 only")
    ap.add_argument("--time-budget", type=float, help="seconds; no job starts that would end past it")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per job (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls after the first (checked) call")
    ap.add_argument("--ops", help=f"comma list of {','.join(OPS)}")
    ap.add_argument("--providers", help=f"comma list of gemm_floor,{','.join(PROVIDERS)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (N=256, H=64, V=1000, docs of 64)")
    ap.add_argument("--shapes", help="comma list of NxHxV (default: the headline 16384x4096x128256)")
    ap.add_argument("--cce", action="store_true", help="CE only, rl_losses against Cut Cross-Entropy (and "
                    "Liger) at CCE_SHAPES (or --shapes)")
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.reps, args.warmup = min(args.reps, 3), min(args.warmup, 1)
    if args.cce:
        args.ops = "ce"
    return args


def shapes_of(args) -> list[dict]:
    """The shapes to run: --shapes, the CCE grid for --cce, else the headline (DRY on --dry-run)."""
    base = DRY if args.dry_run else HEADLINE
    if args.shapes:
        dims = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
    elif args.cce and not args.dry_run:
        dims = CCE_SHAPES
    else:
        return [base]
    return [dict(base, n=n, h=h, v=v) for n, h, v in dims]


def collect_meta(args, shape, device) -> dict:
    n, h, v = shape["n"], shape["h"], shape["v"]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
            "liger_kernel": cases.liger_version(), "shape": {"n": n, "h": h, "v": v, "doc_tokens": shape["seq"]},
            "dtype": "bfloat16", "default_chunk": default_chunk(n, v, 2), "reps": args.reps, "warmup": args.warmup,
            "grad_bytes": (n + v) * h * 2, "definition_notes": DEFINITION_NOTES, "unavailable": {}}
    for name, mod in (("rl_losses", "rl_losses"), ("liger", "liger_kernel.chunked_loss"),
                      ("cce", "cut_cross_entropy")):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001  (a broken build or a missing wheel: measure the others)
            why = str(e).strip().splitlines()
            meta["unavailable"][name] = f"unavailable: {type(e).__name__}: {why[0][:150] if why else ''}"
    return meta


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    shapes = shapes_of(args)
    shape = shapes[0]
    jobs = [(sh, *job) for sh in shapes for job in plan(args, sh)]
    if args.list:
        print("\n".join(f"{sh['n']}x{sh['h']}x{sh['v']} " + " ".join(map(str, j)) for sh, *j in jobs))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_linear: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    timer = Timer(device)
    os.makedirs(args.out, exist_ok=True)
    paths = {k: os.path.join(args.out, f"bench_linear.{k}") for k in ("json", "csv", "md")}
    n, h, v = shape["n"], shape["h"], shape["v"]
    meta = collect_meta(args, shape, device)
    if len(shapes) > 1:
        meta["shapes"] = [{k: sh[k] for k in ("n", "h", "v")} for sh in shapes]
    unavailable = meta["unavailable"]
    print(f"bench_linear: {meta['device']} · torch {meta['torch']} · liger-kernel {meta['liger_kernel']} · "
          f"{meta['date']}\nN={n} H={h} V={v}" + (f" (and {len(shapes) - 1} more shapes)" if len(shapes) > 1 else "")
          + f" bf16, default chunk {meta['default_chunk']} rows; {len(jobs)} jobs"
          + (f", time budget {args.time_budget:.0f} s" if args.time_budget else "")
          + "".join(f"\n  {name}: {why}" for name, why in unavailable.items()), flush=True)

    rows = []
    for sh, op_name, provider, chunk in jobs:
        need = 60 if provider == "liger" and op_name != "ce" else 10  # rough seconds (Liger compiles its loss)
        dep = next((d for d in unavailable if provider.startswith(d)), None)  # rl_losses_unfused needs rl_losses
        base = {"op": op_name, "provider": provider, "chunk": chunk, "n": sh["n"], "h": sh["h"], "v": sh["v"]}
        if dep:
            row = dict(base, skipped=unavailable[dep])
        elif args.time_budget and time.time() - t_start + need > args.time_budget:
            row = dict(base, skipped="time budget")
        else:
            row = run_job(op_name, provider, chunk, sh, args, device, timer)
        if provider.startswith("rl_losses") and provider != "rl_losses_unfused":
            row["chunk_rows"] = chunk or default_chunk(sh["n"], sh["v"], 4 if provider == "rl_losses_fp32" else 2)
        rows.append(row)
        derive(rows)
        run_output.write_json(paths["json"], meta, rows)
        run_output.write_csv(paths["csv"], rows, FIELDS)
        done = {k: row[k] for k in ("ms", "x_floor", "extra_mib", "beyond_grads_mib", "check") if row.get(k)}
        print(f"[{time.time() - t_start:6.1f}s] {op_name} H={sh['h']} V={sh['v']} {provider} "
              f"{row.get('chunk_rows', '')}: "
              f"{row.get('error') or row.get('skipped') or done}", flush=True)
        if row.get("error") and device.type == "cuda" and not bench_gpu.cuda_alive():
            print("CUDA context lost: stopping (rerun the rest with --providers/--ops)", flush=True)
            break

    meta["total_s"] = round(time.time() - t_start, 1)
    run_output.write_json(paths["json"], meta, rows)
    provs = ["gemm_floor", *PROVIDERS]
    table = format_rows(sorted(rows, key=lambda r: (list(OPS).index(r["op"]), r.get("h") or 0, r.get("v") or 0,
                                                     provs.index(r["provider"]), r.get("chunk") or 0)))
    notes = "\n".join(f"- {x}" for x in DEFINITION_NOTES)
    header = (f"{meta['device']} · {meta['date']} · torch {meta['torch']} · liger-kernel {meta['liger_kernel']}\n"
              f"command: {meta['command']}\nN={n} H={h} V={v} bf16 fwd+bwd; inputs and their bf16 gradients "
              f"{meta['grad_bytes'] / 2**30:.2f} GiB each; ms = median of {args.reps}; x floor = ms / "
              f"GEMM floor (target <= 1.15); beyond grads = extra MiB - gradients (target <= 2048); vs X = X ms / "
              f"rl_losses ms; d_* = relative difference to rl_losses_unfused (loss, |grad_weight|)\n")
    with open(paths["md"], "w") as f:
        f.write(f"# bench_linear results\n\n{header}\n```\n{table}\n```\n\n## Definitions\n\n{notes}\n")
    print(f"\nDefinitions:\n{notes}\n\nwrote {args.out}/bench_linear.json, .csv, .md; {meta['total_s']} s\n\n"
          f"{header}\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
