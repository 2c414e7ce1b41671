"""One fwd+bwd of a loss head under Nsight Compute, for the hardware counters of its kernels.

Warms up, then runs one step between cudaProfilerStart/Stop, so that `ncu --profile-from-start off` sees only
that step's kernels:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats python3 benchmarks/profile_row_kernel.py --provider rl_losses

Providers: rl_losses (cross-entropy; RL_LOSSES_ROW_KERNEL picks the kernel), liger (Liger-Kernel's
cross-entropy, in place), scale (logits * 2 as a new tensor: a plain streaming read + write for comparison).
"""
import argparse

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--provider", default="rl_losses", choices=["rl_losses", "liger", "scale"])
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--v", type=int, default=128256)
args = ap.parse_args()

gen = torch.Generator(device="cuda").manual_seed(0)
logits = torch.randn(args.n, args.v, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(2)
target = torch.randint(0, args.v, (args.n,), device="cuda", generator=gen)

if args.provider == "rl_losses":
    import rl_losses

    base = logits.requires_grad_(True)

    def step():
        rl_losses.cross_entropy(base, target).backward()
        base.grad = None
elif args.provider == "liger":
    from liger_kernel.transformers.functional import liger_cross_entropy

    def step():
        x = logits.detach().clone().requires_grad_(True)
        liger_cross_entropy(x, target).backward()
else:
    def step():
        return logits * 2

for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("profiled one step of", args.provider)
