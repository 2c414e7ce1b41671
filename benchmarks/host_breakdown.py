"""Where a tiny call's host time goes on this machine: per-call host time of the raw ops (forward + backward, and the
forward alone under no_grad) beside PyTorch's smallest autograd step, an add_ and an empty, with CPU tensors and with
CUDA tensors on the same host; then every CUDA runtime call one op call makes (CUPTI through torch.profiler).

    python3 benchmarks/host_breakdown.py
"""
import collections, json, os, tempfile, time

import torch

import rl_losses
ops = torch.ops.rl_losses
def timed(fn, n=3000):
    for _ in range(300): fn()
    best = 1e9
    for _ in range(3):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        for i in range(n):
            fn()
            if i % 64 == 63 and dev == "cuda": torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best
for dev in ("cpu", "cuda"):
    x = torch.randn(8, 64, device=dev, requires_grad=True)
    xd = x.detach().clone()
    t = torch.randint(0, 64, (8,), device=dev)
    adv = torch.randn(8, device=dev); old = torch.randn(8, device=dev)
    def ce_fb(): ops.cross_entropy(x, t)[0].backward()
    def grpo_fb(): ops.grpo(x, t, adv, old)[0].backward()
    def ce_ng():
        with torch.no_grad(): ops.cross_entropy(xd, t)
    def grpo_ng():
        with torch.no_grad(): ops.grpo(xd, t, adv, old)
    def floor_fb(): (x * 2).sum().backward()
    def add_(): xd.add_(1)
    def empty(): torch.empty(8, device=dev)
    def ce_sum_ng():
        with torch.no_grad(): ops.cross_entropy(xd, t, reduction="sum")
    rows = dict(ce_fb=ce_fb, grpo_fb=grpo_fb, ce_no_grad=ce_ng, ce_sum_no_grad=ce_sum_ng, grpo_no_grad=grpo_ng,
                torch_floor_fb=floor_fb, add_=add_, empty=empty)
    print(f"== {dev}: host us/call (best of 3 rounds of 3000)")
    for k, f in rows.items():
        print(f"  {k:18s} {timed(f):8.1f}")
    if dev == "cuda":
        from torch.profiler import profile, ProfilerActivity
        for name, f in (("ce_no_grad", ce_ng), ("grpo_no_grad", grpo_ng), ("ce_fb", ce_fb), ("grpo_fb", grpo_fb)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20): f()
                torch.cuda.synchronize()
            path = os.path.join(tempfile.mkdtemp(), "p.json")
            prof.export_chrome_trace(path)
            with open(path) as f_trace:
                ev = json.load(f_trace)["traceEvents"]
            c = collections.defaultdict(lambda: [0, 0.0])
            for e in ev:
                if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op"):
                    c[(e["cat"], e["name"])][0] += 1; c[(e["cat"], e["name"])][1] += e.get("dur", 0)
            print(f"-- {name}: calls per op call (x20 calls), mean us (profiled)")
            for (cat, nm), (k, d) in sorted(c.items(), key=lambda kv: -kv[1][1]):
                if k >= 20: print(f"  {cat:12s} {k/20:5.1f} x {d/k:7.2f} us  {nm[:80]}")
