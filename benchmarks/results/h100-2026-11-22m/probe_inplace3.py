"""Temporary probe: in-place GSPO's gradient pass against out of place, by input data (advantages as drawn,
all 0: every gradient row zero, all 1) and, in the build it was first run with, by the load instruction of
the gradient-only pass (RL_LOSSES_GRAD_LOAD: 0 ld.global, 1 ld.global.cs, 2 ld.global.L1::no_allocate; a
temporary knob, since removed: later builds ignore it). Plain CUDA-event loop, logits restored before each
step; PROBE_LOAD_MODES (default 0,1,2) picks the modes."""
import os, statistics, sys
import torch
sys.path.insert(0, "benchmarks")
import cases


def timed(prov, op, inp, reps=25):
    s = prov.prepare(op, {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inp.items()})
    restore = cases.logits_restorer(prov, s)

    def step():
        cases.GradSink.last = None
        prov.loss(op, s, cases.head_output(s["base"])).backward()

    for _ in range(3):
        if restore is not None:
            restore()
        step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if restore is not None:
            restore()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    zero_rows = None
    g = cases.GradSink.last
    if g is not None:
        zero_rows = (g.reshape(g.shape[0], -1) == 0).all(1).float().mean().item()
    return statistics.median(x.elapsed_time(y) for x, y in ts), zero_rows


for opname, n, v in [("gspo_64", 4096, 32000), ("gspo_2048", 4096, 32000), ("gspo_64", 16384, 32000)]:
    op = cases.OPS[opname]
    base = cases.make_inputs(op, n, v, torch.bfloat16, "cuda", seed=0)
    variants = {"default": base,
                "adv=0": dict(base, advantages=torch.zeros_like(base["advantages"])),
                "adv=1": dict(base, advantages=torch.ones_like(base["advantages"]))}
    for name, inp in variants.items():
        for mode in os.environ.get("PROBE_LOAD_MODES", "0,1,2").split(","):
            os.environ["RL_LOSSES_GRAD_LOAD"] = mode
            out, z = timed(cases.RlLosses(False), op, inp)
            inpl, _ = timed(cases.RlLosses(True), op, inp)
            print(f"{opname} {n}x{v} {name:8s} load={mode}  out {out:.4f}  inplace {inpl:.4f}  "
                  f"({100 * (inpl / out - 1):+.1f}%)  zero-gradient rows {z:.3f}", flush=True)
            torch.cuda.empty_cache()
