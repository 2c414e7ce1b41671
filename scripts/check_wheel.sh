#!/usr/bin/env bash
# Installs a wheel (scripts/build_wheel.sh) into a fresh virtual environment with no compiler on PATH and runs
# the test suite against it: the CPU tests, and the CUDA tests too where a GPU is visible. Prints the time of
# `import rl_losses` and of the first call of an op after the install (CPU, and CUDA where present).
#
#   scripts/check_wheel.sh [WHEEL] [PYTEST ARGS...]    WHEEL: default the newest dist/*/rl_losses-*.whl
#
# torch comes from the package registry at the version the wheel requires, the test peers from
# scripts/requirements-test.txt. On a machine without a registry, RL_LOSSES_OFFLINE=1: the venv sees the
# system's packages (torch, pytest and the test peers, there or on PYTHONPATH) and pip installs the wheel alone,
# then checks that the torch it finds is the one the wheel requires. The tests run from this checkout's tests/
# against the installed package.
# torch.compile's inductor tests are left out: inductor itself compiles C++ (CPU) or Triton launchers
# (CUDA) with the host compiler, which this run removes on purpose; so is the test that runs Liger-Kernel's
# Triton kernel as its peer (Triton compiles a C launcher for each new kernel).
set -euo pipefail
cd "$(dirname "$0")/.."

wheel=${1:-$(ls -t dist/*/rl_losses-*.whl 2>/dev/null | head -n 1)}
[ -f "$wheel" ] || { echo "check_wheel.sh: no wheel given and none in dist/; run scripts/build_wheel.sh" >&2; exit 2; }
shift || true
PY=${PYTHON:-python3}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "check_wheel.sh: $wheel in a fresh venv ($root/venv)"
VPY=$root/venv/bin/python
start=$(date +%s)
if [ "${RL_LOSSES_OFFLINE:-}" = 1 ]; then
  "$PY" -m venv "$root/venv"
  # $PY's own package folders (it may itself be a venv, whose packages --system-site-packages would not see).
  "$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$("$root/venv/bin/python" -c "import site; print(site.getsitepackages()[0])")/outer.pth"
  "$VPY" -m pip install -q --no-index --no-deps "$wheel"
  "$VPY" -m pip check 2>&1 | grep -i "^rl.losses" || echo "check_wheel.sh: pip check finds the wheel's requirements met"
else
  "$PY" -m venv "$root/venv"
  "$VPY" -m pip install -q "$wheel" -r scripts/requirements-test.txt
fi
echo "check_wheel.sh: installed in $(($(date +%s) - start)) s"

# PATH without compilers: every program of the usual folders but the C/C++/CUDA compilers.
nocc=$root/bin
mkdir -p "$nocc"
for dir in /usr/local/sbin /usr/local/bin /usr/sbin /usr/bin /sbin /bin; do
  [ -d "$dir" ] || continue
  for prog in "$dir"/*; do
    name=$(basename "$prog")
    case "$name" in
      cc | c++ | cpp | gcc* | g++* | *-gcc* | *-g++* | clang* | nvcc | icx | icpx) continue ;;
    esac
    [ -e "$nocc/$name" ] || ln -s "$prog" "$nocc/$name"
  done
done
export PATH="$root/venv/bin:$nocc"
unset CC CXX CUDA_HOME CUDA_PATH
for compiler in cc c++ gcc g++ nvcc; do
  if command -v "$compiler" > /dev/null; then
    echo "check_wheel.sh: $compiler is still on PATH" >&2
    exit 1
  fi
done

# From outside the checkout, so that `import rl_losses` can only find the installed wheel.
(cd "$root" && "$VPY" - <<'PYEOF'
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import rl_losses
t2 = time.perf_counter()
assert "site-packages" in rl_losses.__file__, rl_losses.__file__
print(f"check_wheel.sh: rl_losses from {rl_losses.__file__}; torch {torch.__version__}; "
      f"CUDA kernels: {rl_losses.cuda_kernels_available()}")
print(f"check_wheel.sh: import torch {t1 - t0:.2f} s, import rl_losses {t2 - t1:.2f} s")
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and rl_losses.cuda_kernels_available() else [])
for device in devices:
    logits = torch.randn(4096, 32000, device=device, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32000, (4096,), device=device)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        rl_losses.cross_entropy(logits, target).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    print(f"check_wheel.sh: cross_entropy fwd+bwd at N=4096, V=32000 bf16 on {device}: first call "
          f"{times[0] * 1e3:.1f} ms, then {min(times[1:]) * 1e3:.1f} ms")
PYEOF
)
# PYTEST ARGS may name test files; without any, pytest runs tests/ (pyproject.toml's testpaths).
"$VPY" -m pytest -q -p no:cacheprovider -k "not inductor and not liger_triton" "$@"
