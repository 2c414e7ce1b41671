"""Temporary probe: in-place GSPO step time with the logits restored by a DMA copy or by a kernel."""
import statistics, sys
import torch
sys.path.insert(0, "benchmarks")
import cases

n, v = 16384, 128256
for opname in ["gspo_2048", "ce"]:
    op = cases.OPS[opname]
    for ip in (False, True):
        prov = cases.RlLosses(ip)
        s = prov.prepare(op, cases.make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0))
        pristine = s["base"].detach().clone()
        def step():
            cases.GradSink.last = None
            prov.loss(op, s, cases.head_output(s["base"])).backward()
        for how in ["none", "copy_", "kernel", "copy_+sync"]:
            def before():
                with torch.no_grad():
                    if how.startswith("copy_"):
                        s["base"].copy_(pristine)
                    elif how == "kernel":
                        torch.mul(pristine, 1, out=s["base"].data)
                if how.endswith("sync"):
                    torch.cuda.synchronize()
            if how == "none" and ip:
                continue
            for _ in range(3):
                before(); step()
            torch.cuda.synchronize()
            ts = []
            for _ in range(15):
                before()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); step(); b.record()
                ts.append((a, b))
            torch.cuda.synchronize()
            print(f"{opname} inplace={ip} restore={how:10s} {statistics.median(x.elapsed_time(y) for x, y in ts):.3f} ms", flush=True)
        del s, pristine
        torch.cuda.empty_cache()
