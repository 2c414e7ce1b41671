"""The CPU row loops are compiled for three vector widths and run at the one ATen picks (csrc/common/cpu_isa.h).
Every width this machine supports must give the float64 reference's losses and gradients. ATen reads
ATEN_CPU_CAPABILITY once per process, so each width runs in its own subprocess."""
import os
import subprocess
import sys

import pytest
import torch

# Widths in ATen's order; a machine supports a prefix of them (ATen refuses to go above what the CPU has).
WIDTHS = ["DEFAULT", "AVX2", "AVX512"]
_WIDEST = torch.backends.cpu.get_cpu_capability()
SUPPORTED = WIDTHS[: WIDTHS.index(_WIDEST) + 1] if _WIDEST in WIDTHS else ["DEFAULT"]

# The child: CE (label smoothing and z-loss: the Σx statistic), GRPO (entropy: the Σp·x statistic) and GSPO
# (the statistics and gradient as two passes) on odd shapes, so that every loop has a vector remainder, in
# fp32 and bf16, against rl_losses.reference in float64 on the same inputs. Prints "ok <capability>".
CHILD = r"""
import sys
import torch
import rl_losses
from rl_losses import reference as ref

want = sys.argv[1]
got = torch.backends.cpu.get_cpu_capability()
assert got == want, f"ATEN_CPU_CAPABILITY gave {got}, expected {want}"
torch.manual_seed(int(sys.argv[2]))
N, V = 45, 3001


def check(name, dtype, run, run_ref):
    logits = (torch.randn(N, V) * 3).to(dtype).requires_grad_()
    loss = run(logits)
    loss.backward()
    x64 = logits.detach().double().requires_grad_()
    loss_ref = run_ref(x64)
    loss_ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = abs(loss.item() - loss_ref.item()) / max(abs(loss_ref.item()), 1e-6)
    assert err < tol, f"{name} {dtype}: loss {loss.item()} vs reference {loss_ref.item()}"
    norm = x64.grad.abs().max().item()
    gerr = (logits.grad.double() - x64.grad).abs().max().item() / norm
    assert gerr < tol, f"{name} {dtype}: gradient off by {gerr:.2e} of its largest entry"


target = torch.randint(0, V, (N,))
target[::7] = -100
adv = torch.randn(N)
old = torch.randn(N) - 8
doc = torch.arange(N) // 10
for dtype in (torch.float32, torch.bfloat16):
    check("cross_entropy", dtype,
          lambda x: rl_losses.cross_entropy(x, target, label_smoothing=0.1, z_loss_factor=1e-3),
          lambda x: ref.cross_entropy(x, target, label_smoothing=0.1, z_loss_factor=1e-3))
    check("grpo", dtype,
          lambda x: rl_losses.grpo_loss(x, target, adv, old, compute_entropy=True).loss,
          lambda x: ref.grpo_loss(x, target, adv, old, compute_entropy=True).loss)
    check("gspo", dtype,
          lambda x: rl_losses.gspo_loss(x, target, adv, old, doc).loss,
          lambda x: ref.gspo_loss(x, target, adv, old, doc).loss)
print("ok", want)
"""


@pytest.mark.parametrize("capability", WIDTHS)
def test_every_vector_width_matches_reference(capability):
    if capability not in SUPPORTED:
        pytest.skip(f"this CPU runs at most {SUPPORTED[-1]}")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower(), OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", CHILD, capability, str(torch.randint(0, 2**31, ()).item())],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", capability]
