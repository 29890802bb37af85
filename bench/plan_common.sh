# Sourced by the GPU plans (bench/plan_*.sh) that bench/device_session.sh runs.
step() {  # step NAME COMMAND...: runs, logs the time and the exit status to steps.txt
  local name=$1; shift
  local t0=$SECONDS
  echo "[$(date +%T)] == $name"
  "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0))s" | tee -a "$SESSION_DIR/steps.txt"
}
