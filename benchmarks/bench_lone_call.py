"""A lone loss call against its peers': forward + backward with the device idle before and waited for after, the
call a trainer makes when it reads a metric (`.item()`), evaluates, or runs a small micro-batch. Where the host's
time per call exceeds the device's, the host sets the lone call's time.

    python3 benchmarks/bench_lone_call.py [--shapes 4096x32000,1024x128256] [--ops ce,grpo] [--out FILE]

Per (op, shape, provider), bf16, each provider's call as a trainer makes it (its loss, then `.backward()`):
  lone    the median wall time of one call, synchronised before and after (50 calls);
  device  the median CUDA-event time of one call with the host ahead;
  host    the host's time per call while queueing, the device held busy.
Providers: rl_losses (its functional wrappers), liger (Liger-Kernel's Triton CE and GRPO), fast_llm (Fast-LLM's
Triton forward-backward kernels, where the `fast_llm` package is importable: its loss and gradient in one call,
the gradient handed back by a minimal autograd Function, as its layers do). `torch floor`: a one-node autograd
step on one element, the host cost below which no autograd loss call goes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402
from profile_calls import device_ms, host_us, synced_ms  # noqa: E402
from timing import git_commit  # noqa: E402


class _GradInForward(torch.autograd.Function):
    """Fast-LLM's kernels return the loss and the gradient of the logits together; backward hands it on."""

    @staticmethod
    def forward(ctx, logits, fn):
        loss, grad = fn(logits.detach())
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        # The kernel was given the upstream gradient (1: the step's loss is the graph's output), as Fast-LLM's
        # layers give it theirs; scaling again here would add a pass over the gradient.
        (grad,) = ctx.saved_tensors
        return grad, None


def fast_llm_step(op, inp):
    """The fast_llm provider's step for `op` (CE and GRPO), or None where Fast-LLM cannot be imported."""
    try:
        from fast_llm.functional.triton.entropy_loss import triton_entropy_loss_forward_backward
        from fast_llm.functional.triton.grpo_loss import triton_grpo_loss_forward_backward
    except Exception as e:  # noqa: BLE001  (absent, or a version that moved its functions)
        print(f"fast_llm unavailable: {type(e).__name__}: {e}")
        return None
    base = inp["logits"].requires_grad_(True)
    target = inp["target"]
    if op.kind == "ce":
        def fn(x):
            loss, _, grad = triton_entropy_loss_forward_backward(x, target, None, grad_output=1.0)
            return loss, grad
    elif op.kind == "grpo" and not op.beta:
        adv, old = inp["advantages"], inp["old_log_probs"]

        def fn(x):
            loss, grad, _ = triton_grpo_loss_forward_backward(x, target, adv, old, grad_output=1.0,
                                                              epsilon_low=cases.EPS_LOW, epsilon_high=cases.EPS_HIGH)
            return loss, grad
    else:
        return None

    def step():
        _GradInForward.apply(cases.head_output(base), fn).backward()

    return step


def provider_step(name, op, inp):
    if name == "fast_llm":
        return fast_llm_step(op, inp)
    try:
        p = cases.build_provider(name)
    except Exception as e:  # noqa: BLE001
        print(f"{name} unavailable: {type(e).__name__}: {e}")
        return None
    if not p.supports(op):
        return None
    s = p.prepare(op, inp)

    def step():
        p.loss(op, s, cases.head_output(s["base"])).backward()

    return step


def torch_floor_step():
    x = torch.ones(1, device="cuda", requires_grad=True)

    def step():
        x.grad = None
        (x * 2).sum().backward()

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x32000,1024x128256")
    ap.add_argument("--ops", default="ce,grpo")
    ap.add_argument("--providers", default="rl_losses,liger,fast_llm")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": git_commit(),
            "date": datetime.date.today().isoformat()}
    print(" | ".join(f"{k} {v}" for k, v in meta.items()))
    rows = []
    floor = torch_floor_step()
    for _ in range(20):
        floor()
    row = {"op": "torch floor", "provider": "torch", "host_us": round(host_us(floor, 200), 1),
           "lone_ms": round(synced_ms(floor, 50), 4)}
    print(f"torch floor (x*2).sum().backward(): host {row['host_us']} us/call, lone {row['lone_ms']:.4f} ms")
    rows.append(row)
    for shape in args.shapes.split(","):
        n, v = (int(x) for x in shape.split("x"))
        for name in args.ops.split(","):
            op = cases.OPS[name]
            print(f"\n== {name} {n}x{v} bf16")
            for prov in args.providers.split(","):
                inp = cases.make_inputs(op, n, v, torch.bfloat16, dev, seed=0)
                step = provider_step(prov, op, inp)
                if step is None:
                    continue
                for _ in range(5):
                    step()
                row = {"op": name, "n": n, "v": v, "provider": prov, "lone_ms": round(synced_ms(step, 50), 4),
                       "device_ms": round(device_ms(step), 4), "host_us": round(host_us(step), 1)}
                rows.append(row)
                print(f"   {prov:10s} lone {row['lone_ms']:.4f} ms | device {row['device_ms']:.4f} ms | "
                      f"host {row['host_us']:.0f} us/call")
                del step, inp
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
