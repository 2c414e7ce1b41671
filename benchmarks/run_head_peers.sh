#!/usr/bin/env bash
# The fused lm_head against its peers, and inside TRL: one command for the GPU machine (one H100/H200, torch 2.11 +
# CUDA 13, no network), from the repo root, with OUT set and the wheels carried:
#
#     bash benchmarks/run_head_peers.sh          # device tool: carry [".whl"]
#
# Stages, each timed, each allowed to fail without stopping the later ones:
#   wheels  .whl/*.whl into $SITE (default /tmp/site, put first on PYTHONPATH): trl 1.16.0, transformers 5.10.4, tokenizers 0.22.2
#           (transformers 5.10.4 refuses the machine's 0.23), datasets 5.2.0, dill, multiprocess, liger-kernel 0.8.5,
#           cut-cross-entropy 25.1.1, verl 0.9.1 (its files only: bench_head_peers loads them by path)
#   build   MAX_JOBS=16 RL_LOSSES_CUDA=1 python3 setup.py build_ext --inplace (~2.5 min)  -> $OUT/build.log
#   peers   benchmarks/bench_head_peers.py $HEAD_ARGS, leaving TRL_RESERVE_S for the next stage
#                                                           -> $OUT/head_peers.{log,json,md}
#   trl     benchmarks/bench_trl_step.py $TRL_ARGS with the time left  -> $OUT/trl_step.log, $OUT/trl/bench_trl_step.*
# The whole script stays within RUN_LIMIT_S (default 560 s; the device command limit is 600 s); each benchmark
# rewrites its JSON as it goes, so a stage stopped by its limit still leaves every finished number.
#
# Knobs (environment): OUT (default /tmp/out), SITE, RUN_LIMIT_S, TRL_RESERVE_S (default 230), HEAD_ARGS (default
# "--quick --reps 5": 2 of the 4 shapes fit beside the build and the TRL table), TRL_ARGS (default none: the 4
# configurations), SKIP_BUILD=1 (a warm machine that built it already), SKIP_PEERS=1, SKIP_TRL=1. The other two
# shapes, on the same warm machine:
#     SKIP_BUILD=1 SKIP_TRL=1 HEAD_ARGS="--shapes 16384x2048x128256,16384x4096x262144" bash benchmarks/run_head_peers.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
RUN_LIMIT_DEFAULT=560
source benchmarks/stages.sh

wheels() {
  ls .whl/*.whl >/dev/null 2>&1 || { log "no .whl/*.whl: carry .whl with the call"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
  python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for d in ("trl", "transformers", "tokenizers", "datasets", "liger-kernel", "cut-cross-entropy", "verl", "triton"):
    try:
        print(f"  {d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"  {d} missing")
import trl.trainer.grpo_trainer, liger_kernel.chunked_loss, cut_cross_entropy  # noqa: E401  (they import)
EOF
}

build() {
  [ "${SKIP_BUILD:-0}" = 1 ] && { log "skipped (SKIP_BUILD=1)"; return 0; }
  MAX_JOBS=16 RL_LOSSES_CUDA=1 timeout -k 10 $(( $(left) - 200 )) python3 setup.py build_ext --inplace \
    >"$OUT/build.log" 2>&1
  local rc=$?
  tail -3 "$OUT/build.log" | tee -a "$LOG"
  return $rc
}

check_import() {
  python3 -c "import rl_losses; print('rl_losses', rl_losses.__file__, '| CUDA kernels:', \
rl_losses.cuda_kernels_available())" 2>&1 | tail -3 | tee -a "$LOG"
}

peers() {
  [ "${SKIP_PEERS:-0}" = 1 ] && { log "skipped (SKIP_PEERS=1)"; return 0; }
  local budget=$(( $(left) - ${TRL_RESERVE_S:-230} ))
  [ "${SKIP_TRL:-0}" = 1 ] && budget=$(( $(left) - 10 ))
  [ "$budget" -lt 30 ] && { log "no time left for bench_head_peers"; return 1; }
  # shellcheck disable=SC2086
  timeout -k 5 "$((budget + 10))" python3 -u benchmarks/bench_head_peers.py ${HEAD_ARGS:---quick --reps 5} --out "$OUT" \
    --time-budget "$budget" >"$OUT/head_peers.log" 2>&1
}

trl_step() {
  [ "${SKIP_TRL:-0}" = 1 ] && { log "skipped (SKIP_TRL=1)"; return 0; }
  local budget=$(( $(left) - 75 ))  # a configuration's three arms take up to about a minute
  [ "$budget" -lt 10 ] && { log "no time left for bench_trl_step"; return 1; }
  # shellcheck disable=SC2086
  timeout -k 5 "$(( $(left) - 5 ))" python3 -u benchmarks/bench_trl_step.py ${TRL_ARGS:-} --out "$OUT/trl" \
    --time-budget "$budget" >"$OUT/trl_step.log" 2>&1
}

SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
stage wheels wheels
stage build build
stage import check_import
stage peers peers
stage trl trl_step

summary
for f in "$OUT/head_peers.log" "$OUT/trl_step.log"; do
  [ -s "$f" ] || continue
  log ""
  log "=== $(basename "$f") (last lines)"
  grep -v -i "warn" "$f" | tail -n 40
done
