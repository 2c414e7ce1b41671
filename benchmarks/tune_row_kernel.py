"""The fused CUDA row kernels side by side on one GPU: the cluster kernel (statistics and gradient in one
launch, each row read once from DRAM) against RL_LOSSES_ROW_KERNEL=cluster_pow2 (a power of two of CTAs
per row), =cluster_whole (each slice waited for whole), =cluster2 (two slice buffers per CTA) and =split (a
statistics launch, then the gradient launch re-reading the row), with a device-to-device copy of the same
bytes as the ceiling.

Each kernel runs in its own process (the knob is read once per process). Per vocabulary size: cross-entropy
fwd+bwd at N x V bf16, CUDA-event timing, median of --reps after warm-up; GB/s over the minimal bytes
2·N·V·2 (read the logits once, write the gradient once); % of the copy ceiling measured on the same bytes in
the same process. Before timing, a correctness check against torch (fp32 log_softmax): the loss, and every
element of the gradient, out of place (into a buffer prefilled with NaN) and in place; plus small cases that
reach the other paths (a row end inside a 16-byte vector, clusters of 4 and 16, fp32/fp16, rows not 16-byte
aligned or too long, which take the split path). Exit status 1 if a check fails.

    python3 benchmarks/tune_row_kernel.py                      # N=16384, V in {32000, 128256, 151936, 262144}
    python3 benchmarks/tune_row_kernel.py --vocabs 128256 --reps 50 --kernels cluster,split
"""
import argparse
import json
import os
import subprocess
import sys

# Values of RL_LOSSES_ROW_KERNEL: the default cluster kernel (the fewest CTAs per row, 1 stage, a slice's
# statistics started piece by piece as it lands), the same with slices of up to 96 KB, with a power of two
# of CTAs, waiting for the whole slice, with 2 stages where they fit, and the statistics kernel + gradient
# kernel path.
KERNELS = ("cluster", "cluster96", "cluster_pow2", "cluster_whole", "cluster2", "split")
# mirror kClusterCtaBytes / kClusterCta96Bytes / kMaxClusterSize (row_pass_cuda.cuh)
CTA_BYTES, CTA96_BYTES, MAX_CLUSTER = 64 * 1024, 96 * 1024, 16


