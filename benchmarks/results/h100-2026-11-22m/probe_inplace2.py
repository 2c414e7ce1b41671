"""Temporary probe: where does in-place GSPO lose time in bench_gpu.py's timing? The same step timed by
bench_gpu's Timer (sleep, then all reps queued) and by a plain event loop, in place and out of place, with
and without the logits restored before each step."""
import statistics, sys
import torch
sys.path.insert(0, "benchmarks")
import bench_gpu, cases

timer = bench_gpu.Timer(torch.device("cuda"))
for opname, n, v in [("gspo_64", 4096, 32000), ("gspo_2048", 16384, 128256)]:
    op = cases.OPS[opname]
    for ip in (False, True, False, True):
        prov = cases.RlLosses(ip)
        s = prov.prepare(op, cases.make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0))
        restore = cases.logits_restorer(prov, s)

        def step():
            cases.GradSink.last = None
            prov.loss(op, s, cases.head_output(s["base"])).backward()

        def plain(before, reps=25):
            ts = []
            for _ in range(reps):
                if before is not None:
                    before()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); step(); b.record()
                ts.append((a, b))
            torch.cuda.synchronize()
            return statistics.median(x.elapsed_time(y) for x, y in ts)

        for _ in range(3):
            if restore is not None:
                restore()
            step()
        torch.cuda.synchronize()
        rows = [("timer+restore", statistics.median(timer(step, 25, before=restore))),
                ("plain+restore", plain(restore)),
                ("timer", statistics.median(timer(step, 25))),
                ("plain", plain(None))]
        print(f"{opname} {n}x{v} inplace={ip} " + "  ".join(f"{k} {t:.4f}" for k, t in rows)
              + f"  host_ms {timer.host_ms:.3f}", flush=True)
        del s, restore
        torch.cuda.empty_cache()
