"""The CPU row loops are compiled for up to three vector widths and run at the one ATen picks, no wider than the
CPU runs nor than the build compiled, and no narrower than the build compiled (csrc/common/cpu_isa.h; a build in
place compiles only the widest width its machine runs, the wheel and CI all three: setup.py, RL_LOSSES_CPU_WIDTHS).
Every width this machine runs must give the float64 reference's losses and gradients, at the compiled width
nearest that one. ATen reads ATEN_CPU_CAPABILITY once per process, so each width runs in its own subprocess."""
import os
import subprocess
import sys

import pytest
import torch

import rl_losses  # noqa: F401  (registers torch.ops.rl_losses)

# Widths in ATen's order; a CPU runs a prefix of them, a build compiles a run of them.
WIDTHS = ["DEFAULT", "AVX2", "AVX512"]
_CPU = "AVX512" if torch.cpu._is_avx512_supported() else "AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT"
RUNS = WIDTHS[: WIDTHS.index(_CPU) + 1]
COMPILED = list(torch.ops.rl_losses._cpu_isas_compiled())

CHILD = r"""
import sys
import torch
import rl_losses
from rl_losses import reference as ref

want, expected = sys.argv[1], sys.argv[2]
got = torch.backends.cpu.get_cpu_capability()
assert got == want, f"ATEN_CPU_CAPABILITY gave {got}, expected {want}"
runs = torch.ops.rl_losses._cpu_isa()
assert runs == expected, f"ATen's {want}: the row loops run at {runs}, expected {expected}"
torch.manual_seed(int(sys.argv[3]))
with_reference = sys.argv[4] == "reference"
N, V = 45, 3001


def check(name, dtype, run, run_ref):
    logits = (torch.randn(N, V) * 3).to(dtype).requires_grad_()
    loss = run(logits)
    loss.backward()
    assert loss.isfinite() and logits.grad.isfinite().all(), f"{name} {dtype}: not finite"
    if not with_reference:
        return
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


def run_child(capability, expected, reference="reference"):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower(), OMP_NUM_THREADS="2")
    seed = str(torch.randint(0, 2**31, ()).item())
    out = subprocess.run([sys.executable, "-c", CHILD, capability, expected, seed, reference], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", capability]


def runs_at(capability):
    """The width the loops run at when ATen's is `capability`: at most it, the CPU's widest and the build's
    widest, at least the build's narrowest."""
    return max(min(capability, RUNS[-1], COMPILED[-1], key=WIDTHS.index), COMPILED[0], key=WIDTHS.index)


@pytest.mark.parametrize("capability", WIDTHS)
def test_every_vector_width_matches_reference(capability):
    if capability not in RUNS:
        pytest.skip(f"this CPU runs at most {RUNS[-1]}")
    if capability not in COMPILED:
        pytest.skip(f"this build compiled {', '.join(COMPILED)} (setup.py, RL_LOSSES_CPU_WIDTHS)")
    run_child(capability, capability)


@pytest.mark.parametrize("capability", WIDTHS)
def test_width_not_compiled_or_not_run_falls_back(capability):
    """ATen's width where this build did not compile it, or past what the CPU runs: the loops run at the widest
    width below it that the CPU runs and the build compiled, or, below the build's narrowest, at that one.
    ATEN_CPU_CAPABILITY=avx512 makes ATen report AVX512 on any CPU, and torch's own AVX-512 kernels then end the
    process (the float64 reference among them): past the CPU the ops run without it, at the width whose results the
    test above checks."""
    if runs_at(capability) == capability:
        pytest.skip(f"{capability} is compiled and runs here (test_every_vector_width_matches_reference)")
    run_child(capability, runs_at(capability), "reference" if capability in RUNS else "no-reference")
