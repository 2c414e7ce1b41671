"""Probe (branch probe-chain): GSPO fwd+bwd with its steps as one chain (RL_LOSSES_CHAIN_ITEMS large) or a launch
per step (0), at V = 32000 and several N, documents of 64: device time with the host ahead, a lone call, host time."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases  # noqa: E402
from profile_calls import device_ms, host_us, synced_ms  # noqa: E402

provider = cases.RlLosses(static_divisor=False)
print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__}")
print(f"{'op':<10} {'N':>6} {'mode':<9} {'device ms':>10} {'lone ms':>9} {'host us':>8}")
for name in ("gspo_64", "gspo_2048"):
    op = cases.OPS[name]
    for n in (512, 2048, 4096, 8192):
        if n % op.seq_len:
            continue
        s = provider.prepare(op, cases.make_inputs(op, n, 32000, torch.bfloat16, torch.device("cuda"), seed=0))

        def step():
            provider.loss(op, s, cases.head_output(s["base"])).backward()

        res = {}
        for rnd in range(2):
            for mode, items in (("per-step", "0"), ("chain", "1000000")):
                os.environ["RL_LOSSES_CHAIN_ITEMS"] = items
                for _ in range(3):
                    step()
                r = (device_ms(step, 50), synced_ms(step), host_us(step))
                res[mode] = r if mode not in res else tuple(min(a, b) for a, b in zip(res[mode], r))
        for mode, (d, lone, h) in res.items():
            print(f"{name:<10} {n:>6} {mode:<9} {d:10.4f} {lone:9.4f} {h:8.1f}")
        del s
