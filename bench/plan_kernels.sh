#!/usr/bin/env bash
# The exact elementwise kernels' tiles and the GPU checks, for bench/device_session.sh (about 6 minutes on 2 GPUs):
#   GPU 0: every implementation and Triton tile of the memory-bound steps, checked against eager and
#          timed (bench/elementwise_probe.py); then the 9B forward's profile (gpu_suite --mode profile);
#   GPU 1: the GPU tests (kernels, bf16 parity without the tiny models' varlen variant, isolation);
#          then packscore alone against elementwise=inductor (gpu_suite --mode ab --no-hf).
set -u
cd "$(dirname "$0")/.."
source bench/plan_common.sh
mkdir -p "$RESULTS/probe" "$RESULTS/profile" "$RESULTS/ab"

lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  step "elementwise probe (GPU 0)" bash -c "python3 -m bench.elementwise_probe --out '$RESULTS/probe' > '$RESULTS/probe/log.txt' 2>&1"
  step "9B profile (GPU 0)" bash -c "python3 -m bench.gpu_suite --mode profile --out '$RESULTS/profile' --budget-s 300 > '$RESULTS/profile/log.txt' 2>&1"
}
lane_b() {
  local gpu=$(( GPUS > 1 ? 1 : 0 ))
  gpu_tests $gpu kernels tests/gpu/test_kernels.py tests/gpu/test_parity_bf16.py tests/gpu/test_isolation.py \
    -k "'not (bf16_packed_matches_hf_alone and varlen)'"
  CUDA_VISIBLE_DEVICES=$gpu step "packscore A/B, no HF (GPU $gpu)" bash -c "python3 -m bench.gpu_suite --mode ab --no-hf --swaps 'elementwise=inductor' --out '$RESULTS/ab' --budget-s 300 > '$RESULTS/ab/log.txt' 2>&1"
}

two_lanes
