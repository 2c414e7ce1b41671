#!/usr/bin/env bash
# Sets up a virtual environment in .venv with torch and builds the extension (CPU + CUDA when nvcc exists).
#
# torch: an already-importable torch >= 2.11 is used as is (the venv sees system packages); otherwise
# torch==2.14.1 is installed. The extension is built with --no-build-isolation against that torch.
# RL_LOSSES_CUDA=0/1 forces a CPU-only / CUDA build (setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" - <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
  "$VPY" -m pip install -q "torch==2.14.1"
fi
"$VPY" -m pip install -q numpy pytest expecttest ninja setuptools wheel matplotlib tqdm pyyaml
# Test-only peers: the property tests (hypothesis) and the trainers the integrations are proven against
# (TRL, verl and Liger-Kernel, pinned to the versions the tests were written for; verl needs transformers < 5.11).
"$VPY" -m pip install -q hypothesis "trl==1.16.0" "transformers==5.10.4" "verl==0.9.1" "liger-kernel==0.8.5"

# torch finds CUDA through CUDA_HOME or nvcc on PATH; a wrapper nvcc in /usr/local/bin would make it guess
# /usr/local, so point it at the toolkit itself when one is installed there.
if [ -z "${CUDA_HOME:-}" ] && [ -e /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$VPY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -E "rl_losses: building|error" || true
"$VPY" -c "import rl_losses; print('rl_losses imported; CUDA kernels built:', rl_losses.cuda_kernels_available())"
