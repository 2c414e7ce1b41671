"""CPU measurement of kept_token_log_probs (docs/consistency.md): the forward without gradient and the forward +
backward into policy_token_loss, each exactly as bench_sampler.kept_ids_step calls them (kept_ids = the top 1024 ids
per row), with the ops each call runs counted by torch.profiler. On a GPU each counted op is one kernel over N x K
values (or the N x V gradient), so the count is what the GPU time follows; the CPU milliseconds are the host's.

    PYTHONPATH=python python benchmarks/bench_kept_set.py --shape 2048 32000 --dtype float32 bfloat16

--no-check times the op as it runs on a GPU, without the CPU's input check (a sort of the ids per row, which
dominates the CPU time and which a GPU skips unless RL_LOSSES_CHECK_INPUTS=1); the counts always leave it out.
"""
from __future__ import annotations

import argparse
import collections
import math
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_sampler import kept_ids_step
from rl_losses import kept_set

# Ops that do no pass over values themselves: allocations, views, and the conversions, copies and wrappers that
# either do nothing (a `to` to the same dtype) or do their work in a child op that is counted instead.
METADATA = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::reshape",
            "aten::_reshape_alias", "aten::as_strided", "aten::select", "aten::slice", "aten::unsqueeze",
            "aten::squeeze", "aten::expand", "aten::t", "aten::transpose", "aten::permute", "aten::detach",
            "aten::alias", "aten::resize_", "aten::lift_fresh", "aten::result_type", "aten::_unsafe_view",
            "aten::broadcast_to", "aten::expand_as", "aten::view_as", "detach", "aten::unbind", "aten::split",
            "aten::to", "aten::_to_copy", "aten::contiguous", "aten::real", "aten::scalar_tensor",
            "aten::_has_compatible_shallow_copy_type", "aten::is_nonzero", "aten::narrow", "aten::new_empty"}


# Ops that on the CPU run copy_ or fill_ inside them (dtype conversions a GPU kernel makes as it loads and stores,
# a reduction's initial value): counted once, as the one kernel each is on a GPU. (`where` and `to` convert by an op
# of their own on a GPU too: their copies count.)
UNITS = {"aten::gather", "aten::mul", "aten::addcmul", "aten::div", "aten::add", "aten::sub",
         "aten::amax", "aten::sum", "aten::any", "aten::all", "aten::argmax"}


def _works(e) -> bool:
    return e.name not in METADATA and e.name.startswith(("aten::", "rl_losses::"))


def _has_working_child(e) -> bool:
    return any(_works(c) or _has_working_child(c) for c in e.cpu_children)


def counted_ops(step, wide: int) -> tuple[collections.Counter, collections.Counter, int]:
    """The ops one call of `step` runs that pass over values, each a kernel on a GPU: aten and rl_losses ops with no
    such op inside them (or one of UNITS), by name; their CPU milliseconds; how many read an input of at least
    `wide` values (the N x K passes and the N x V gradient's, as opposed to the per-position ones)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    counts, ms, n_wide = collections.Counter(), collections.Counter(), 0

    def walk(e):
        nonlocal n_wide
        if _works(e) and (e.name in UNITS or not _has_working_child(e)):
            counts[e.name] += 1
            ms[e.name] += e.cpu_time_total / 1e3
            n_wide += max((math.prod(shape) for shape in e.input_shapes if shape), default=0) >= wide
            return
        for c in e.cpu_children:
            walk(c)
    for e in prof.events():
        if e.cpu_parent is None:
            walk(e)
    return counts, ms, n_wide


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "V"))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--steps", nargs="+", choices=["no_grad", "fwd_bwd"], default=["no_grad", "fwd_bwd"],
                        help="fwd_bwd holds the N x V gradient")
    parser.add_argument("--ops", action="store_true", help="print each counted op")
    a = parser.parse_args()
    if a.no_check:
        kept_set._check = lambda *args, **kwargs: None
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, input check {'off' if a.no_check else 'on'}")
    for n, v in a.shape or [(2048, 32000)]:
        target = torch.randint(0, v, (n,))
        target[::7] = -100
        adv, old = torch.randn(n), -torch.rand(n)
        for dtype in a.dtype:
            logits = torch.empty(n, v, dtype=getattr(torch, dtype)).normal_(0, 2)  # N(0, 2^2), no fp32 copy
            for op in [{"no_grad": "token_log_probs", "fwd_bwd": "grpo"}[s] for s in a.steps]:
                step = kept_ids_step(op, logits, target, adv, old)
                step()
                ops, op_ms, n_wide = counted_ops(step, n * 512)
                ms = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    step()
                    ms.append((time.perf_counter() - t) * 1e3)
                name = "no grad" if op == "token_log_probs" else "fwd+bwd"
                print(f"N={n} V={v} {dtype:8s} {name}: {statistics.median(ms):9.2f} ms (median of {a.reps}), "
                      f"{sum(ops.values())} ops, {n_wide} of them over N x K or N x V", flush=True)
                if a.ops:
                    print("    " + ", ".join(f"{k.split('::')[1]} x{c}" if c > 1 else k.split("::")[1]
                                             for k, c in sorted(ops.items())))
                    print("    slowest (profiled call, ms): " + ", ".join(
                        f"{k.split('::')[1]} {t:.1f}" for k, t in op_ms.most_common(6)))
            del logits


if __name__ == "__main__":
    main()
