#!/usr/bin/env bash
# Everything this project measures on a 2 x H200 machine, for bench/device_session.sh (which
# sets RESULTS, the caches and the NCCL switches). About 25 minutes:
#   A. in parallel: GPU 0 runs the single-GPU benchmark suite (bench/gpu_suite.py, 9B shape,
#      packscore against both Hugging Face forms); GPU 1 runs the bf16 parity probe, then the
#      single-GPU tests of tests/gpu.
#   B. the NCCL tests (two GPUs).
#   C. the multi-GPU runs (bench/multi_gpu.py): SP scaling, FSDP against replicas, HTTP.
set -u
cd "$(dirname "$0")/.."
step() {  # step NAME COMMAND...: runs, logs the time and the exit status
  local name=$1; shift
  local t0=$SECONDS
  echo "[$(date +%T)] == $name"
  "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0))s" | tee -a "$SESSION_DIR/steps.txt"
}
mkdir -p "$RESULTS/suite" "$RESULTS/tests" "$RESULTS/multi"

(
  export CUDA_VISIBLE_DEVICES=0
  step "A0 gpu suite (GPU 0)" bash -c "python3 -m bench.gpu_suite --mode full --out '$RESULTS/suite' --budget-s ${SUITE_BUDGET_S:-720} > '$RESULTS/suite/log.txt' 2>&1"
) &
suite=$!
(
  export CUDA_VISIBLE_DEVICES=1
  step "A1 parity probe (GPU 1)" bash -c "python3 -m bench.parity_probe --out '$RESULTS/tests' > '$RESULTS/tests/parity_probe.txt' 2>&1"
  step "A2 single-GPU tests (GPU 1)" bash -c "PACKSCORE_GPU_REPORT='$RESULTS/tests/gpu_report.jsonl' python3 -m pytest -q -rA -p no:cacheprovider tests/gpu --ignore tests/gpu/test_parallel_nccl.py > '$RESULTS/tests/pytest.txt' 2>&1"
) &
tests=$!
wait $tests
wait $suite

step "B NCCL tests (2 GPUs)" bash -c "PACKSCORE_GPU_REPORT='$RESULTS/tests/gpu_report.jsonl' python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_parallel_nccl.py > '$RESULTS/tests/pytest_nccl.txt' 2>&1"
step "C1 SP scaling" python3 -m bench.multi_gpu --gpus 2 --phases sp --out "$RESULTS/multi/sp"
step "C2 FSDP vs replicas" python3 -m bench.multi_gpu --gpus 2 --phases fsdp --sequences "${FSDP_SEQUENCES:-64}" --out "$RESULTS/multi/fsdp"
step "C3 HTTP on 2 GPUs" python3 -m bench.multi_gpu --gpus 2 --phases http --out "$RESULTS/multi/http"
touch "$SESSION_DIR/done"
