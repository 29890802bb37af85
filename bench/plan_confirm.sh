#!/usr/bin/env bash
# The shipped defaults confirmed on 2 GPUs for bench/device_session.sh, in about 9 minutes:
#   GPU 0: ATen's float32 sums for bench/aten_order_probe.py; the GPU tests (kernels, bf16 parity
#          without the tiny models' varlen variant, isolation); then packscore alone against its
#          old elementwise default (bench/gpu_suite.py --mode ab --no-hf --swaps elementwise=inductor);
#   GPU 1: the 9B benchmark side by side with Hugging Face, defaults only (--mode ab --swaps '').
set -u
cd "$(dirname "$0")/.."
GPUS=$(nvidia-smi -L | wc -l)
source bench/plan_common.sh
mkdir -p "$RESULTS/suite" "$RESULTS/ab" "$RESULTS/probe"
echo "[$(date +%T)] $GPUS GPU(s)"

lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  step "ATen summation-order data (GPU 0)" bash -c "python3 -m bench.aten_order_probe --out '$RESULTS/probe' > '$RESULTS/probe/aten_order.txt' 2>&1"
  gpu_tests 0 confirm tests/gpu/test_kernels.py tests/gpu/test_parity_bf16.py tests/gpu/test_isolation.py \
    -k "'not (bf16_packed_matches_hf_alone and varlen)'"
  step "packscore A/B, no HF (GPU 0)" bash -c "python3 -m bench.gpu_suite --mode ab --no-hf --swaps 'elementwise=inductor' --out '$RESULTS/ab' --budget-s 400 > '$RESULTS/ab/log.txt' 2>&1"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=$(( GPUS > 1 ? 1 : 0 ))
  step "suite, defaults vs HF (GPU $CUDA_VISIBLE_DEVICES)" bash -c "python3 -m bench.gpu_suite --mode ab --swaps '' --out '$RESULTS/suite' --budget-s 560 > '$RESULTS/suite/log.txt' 2>&1"
}

(lane_a) & a=$!
(lane_b) & b=$!
wait $a; wait $b
