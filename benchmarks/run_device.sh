#!/usr/bin/env bash
# The one command for the GPU machine (H100/H200, torch 2.11 + CUDA 13, no network), from the repo root:
#
#     bash benchmarks/run_device.sh          # device tool: carry [".whl"] (Liger-Kernel's wheel)
#
# Stages, each timed, each allowed to fail without stopping the later ones (a failed build still lets the
# benchmark measure the peers; its rl_losses rows then carry the import error):
#   env    GPU, driver, python/torch/triton versions                     -> $OUT/run.log
#   build  MAX_JOBS=16 RL_LOSSES_CUDA=1 pip install -e . (editable, CUDA) -> $OUT/build.log
#   wheels the carried .whl/*.whl into /tmp/site (PYTHONPATH)             -> $OUT/run.log
#   tests  python3 -m pytest tests $PYTEST_ARGS on the GPU                -> $OUT/tests.log
#   bench  benchmarks/bench_gpu.py $BENCH_ARGS, with the time that is left -> $OUT/bench.log, $OUT/bench/
# At most 8 files come back: run.log, build.log, tests.log, bench.log, bench/{bench.json,bench.csv,bench.png,
# table.md}. The output ends with the stage summary and the benchmark's headline table.
#
# Knobs (environment): OUT (default /tmp/out), RUN_LIMIT_S (whole script, default 570: the device command
# limit is 600 s), TESTS_LIMIT_S (default 180), PYTEST_ARGS (default "-x -q"), BENCH_ARGS (default "--quick"),
# SKIP_BUILD=1 / SKIP_TESTS=1 / SKIP_BENCH=1.
set -u -o pipefail
cd "$(dirname "$0")/.."
RUN_LIMIT_DEFAULT=570
source benchmarks/stages.sh

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$LOG"
  python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
EOF
  nproc | sed 's/^/cores: /' | tee -a "$LOG"
}

build() {
  [ "${SKIP_BUILD:-0}" = 1 ] && { log "skipped (SKIP_BUILD=1)"; return 0; }
  local limit=$(( $(left) - 240 ))
  [ "$limit" -lt 120 ] && limit=120
  MAX_JOBS=16 RL_LOSSES_CUDA=1 timeout -k 10 "$limit" \
    python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
  local rc=$?
  grep -m1 "rl_losses: building" "$OUT/build.log" | tee -a "$LOG"
  grep -iE "warning.*spill|bytes stack frame|error" "$OUT/build.log" | head -20 | tee -a "$LOG"
  tail -3 "$OUT/build.log" | tee -a "$LOG"
  python3 -c "import rl_losses; print('rl_losses imports; CUDA kernels:', rl_losses.cuda_kernels_available())" \
    2>&1 | tail -3 | tee -a "$LOG"
  return $rc
}

wheels() {
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    log "no .whl/*.whl here: carry .whl with the call to benchmark Liger-Kernel"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
  local rc=$?
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import importlib.metadata as m, liger_kernel.transformers.grpo_loss as g; \
print('liger-kernel', m.version('liger-kernel'), g.triton_grpo_loss.__module__)" 2>&1 | tail -3 | tee -a "$LOG"
  return $rc
}

tests() {
  [ "${SKIP_TESTS:-0}" = 1 ] && { log "skipped (SKIP_TESTS=1)"; return 0; }
  local limit=${TESTS_LIMIT_S:-180}
  # Leave the benchmark at least 4 minutes.
  [ $(( $(left) - 240 )) -lt "$limit" ] && limit=$(( $(left) - 240 ))
  [ "$limit" -lt 30 ] && { log "no time left for the tests"; return 1; }
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" python3 -m pytest tests ${PYTEST_ARGS:--x -q} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" \
    | tail -25
  local rc=$?
  [ "$rc" = 124 ] && log "tests stopped by the ${limit}s limit"
  return $rc
}

bench() {
  [ "${SKIP_BENCH:-0}" = 1 ] && { log "skipped (SKIP_BENCH=1)"; return 0; }
  local budget=$(( $(left) - 20 ))
  [ "$budget" -lt 30 ] && { log "no time left for the benchmark"; return 1; }
  # The script skips jobs past --time-budget and rewrites its JSON/CSV after each job, so a hard stop
  # (timeout) still leaves every finished number.
  # shellcheck disable=SC2086
  timeout -k 5 "$((budget + 15))" python3 benchmarks/bench_gpu.py ${BENCH_ARGS:---quick} --out "$OUT/bench" \
    --time-budget "$budget" >"$OUT/bench.log" 2>&1
}

stage env env_info
stage build build
stage wheels wheels
stage tests tests
stage bench bench

summary
log ""
# The headline table is the end of the benchmark's output: show it last.
if grep -q "^wrote " "$OUT/bench.log" 2>/dev/null; then
  sed -n '/^wrote /,$p' "$OUT/bench.log"
elif [ -s "$OUT/bench.log" ]; then
  tail -n 30 "$OUT/bench.log"
fi
