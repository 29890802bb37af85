#!/usr/bin/env bash
# Everything this project measures on an H200 machine with 1, 2, 4 or 8 GPUs, for
# bench/device_session.sh (which sets RESULTS, the caches and the NCCL switches):
#   A. the single-GPU benchmark suite (bench/gpu_suite.py: 9B shape, packscore against both
#      Hugging Face forms, profile, restart) and, on another GPU when there is one, the bf16
#      parity probe and the single-GPU tests of tests/gpu;
#   B. with 2 GPUs or more: the NCCL tests (beside A on GPUs 2-3 when there are 4), then
#      bench/multi_gpu.py over all GPUs (HTTP end to end, SP scaling, FSDP against replicas).
# About 25 minutes on 2 GPUs, 19 on 4 (2026-11-29).
set -u
cd "$(dirname "$0")/.."
source bench/plan_common.sh
mkdir -p "$RESULTS/suite" "$RESULTS/tests" "$RESULTS/multi"

suite() {
  export CUDA_VISIBLE_DEVICES=0
  step "suite (GPU 0)" bash -c "python3 -m bench.gpu_suite --mode full --out '$RESULTS/suite' --budget-s ${SUITE_BUDGET_S:-720} > '$RESULTS/suite/log.txt' 2>&1"
}
tests() {  # $1: the GPU to use
  export CUDA_VISIBLE_DEVICES=$1
  gpu_tests "$1" single tests/gpu --ignore tests/gpu/test_parallel_nccl.py
  step "parity probe (GPU $1)" bash -c "python3 -m bench.parity_probe --out '$RESULTS/tests' > '$RESULTS/tests/parity_probe.txt' 2>&1"
}

nccl() {  # $1: the two GPUs to use, e.g. 2,3
  gpu_tests "$1" nccl tests/gpu/test_parallel_nccl.py
}
multi() {  # all GPUs: HTTP end to end, SP scaling, FSDP against replicas
  unset CUDA_VISIBLE_DEVICES
  step "multi-GPU http ($GPUS GPUs)" python3 -m bench.multi_gpu --gpus "$GPUS" --phases http --out "$RESULTS/multi/http"
  step "multi-GPU sp ($GPUS GPUs)" python3 -m bench.multi_gpu --gpus "$GPUS" --phases sp --out "$RESULTS/multi/sp"
  # FSDP against replicas on the first 64 sequences (four model starts).
  step "multi-GPU fsdp ($GPUS GPUs)" python3 -m bench.multi_gpu --gpus "$GPUS" --phases fsdp --sequences "${FSDP_SEQUENCES:-64}" --out "$RESULTS/multi/fsdp"
}

if [ "$GPUS" -ge 4 ]; then
  # A: the suite, the single-GPU tests and the NCCL tests side by side on GPUs 0, 1 and 2-3.
  (suite) & s=$!
  (tests 1) & t=$!
  (nccl 2,3) & n=$!
  wait $t; wait $n; wait $s
  multi
elif [ "$GPUS" -ge 2 ]; then
  (suite) & s=$!
  (tests 1) & t=$!
  wait $t; wait $s
  (nccl 0,1)
  multi
else
  (suite)
  (tests 0)
fi
