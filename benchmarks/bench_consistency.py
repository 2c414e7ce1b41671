"""GPU benchmark of the batch-invariant mode (rl_losses.batch_invariant, docs/consistency.md): each op's time in the
default mode and in the batch-invariant one, side by side in one run, and what the mode buys: the rows whose
log-probs or gradient change when one row is dropped from the batch, and the rows where the no-gradient log-probs
(token_log_probs) differ from the gradient path's (grpo_loss), in each mode.

    python3 benchmarks/bench_consistency.py --out OUT                   # H100: N=16384, V=128256 (H=4096), bf16
    python3 benchmarks/bench_consistency.py --dry-run --out /tmp/x      # CPU, tiny shapes: checks the logic

Ops (fwd+bwd unless "fwd"): grpo_loss, cross_entropy, gspo_loss (64 documents), token_log_probs fwd (with the
entropy) and fwd+bwd, linear_grpo_loss and linear_token_log_probs fwd. Median ms of timed calls after warm-up
(benchmarks/timing.py); `invariant_cost` = invariant ms / default ms - 1 (the target: <= 0.05 at the headline
shape). OUT/bench_consistency.json holds the results.
"""
from __future__ import annotations

import argparse
import datetime

import torch

import rl_losses
from timing import git_commit, median_ms, write_results

HEADLINE = dict(n=16384, v=128256, h=4096)
DRY = dict(n=200, v=1000, h=64)
DOCUMENTS = 64


def inputs(shape, dtype, device):
    n, v, h = shape["n"], shape["v"], shape["h"]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(n, v, device=device, generator=gen) * 2).to(dtype)
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    target[torch.rand(n, device=device, generator=gen) < 0.1] = -100
    with torch.no_grad():
        old = rl_losses.token_log_probs(logits, target)[0] + 0.05 * torch.randn(n, device=device, generator=gen)
    return dict(logits=logits, target=target, old=old, adv=torch.randn(n, device=device, generator=gen),
                doc=torch.arange(n, device=device) * DOCUMENTS // n,
                hidden=torch.randn(n, h, device=device, generator=gen).to(dtype),
                weight=(torch.randn(v, h, device=device, generator=gen) * (2.0 / h**0.5)).to(dtype))


def steps(x):
    """name -> a call of that op on the inputs `x` (fresh leaves made once, their gradients cleared per call)."""
    logits = x["logits"].clone().requires_grad_()
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()

    def backward(loss, *leaves):
        for leaf in leaves:
            leaf.grad = None
        loss.backward()

    def token_log_probs_step():
        lp, ent = rl_losses.token_log_probs(logits, x["target"], compute_entropy=True)
        backward(lp.sum() + ent.sum(), logits)

    return {
        "grpo_loss": lambda: backward(rl_losses.grpo_loss(logits, x["target"], x["adv"], x["old"]).loss, logits),
        "cross_entropy": lambda: backward(rl_losses.cross_entropy(logits, x["target"]), logits),
        "gspo_loss": lambda: backward(rl_losses.gspo_loss(logits, x["target"], x["adv"], x["old"], x["doc"],
                                                          num_documents=DOCUMENTS).loss, logits),
        "token_log_probs_fwd": lambda: rl_losses.token_log_probs(x["logits"], x["target"], compute_entropy=True),
        "token_log_probs": token_log_probs_step,
        "linear_grpo_loss": lambda: backward(rl_losses.linear_grpo_loss(hidden, weight, x["target"], x["adv"],
                                                                        x["old"]).loss, hidden, weight),
        "linear_token_log_probs_fwd": lambda: rl_losses.linear_token_log_probs(x["hidden"], x["weight"], x["target"]),
    }


def differing_rows(x):
    """Rows whose grpo log-probs or gradient change when row 0 is dropped, and rows where token_log_probs (no
    gradient) differs from grpo_loss's log-probs (with a gradient): bitwise, in the mode in force."""
    def grpo(rows):
        logits = x["logits"][rows].clone().requires_grad_()
        out = rl_losses.grpo_loss(logits, x["target"][rows], x["adv"][rows], x["old"][rows], divisor=1.0)
        out.loss.backward()
        return out.log_probs, logits.grad

    n = len(x["target"])
    lp, grad = grpo(slice(0, n))
    lp_dropped, grad_dropped = grpo(slice(1, n))
    with torch.no_grad():
        plain = rl_losses.token_log_probs(x["logits"], x["target"])[0]
    return {"log_prob_rows_changed_by_dropping_a_row": int((lp[1:] != lp_dropped).sum()),
            "grad_rows_changed_by_dropping_a_row": int((grad[1:] != grad_dropped).any(dim=1).sum()),
            "no_grad_vs_grad_log_prob_rows": int((plain != lp).sum()), "rows": n}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ops", default=None, help="comma-separated subset of the ops")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    shape = DRY if args.dry_run else HEADLINE
    dtype = torch.bfloat16
    x = inputs(shape, dtype, device)
    results = {"shape": shape, "dtype": str(dtype), "commit": git_commit(), "date": datetime.date.today().isoformat(),
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "ops": {}, "bits": {}}
    wanted = set(args.ops.split(",")) if args.ops else None
    for name, step in steps(x).items():
        if wanted is not None and name not in wanted:
            continue
        entry = {}
        for mode, invariant in (("default", False), ("invariant", True)):
            with rl_losses.batch_invariant(invariant):
                for _ in range(3):
                    step()
                entry[f"{mode}_ms"] = median_ms(step, args.reps, device)
        entry["invariant_cost"] = entry["invariant_ms"] / entry["default_ms"] - 1
        results["ops"][name] = entry
        print(name, entry)
    for mode, invariant in (("default", False), ("invariant", True)):
        with rl_losses.batch_invariant(invariant):
            results["bits"][mode] = differing_rows(x)
        print(mode, results["bits"][mode])
    write_results(args.out, "bench_consistency.json", results)


if __name__ == "__main__":
    main()
