"""The CUDA kernels of one fwd+bwd step of a benchmark case, with their device time (torch.profiler).

At small shapes the fixed cost of the small kernels around the row passes matters (an N = 4096, V = 32000
step moves its bytes in ~0.2 ms; every extra kernel adds 2-3 us). This lists each kernel a step launches, in
order, so that such overhead is counted rather than guessed:

    python3 benchmarks/trace_kernels.py --ops ce,grpo,gspo_2048 --n 4096 --v 32000 [--provider rl_losses]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402


def trace(op, n, v, provider, steps):
    inp = cases.make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0)
    s = provider.prepare(op, inp)

    # In place, each step first gets the original logits back (as in bench_gpu.py); its copy is listed.
    restore = cases.logits_restorer(provider, s)

    def step():
        if restore is not None:
            restore()
        cases.GradSink.last = None
        provider.loss(op, s, cases.head_output(s["base"])).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    last = kernels[-per_step:]
    span = last[-1].time_range.end - last[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in last)
    print(f"\n{op.name} {provider.name} N={n} V={v}: {per_step} kernels per step, busy {busy:.1f} us, "
          f"first start to last end {span:.1f} us")
    for e in last:
        print(f"  {e.time_range.end - e.time_range.start:8.1f} us  {e.name[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="ce,grpo,gspo_2048,gspo_64")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--provider", default="rl_losses", choices=["rl_losses", "rl_losses_inplace"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    provider = cases.RlLosses(inplace=args.provider == "rl_losses_inplace")
    for name in args.ops.split(","):
        trace(cases.OPS[name], args.n, args.v, provider, args.steps)


if __name__ == "__main__":
    main()