def cluster_shape(v, elem_bytes, max_stages=1, pow2=False, cta_bytes=CTA_BYTES):
    """(CTAs per row, stages) the CUDA launcher tries first for contiguous rows (for the table only)."""
    for stages in range(max_stages, 0, -1):
        c = 1
        while c <= MAX_CLUSTER:
            per_cta = -(-v // c)
            if -(-per_cta * elem_bytes // 16) * 16 * stages <= cta_bytes:
                return c, stages
            c = 2 * c if pow2 else c + 1
    return 0, 0


def child(args):
    import torch
    import torch.nn.functional as F

    import rl_losses
    from cases import GradSink, head_output

    dev = "cuda"

    def median_ms(fn):
        for _ in range(3):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.reps)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        return sorted(a.elapsed_time(b) for a, b in ev)[args.reps // 2]

    def ce_step(base, target, inplace=False):
        loss = rl_losses.cross_entropy(head_output(base), target, inplace_backward=inplace)
        loss.backward()
        return loss

    def check(logits, target, grad, loss, chunk=1024):
        """Relative errors of the loss and of the whole gradient against fp32 torch (reduction "mean")."""
        n = logits.shape[0]
        err2 = ref2 = 0.0
        loss_ref = 0.0
        finite = True
        for r0 in range(0, n, chunk):
            x = logits[r0:r0 + chunk].float()
            y = target[r0:r0 + chunk]
            logp = F.log_softmax(x, dim=-1)
            loss_ref += -logp.gather(1, y[:, None]).sum().item()
            ref = logp.exp_()
            ref[torch.arange(len(y), device=dev), y] -= 1
            ref /= n
            g = grad[r0:r0 + chunk].float()
            finite &= bool(torch.isfinite(g).all())
            err2 += (g - ref).pow(2).sum().item()
            ref2 += ref.pow(2).sum().item()
        loss_ref /= n
        grad_err = (err2 / ref2) ** 0.5 if finite else float("inf")
        return abs(loss.item() - loss_ref) / abs(loss_ref), grad_err

    def run_checks(logits, target):
        """(loss error, gradient error) out of place and in place, on these logits (not modified)."""
        base = logits.detach().requires_grad_(True)
        torch.full_like(logits, float("nan"))  # freed at once: the gradient below likely reuses this block
        loss = ce_step(base, target)
        out = check(logits, target, GradSink.last, loss)
        GradSink.last = None
        # The gradient overwrites a copy with the same strides: every element starts as a logit, not a gradient.
        work = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=dev).copy_(logits)
        base = work.requires_grad_(True)
        loss = ce_step(base, target, inplace=True)
        assert GradSink.last.data_ptr() == work.data_ptr(), "in-place gradient is not in the logits' storage"
        inp = check(logits, target, GradSink.last, loss)
        GradSink.last = None
        return out, inp

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
    out = {"rows": [], "checks": []}

    # Small cases for the other paths: (N, V, row stride, dtype). A row end inside a 16-byte vector reaches
    # the cluster kernel only in place (a new gradient is contiguous, so its rows are then unaligned).
    # (C x S: CTAs per row x stages; in the cluster2 run, 2 stages where they fit.)
    for n, v, stride, dtype in [(300, 50257, 50264, torch.bfloat16),    # 2x1 (4x2), row end inside a vector
                                (200, 100003, 100004, torch.float32),  # 8x1 (16x2), fp32, row end in a vector
                                (257, 3, 8, torch.bfloat16),           # no whole vector in the row
                                (64, 7, 8, torch.float32),
                                (128, 4096, 4096, torch.float16),
                                (96, 769, 769, torch.float32),         # rows not 16-byte aligned: split path
                                (50, 262144, 262144, torch.float32),   # 16x1 in both runs
                                (40, 300000, 300000, torch.float32)]:  # too long for 16 slices: split path
        logits = torch.randn(n, stride, device=dev, dtype=dtype, generator=gen)[:, :v].mul_(2)
        target = torch.randint(0, v, (n,), device=dev, generator=gen)
        (lo, go), (li, gi) = run_checks(logits, target)
        ok = max(lo, li) < 1e-3 and max(go, gi) < tol[dtype]
        out["checks"].append({"N": n, "V": v, "stride": stride, "dtype": str(dtype).split(".")[-1],
                              "loss_err": max(lo, li), "grad_err": go, "grad_err_inplace": gi, "ok": ok})

    def measure(v, n=args.n):
        logits = torch.randn(n, v, device=dev, dtype=torch.bfloat16, generator=gen).mul_(2)
        target = torch.randint(0, v, (n,), device=dev, generator=gen)
        (lo, go), (li, gi) = run_checks(logits, target)
        row = {"N": n, "V": v, "loss_err": max(lo, li), "grad_err": go, "grad_err_inplace": gi,
               "ok": max(lo, li) < 1e-3 and max(go, gi) < tol[torch.bfloat16]}
        dst = torch.empty_like(logits)
        row["copy_ms"] = median_ms(lambda: dst.copy_(logits))
        dst = None
        base = logits.requires_grad_(True)
        row["ms"] = median_ms(lambda: ce_step(base, target))
        GradSink.last = None
        nbytes = 2 * logits.numel() * logits.element_size()
        row["GBps"] = nbytes / (row["ms"] * 1e-3) / 1e9
        row["copy_GBps"] = nbytes / (row["copy_ms"] * 1e-3) / 1e9
        row["pct"] = 100 * row["GBps"] / row["copy_GBps"]
        return row

    for v in args.vocabs:
        out["rows"].append(measure(v))
        torch.cuda.empty_cache()
    out["device"] = torch.cuda.get_device_name()
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--vocabs", type=lambda s: [int(x) for x in s.split(",")], default=[32000, 128256, 151936, 262144])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", type=lambda s: s.split(","), default=list(KERNELS))
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)

    results, failed = {}, False
    for kernel in args.kernels:
        env = dict(os.environ, RL_LOSSES_ROW_KERNEL=kernel)
        cmd = [sys.executable, __file__, "--child", "--n", str(args.n), "--reps", str(args.reps), "--seed",
               str(args.seed), "--vocabs", ",".join(map(str, args.vocabs))]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            print(f"{kernel}: failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
            failed = True
            continue
        results[kernel] = json.loads(lines[0][len("RESULT "):])

    for kernel, res in results.items():
        print(f"\ncorrectness, {kernel} ({res['device']}): relative errors vs fp32 torch")
        print(f"{'N':>6} {'V':>7} {'stride':>7} {'dtype':>8} {'loss':>8} {'grad':>8} {'in-place':>8}  ok")
        for c in res["checks"]:
            print(f"{c['N']:>6} {c['V']:>7} {c['stride']:>7} {c['dtype']:>8} {c['loss_err']:8.1e} {c['grad_err']:8.1e} "
                  f"{c['grad_err_inplace']:8.1e}  {'ok' if c['ok'] else 'FAIL'}")
            failed |= not c["ok"]
        for row in res["rows"]:
            print(f"{row['N']:>6} {row['V']:>7} {row['V']:>7} {'bfloat16':>8} {row['loss_err']:8.1e} "
                  f"{row['grad_err']:8.1e} {row['grad_err_inplace']:8.1e}  {'ok' if row['ok'] else 'FAIL'}")
            failed |= not row["ok"]

    print(f"\ncross-entropy fwd+bwd, N={args.n}, bf16, median of {args.reps}; GB/s over 2*N*V*2 bytes; "
          f"%copy = of a copy of the same bytes (CxS: CTAs per row x stages of the cluster kernel)")
    print(f"{'V':>7} {'kernel':>13} {'CxS':>5} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'copy ms':>8} {'copy GB/s':>9}")
    for v in args.vocabs:
        for kernel, res in results.items():
            row = next(r for r in res["rows"] if r["V"] == v)
            c, st = (cluster_shape(v, 2, 2 if kernel == "cluster2" else 1, kernel == "cluster_pow2",
                                   CTA96_BYTES if kernel == "cluster96" else CTA_BYTES)
                     if kernel != "split" else ("-", "-"))
            print(f"{v:>7} {kernel:>13} {f'{c}x{st}':>5} {row['ms']:8.3f} {row['GBps']:7.0f} {row['pct']:6.1f} "
                  f"{row['copy_ms']:8.3f} {row['copy_GBps']:9.0f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
