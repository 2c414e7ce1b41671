#!/usr/bin/env bash
# Sets up a virtual environment in .venv with torch and builds the extension in place. `setup.sh --test` also
# installs what the test suite needs (make test); make train needs only the first part.
#
# torch: an already-importable torch >= 2.11 is used as is (the venv sees system packages); otherwise
# torch==2.14.1 is installed, or its CPU build torch==2.13.0+cpu on a machine without a GPU where one is found. Each package set is installed once: a stamp in .venv records the list it came
# from, and a later run whose list is unchanged skips pip. The extension is built by `setup.py build_ext
# --inplace` into build/, which persists, so that ninja recompiles only what changed; the venv finds the
# package through a .pth file pointing at python/ (an editable install without pip's throwaway build folder).
# CUDA kernels are compiled where a GPU is visible or RL_LOSSES_CUDA=1 asks, the CPU row loops for the widest vector
# width this CPU runs unless RL_LOSSES_CPU_WIDTHS=all asks for all (setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
# --no-compile: pip would otherwise byte-compile every module of every package it installs (torch's CPU wheel: 29 s
# to install with it, 11 s without); Python compiles the modules a program imports on first import instead.
PIP=("$VPY" -m pip install -q --no-compile)

# byte_compile NAME KEY MODULE...: imports the modules and writes the bytecode of every module of .venv they loaded,
# which --no-compile left to the first import; once per KEY (.venv/.stamp-bytecode-NAME records it). Python writes it
# itself on import, except where the environment sets PYTHONDONTWRITEBYTECODE (as CI and container images often do):
# then every process compiled torch's modules again, 4-5 s of CPU per process that imports torch (three in `make
# train`) instead of about 2. Only .venv's own files are written (none in python/, none of the system's packages).
# Run in the background, on the core that pip and the precompiled header leave idle.
byte_compile() {
  local stamp=".venv/.stamp-bytecode-$1" key="$2"
  shift 2
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
    return
  fi
  "$VPY" - "$@" > /dev/null 2>&1 <<'PYEOF' || return 0
import importlib, os, py_compile, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError:  # an optional package of the example
        pass
venv = os.path.realpath(sys.prefix) + os.sep
for path in {getattr(m, "__file__", None) for m in list(sys.modules.values())}:
    if path and path.endswith(".py") and os.path.realpath(path).startswith(venv):
        py_compile.compile(path, quiet=2)
PYEOF
  echo "$key" > "$stamp"
}

# install_once NAME PIP-ARGS...: pip install unless .venv/.stamp-NAME records these arguments and the contents
# of the requirement files among them.
install_once() {
  local stamp=".venv/.stamp-$1" want
  shift
  want="$*"
  for arg in "$@"; do
    if [ -f "$arg" ]; then want="$want $(cksum < "$arg")"; fi
  done
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return
  fi
  # `|| return`: called on the left of `&&` (the background installs below), a function runs without `set -e`,
  # and a failed pip would otherwise still write the stamp.
  "${PIP[@]}" "$@" || return
  echo "$want" > "$stamp"
}

# torch's version from its metadata (importing torch takes seconds).
if ! "$VPY" - <<'PYEOF'
import sys
from importlib import metadata
try:
    version = metadata.version("torch")
except metadata.PackageNotFoundError:
    sys.exit(1)
major, minor = (int(x) for x in version.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
  # Without a GPU, and unless RL_LOSSES_CUDA=1 asks for the CUDA kernels, torch's CPU build is all the extension
  # and the example use, and it installs in seconds where a CPU wheel is found (no CUDA libraries to fetch).
  if [ "${RL_LOSSES_CUDA:-}" != 1 ] && ! ls /dev/nvidia[0-9]* > /dev/null 2>&1 \
    && "${PIP[@]}" "torch==2.13.0+cpu" 2> /dev/null; then
    :
  else
    "${PIP[@]}" "torch==2.14.1"
  fi
fi
torch_version=$("$VPY" -c 'from importlib import metadata; print(metadata.version("torch"))')
install_once build -r scripts/requirements-build.txt
byte_compile torch "$torch_version $(cat .venv/.stamp-build)" torch &
torch_bytecode=$!
# The example's packages (and with --test the test suite's) install beside the build, which keeps the other core
# busy: pip mostly waits on the network and the disk. Their log is printed if pip fails.
mkdir -p build
if [ "${1:-}" = "--test" ]; then
  { install_once train -r scripts/requirements-train.txt && install_once test -r scripts/requirements-test.txt; } \
    > build/pip.log 2>&1 &
else
  { install_once train -r scripts/requirements-train.txt \
      && MPLBACKEND=Agg byte_compile train "$(cat .venv/.stamp-train)" matplotlib.pyplot tqdm; } > build/pip.log 2>&1 &
fi
packages_pip=$!

# torch finds CUDA through CUDA_HOME or nvcc on PATH; a wrapper nvcc in /usr/local/bin would make it guess
# /usr/local, so point it at the toolkit itself when one is installed there.
if [ -z "${CUDA_HOME:-}" ] && [ -e /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The build is skipped when nothing it depends on changed since the last one: no file under csrc/ and not
# setup.py, nor the variables that choose it, nor the number of GPUs (setup.py builds CUDA where one is visible).
stamp=build/.stamp-built
key="RL_LOSSES_CUDA=${RL_LOSSES_CUDA:-} RL_LOSSES_CPU_WIDTHS=${RL_LOSSES_CPU_WIDTHS:-} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} CUDA_HOME=${CUDA_HOME:-} \
gpus=$(ls /dev/nvidia[0-9]* 2>/dev/null | wc -l || true) torch=$torch_version"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -z "$(find csrc setup.py -newer "$stamp" -print -quit)" ] \
  && ls python/rl_losses/_C*.so > /dev/null 2>&1; then
  echo "setup.sh: the extension is up to date (build/.stamp-built)"
else
  if ! "$VPY" setup.py build_ext --inplace > build/setup.log 2>&1; then
    tail -n 40 build/setup.log
    echo "setup.sh: building the extension failed; the whole log is build/setup.log" >&2
    wait "$packages_pip" || true
    exit 1
  fi
  grep "rl_losses: building" build/setup.log || true
  echo "$key" > "$stamp"
fi
if ! wait "$packages_pip"; then
  cat build/pip.log
  echo "setup.sh: installing scripts/requirements-train.txt or requirements-test.txt failed" >&2
  exit 1
fi
"$VPY" - <<'PYEOF'
import os, site
with open(os.path.join(site.getsitepackages()[0], "rl_losses.pth"), "w") as f:
    f.write(os.path.abspath("python") + "\n")
PYEOF
wait "$torch_bytecode"
"$VPY" -c "import rl_losses; print('rl_losses imported; CUDA kernels built:', rl_losses.cuda_kernels_available())"
