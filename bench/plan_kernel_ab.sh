#!/usr/bin/env bash
# A kernel change, checked and timed on 2 GPUs for bench/device_session.sh (about 15 minutes):
#   GPU 0: the bf16 parity, isolation and kernel tests (tests/gpu), then HTTP against in-process
#          on one GPU (bench/http_bench.py, the 9B shape, SDPA per segment in the server);
#   GPU 1: the 9B benchmark with its kernel swaps (bench/gpu_suite.py --mode ab), then the
#          runner probe (bench/runner_probe.py: Scorer against the pool's runner, both autograd modes);
#   then, on both GPUs: HTTP end to end against the same pool in process (bench/multi_gpu.py).
# HTTP=0 leaves out both HTTP steps and PROBE=0 the runner probe (about 11 minutes without them);
# SUITE_S caps the suite's seconds (default 540; it skips the swaps that would not fit).
# GPU 0 first runs bench/aten_order_probe.py (ATen's float32 sums and the Triton plans' misses, seconds).
set -u
HTTP=${HTTP:-1} PROBE=${PROBE:-1}
cd "$(dirname "$0")/.."
source bench/plan_common.sh
mkdir -p "$RESULTS/suite" "$RESULTS/tests" "$RESULTS/multi" "$RESULTS/probe"

lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  step "ATen summation-order data (GPU 0)" bash -c "python3 -m bench.aten_order_probe --out '$RESULTS/probe' > '$RESULTS/probe/aten_order.txt' 2>&1"
  gpu_tests 0 ab tests/gpu/test_parity_bf16.py tests/gpu/test_isolation.py tests/gpu/test_kernels.py
  [ "$HTTP" = 1 ] && step "HTTP on one GPU (GPU 0)" bash -c "python3 bench/http_bench.py --model qwen3.5-9b --max-batch-tokens 65536 --sequences 256 --prompt-median 600 --response-median 1500 --per-request 16 --concurrency 8 --repeats 2 > '$RESULTS/probe/http_one_gpu.txt' 2>&1"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=$(( GPUS > 1 ? 1 : 0 ))
  step "suite ab (GPU $CUDA_VISIBLE_DEVICES)" bash -c "python3 -m bench.gpu_suite --mode ab --out '$RESULTS/suite' --budget-s ${SUITE_S:-540} > '$RESULTS/suite/log.txt' 2>&1"
  [ "$PROBE" = 1 ] && step "runner probe (GPU $CUDA_VISIBLE_DEVICES)" bash -c "python3 -m bench.runner_probe --sequences 64 --out '$RESULTS/probe' > '$RESULTS/probe/runner_probe.txt' 2>&1"
}

if [ "$GPUS" -ge 2 ]; then
  two_lanes
  unset CUDA_VISIBLE_DEVICES
  [ "$HTTP" = 1 ] && step "multi-GPU http ($GPUS GPUs)" python3 -m bench.multi_gpu --gpus "$GPUS" --phases http --out "$RESULTS/multi/http"
else
  (lane_b)
  (lane_a)
fi
