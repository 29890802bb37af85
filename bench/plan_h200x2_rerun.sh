#!/usr/bin/env bash
# The follow-up to bench/plan_h200x2.sh (about 5 minutes): the bf16 parity, isolation and conv
# kernel tests after the conv change, then the HTTP run on both GPUs.
set -u
cd "$(dirname "$0")/.."
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "[$(date +%T)] == $name"
  "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0))s" | tee -a "$SESSION_DIR/steps.txt"
}
mkdir -p "$RESULTS/tests" "$RESULTS/multi"
step "parity, isolation and conv tests" bash -c "CUDA_VISIBLE_DEVICES=0 PACKSCORE_GPU_REPORT='$RESULTS/tests/gpu_report.jsonl' python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_parity_bf16.py tests/gpu/test_isolation.py tests/gpu/test_kernels.py -k 'parity or isolation or conv' > '$RESULTS/tests/pytest.txt' 2>&1"
step "HTTP on 2 GPUs" python3 -m bench.multi_gpu --gpus 2 --phases http --out "$RESULTS/multi/http"
touch "$SESSION_DIR/done"
