# The GPU machine scripts' shared frame (run_device.sh, run_head_peers.sh source it from the repo root): OUT
# (default /tmp/out) and its run.log, a deadline RUN_LIMIT_S seconds from now (default: the caller's
# RUN_LIMIT_DEFAULT), left (seconds to it), log (echo into run.log), stage NAME CMD... (run, time, record in
# SUMMARY; a failing stage never stops the script) and summary (the stages' table).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=$((T0 + ${RUN_LIMIT_S:-$RUN_LIMIT_DEFAULT}))
SUMMARY=()
LOG="$OUT/run.log"
: >"$LOG"
left() { echo $((DEADLINE - $(date +%s))); }
log() { echo "$@" | tee -a "$LOG"; }

stage() {
  local name=$1 t rc
  shift
  t=$(date +%s)
  log "=== $name: start at +$((t - T0))s ($(left)s left)"
  "$@"
  rc=$?
  SUMMARY+=("$(printf '%-7s rc=%-3s %4ss' "$name" "$rc" "$(($(date +%s) - t))")")
  log "=== $name: rc=$rc in $(($(date +%s) - t))s"
}

summary() {
  log ""
  log "=== stages (total $(($(date +%s) - T0))s):"
  for s in "${SUMMARY[@]}"; do log "  $s"; done
}
