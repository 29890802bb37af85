# Sourced by the GPU plans (bench/plan_*.sh) that bench/device_session.sh runs, from the
# repository root: sets GPUS (how many this machine has) and the helpers below.
GPUS=$(nvidia-smi -L | wc -l)
echo "[$(date +%T)] $GPUS GPU(s)"
step() {  # step NAME COMMAND...: runs, logs the time and the exit status to steps.txt
  local name=$1; shift
  local t0=$SECONDS
  echo "[$(date +%T)] == $name"
  "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0))s" | tee -a "$SESSION_DIR/steps.txt"
}
gpu_tests() {  # gpu_tests GPUS NAME PYTEST_ARGS...: pytest on GPUS (e.g. 1 or 2,3), its report and
  # output in $RESULTS/tests/report-NAME.jsonl and pytest-NAME.txt
  local gpus=$1 name=$2; shift 2
  mkdir -p "$RESULTS/tests"
  CUDA_VISIBLE_DEVICES=$gpus step "tests $name (GPUs $gpus)" bash -c "PACKSCORE_GPU_REPORT='$RESULTS/tests/report-$name.jsonl' python3 -m pytest -q -rA -p no:cacheprovider $* > '$RESULTS/tests/pytest-$name.txt' 2>&1"
}
two_lanes() {  # two_lanes: runs the plan's lane_a and lane_b at once (each picks its GPU), waits for both
  (lane_a) & local a=$!
  (lane_b) & local b=$!
  wait $a; wait $b
}
