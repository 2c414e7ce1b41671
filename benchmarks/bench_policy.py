"""Plain GRPO, plain GSPO and every option of the policy family (docs/policy_losses.md), each side by side with
Liger-Kernel's ``triton_grpo_loss`` with the same option where Liger has it, fwd+bwd, in one run.

    python3 benchmarks/bench_policy.py --out OUT              # N = 16384 (16 x 1024), V = 128256, bf16, CUDA
    python3 benchmarks/bench_policy.py --dry-run --out /tmp/x # CPU, a tiny shape: checks the logic only
    python3 benchmarks/report.py --add OUT/policy.json --results benchmarks/results --write   # record it

Per option: the median of --repeats fwd+bwd calls, each timed by CUDA events behind a sleep kernel so that the
host is ahead of the GPU (benchmarks/timing.py) (as in a training step; without it the host's ~0.4 ms of Python and dispatch per call
lands in the timings), its ratio to plain GRPO's time (to plain GSPO's for the GSPO rows), and Liger's time and
its ratio to ours. Liger runs in place (its default): its logits are restored before each timed call, outside
the timing. The inputs are a training step's: old log-probs near the current ones (a step of drift), the
rollout engine's near those, so few tokens clip (a clipped token's zero gradient row is cheaper to write, and
inputs where most tokens clip flatter an option that clips). The family promises no extra pass over the
vocabulary except where the math needs one: an on-policy sequence-level rollout correction and vespo (with
old_log_probs) need every token's log-prob before any gradient (two reads of the logits, like GSPO); those rows
are marked "2 passes". Writes OUT/policy.json (report.py's format: a bench_policy.py run of rows).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

import rl_losses

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timer, git_commit, summary  # noqa: E402

# The options that read the logits twice (every GSPO row does).
# (clip_cov and kl_cov read them once from logits: their selected rows are read again, a few rows.)
TWO_PASSES = {"vespo", "vespo_token_truncate", "on_policy_sequence_truncate", "bypass_token_k3_no_divisor"}


def options(rollout, rollout_seq_ratio, rollout_tok_ratio, ref):
    """name -> (loss, rl_losses kwargs, Liger kwargs or None). Liger's rollout correction is the ratio tensor
    its caller computes (vllm_is_ratio, (B, T) or (B, 1)); its GSPO is importance_sampling_level="sequence"."""
    rc = lambda mode, **kw: dict(rollout_log_probs=rollout, rollout_correction=mode, **kw)  # noqa: E731
    kl = lambda **kw: dict(ref_log_probs=ref, beta=0.04, **kw)  # noqa: E731
    # verl's rollout rejection: the rollout's drift (δ ~ N(0, 0.05²)) puts k3 ≈ δ²/2 near 1.25e-3, so the token rule
    # rejects about a fifth of the tokens and the sequence rule about half the sequences.
    rs = lambda mode, threshold: dict(rollout_log_probs=rollout, rollout_rs=mode,  # noqa: E731
                                      rollout_rs_threshold=threshold)
    # verl's bypass_mode: old = the rollout's, the rules judging the current log-probs (δ = lp − rollout ~
    # N(0, 2·0.05²): k3 ≈ δ²/2 has mean 2.5e-3; the token rule at 0.004 rejects about a fifth of the tokens, at
    # 0.0135 about 2%; the sequence rule at 0.0025 about half the sequences, at 0.0027 about one in sixteen, its
    # mean over 1024 tokens having a standard deviation near 1.2e-4); verl's actor passes its global token count (divisor),
    # which keeps grpo at one pass, the rejected rows zeroed in the backward (a cost in proportion to their share);
    # without it grpo reads the logits twice.
    bypass = lambda mode, threshold, **kw: dict(on_policy=True, bypass_mode=True, **rs(mode, threshold),  # noqa
                                                **kw)
    return {
        "plain": ("grpo", dict(), dict()),
        "cispo": ("grpo", dict(loss_type="cispo", epsilon_high=4.0), dict(loss_type="cispo", eps_high=4.0)),
        "sapo": ("grpo", dict(loss_type="sapo"), dict(loss_type="sapo")),
        "gpg": ("grpo", dict(loss_type="gpg"), None),
        "dro": ("grpo", dict(loss_type="dro", dro_beta=0.1), None),
        "dppo_tv": ("grpo", dict(loss_type="dppo_tv"), None),
        "dppo_kl": ("grpo", dict(loss_type="dppo_kl", epsilon_low=0.05, epsilon_high=0.05), None),
        "grpo_clip_cov": ("grpo", dict(loss_type="clip_cov"), None),  # verl's defaults
        "grpo_kl_cov": ("grpo", dict(loss_type="kl_cov"), None),
        "vespo": ("grpo", dict(loss_type="vespo"), dict(loss_type="vespo")),
        "vespo_on_policy": ("grpo", dict(loss_type="vespo", on_policy=True), dict(loss_type="vespo",
                                                                                 on_policy=True)),
        "vespo_token_truncate": ("grpo", dict(loss_type="vespo", **rc("token_truncate")),
                                 dict(loss_type="vespo", vllm_is_ratio=rollout_tok_ratio("truncate"))),
        "on_policy": ("grpo", dict(on_policy=True), dict(on_policy=True)),
        "token_truncate": ("grpo", rc("token_truncate"), dict(vllm_is_ratio=rollout_tok_ratio("truncate"))),
        "token_mask": ("grpo", rc("token_mask"), dict(vllm_is_ratio=rollout_tok_ratio("mask"))),
        "sequence_truncate": ("grpo", rc("sequence_truncate"), dict(vllm_is_ratio=rollout_seq_ratio("truncate"))),
        "sequence_mask": ("grpo", rc("sequence_mask"), dict(vllm_is_ratio=rollout_seq_ratio("mask"))),
        "on_policy_sequence_truncate": ("grpo", dict(on_policy=True, **rc("sequence_truncate")), None),
        "rejection_token_k3": ("grpo", rs("token_k3", "0.002"), None),
        "rejection_seq_mean_k3": ("grpo", rs("seq_mean_k3", "0.00125"), None),
        "bypass_token_k3": ("grpo", bypass("token_k3", "0.004", divisor=float(rollout.numel())), None),
        "bypass_seq_mean_k3": ("grpo", bypass("seq_mean_k3", "0.0025", divisor=float(rollout.numel())), None),
        "bypass_token_k3_no_divisor": ("grpo", bypass("token_k3", "0.004"), None),
        "bypass_token_k3_2pct": ("grpo", bypass("token_k3", "0.0135", divisor=float(rollout.numel())), None),
        "bypass_seq_mean_k3_few": ("grpo", bypass("seq_mean_k3", "0.0027", divisor=float(rollout.numel())), None),
        "k1": ("grpo", kl(kl_estimator="k1"), None),
        "k2": ("grpo", kl(kl_estimator="k2"), None),
        "k3": ("grpo", kl(kl_estimator="k3"), dict(beta=0.04)),
        "k3_importance_weighted": ("grpo", kl(kl_importance_weighted=True), dict(beta=0.04,
                                                                               use_bias_correction_kl=True)),
        "entropy_bonus": ("grpo", dict(entropy_coefficient=0.01), None),
        "everything": ("grpo", dict(loss_type="sapo", entropy_coefficient=0.01, **rc("token_truncate"),
                                    **kl(kl_importance_weighted=True)), None),
        "gspo": ("gspo", dict(), dict(importance_sampling_level="sequence")),
        "gspo_vespo": ("gspo", dict(loss_type="vespo"), None),
        "gspo_geo_mean": ("gspo", dict(loss_type="geo_mean"), None),
        "gspo_importance_weighted_kl": ("gspo", kl(kl_importance_weighted=True),
                                        dict(importance_sampling_level="sequence", beta=0.04,
                                             use_bias_correction_kl=True)),
        "gspo_sequence_truncate": ("gspo", rc("sequence_truncate"),
                                   dict(importance_sampling_level="sequence",
                                        vllm_is_ratio=rollout_seq_ratio("truncate"))),
        "gspo_rejection_token_k3": ("gspo", rs("token_k3", "0.002"), None),
        "gspo_rejection_seq_mean_k3": ("gspo", rs("seq_mean_k3", "0.00125"), None),
        "gspo_bypass_token_k3": ("gspo", bypass("token_k3", "0.004"), None),
        "gspo_bypass_seq_mean_k3": ("gspo", bypass("seq_mean_k3", "0.0025"), None),
    }


def timed(timer: Timer, repeats: int):
    """The median and quantiles of `repeats` timed calls after 3 warm-up calls (timing.Timer)."""
    def run(fn, before=None) -> dict:
        for _ in range(3):
            if before:
                before()
            fn()
        timer.sync()
        return summary(timer(fn, repeats, before=before))
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--only", default=None, help="comma-separated option names")
    p.add_argument("--no-liger", action="store_true")
    args = p.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    b, t, v = (2, 8, 64) if args.dry_run else (16, 1024, 128256)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    logits_full = (torch.randn(b, t + 1, v, device=device) * 2).to(dtype)  # Liger's layout: one more position
    logits = logits_full[:, :-1]
    target = torch.randint(0, v, (b, t), device=device)
    advantages = torch.randn(b, device=device)
    with torch.no_grad():
        lp = rl_losses.grpo_loss(logits, target, advantages, None).log_probs
    old = lp + 0.05 * torch.randn_like(lp)  # a step of drift
    rollout = old + 0.05 * torch.randn_like(old)  # the inference engine's numerics
    ref = old + 0.1 * torch.randn_like(old)
    doc = torch.arange(b, device=device).unsqueeze(1).expand(b, t).contiguous()  # GSPO: a document per row

    def weight(log_rho, kind, cap=3.0):
        rho = torch.exp(log_rho)
        return rho.clamp(max=cap) if kind == "truncate" else torch.where(rho <= cap, rho, 0.0)

    rollout_tok_ratio = lambda kind: weight(old - rollout, kind)  # noqa: E731
    rollout_seq_ratio = lambda kind: weight((old - rollout).sum(-1, keepdim=True), kind)  # noqa: E731
    liger = None
    if not args.dry_run and not args.no_liger:
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss as liger
        except ImportError as e:
            print(f"liger-kernel not importable ({e}): rl_losses only")
    timer = timed(Timer(device), args.repeats)
    x = logits.detach().clone().requires_grad_()
    y = logits_full.detach().clone().requires_grad_()
    table = options(rollout, rollout_seq_ratio, rollout_tok_ratio, ref)
    names = [n for n in table if args.only is None or n in args.only.split(",")]
    rows = []
    for name in names:
        loss, ours, theirs = table[name]
        ours = dict(ours)
        old_arg = None if ours.pop("on_policy", False) else old
        if loss == "grpo":
            run_ours = lambda: rl_losses.grpo_loss(x, target, advantages, old_arg, **ours).loss.backward()  # noqa
        else:
            run_ours = lambda: rl_losses.gspo_loss(x, target, advantages, old_arg, doc, num_documents=b,  # noqa
                                                   **ours).loss.backward()
        row = dict(op="policy", option=name, loss=loss, n=b * t, v=v, dtype=str(dtype).removeprefix("torch."),
                   provider="rl_losses", passes=2 if name in TWO_PASSES or loss == "gspo" else 1)
        try:
            row.update(timer(lambda: (run_ours(), setattr(x, "grad", None))))
        except Exception as e:  # a failing option is a row with its error, not the end of the run
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        if liger is not None and theirs is not None:
            theirs = dict(theirs)
            liger_old = None if theirs.pop("on_policy", False) else old
            beta = theirs.pop("beta", 0.0)
            lrow = dict(row, provider="liger")
            lrow.pop("error", None)
            for k in ("ms", "ms_p20", "ms_p80", "reps"):
                lrow.pop(k, None)

            def run_liger():
                out = liger(y, liger_old, ref if beta else None, target, advantages, temperature=1.0, beta=beta,
                            inplace=True, reduce=True, **theirs)
                (out[0] if isinstance(out, tuple) else out).backward()
                y.grad = None

            try:
                # Liger writes its gradient into the logits: restored (untimed) before each call.
                lrow.update(timer(run_liger, before=lambda: y.data.copy_(logits_full)))
            except Exception as e:
                lrow["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(lrow)
        print(f"{name}: " + ", ".join(f"{r['provider']} {r.get('ms', r.get('error'))}" for r in rows
                                      if r["option"] == name), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()

    # Ratios: to plain GRPO (GSPO rows: to plain GSPO), and Liger's time over ours.
    ms = {(r["option"], r["provider"]): r.get("ms") for r in rows}
    for r in rows:
        base = ms.get(("gspo" if r["loss"] == "gspo" else "plain", r["provider"]))
        if r.get("ms") and base:
            r["vs_plain"] = round(r["ms"] / base, 4)
        if r["provider"] == "liger" and r.get("ms") and ms.get((r["option"], "rl_losses")):
            r["speedup_of_rl"] = round(r["ms"] / ms[(r["option"], "rl_losses")], 3)
            r["vs"] = "rl_losses"
    print(f"\n{'option':30s} {'rl_losses ms':>12s} {'x plain':>8s} {'passes':>6s} {'Liger ms':>9s} "
          f"{'Liger x plain':>13s} {'Liger/ours':>10s}")
    for name in names:
        ours, theirs = next(r for r in rows if r["option"] == name and r["provider"] == "rl_losses"), next(
            (r for r in rows if r["option"] == name and r["provider"] == "liger"), {})
        f = lambda r, k, spec: "-" if r.get(k) is None else format(r[k], spec)  # noqa: E731
        print(f"{name:30s} {f(ours, 'ms', '.3f'):>12s} {f(ours, 'vs_plain', '.3f'):>8s} {ours['passes']:>6d} "
              f"{f(theirs, 'ms', '.3f'):>9s} {f(theirs, 'vs_plain', '.3f'):>13s} "
              f"{f(theirs, 'speedup_of_rl', '.2f'):>10s}" + (f"  {ours['error']}" if ours.get("error") else ""))
    os.makedirs(args.out, exist_ok=True)
    liger_version = None
    try:
        import importlib.metadata as md
        liger_version = md.version("liger-kernel")
    except Exception:
        pass
    meta = dict(script="bench_policy.py", device=torch.cuda.get_device_name() if device == "cuda" else "CPU",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command="python3 benchmarks/bench_policy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                git=git_commit(), torch=torch.__version__, liger_kernel=liger_version,
                shape=dict(n=b * t, v=v, dtype=str(dtype).removeprefix("torch.")))
    with open(os.path.join(args.out, "policy.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    print("wrote", os.path.join(args.out, "policy.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
