#!/usr/bin/env bash
# The shipped defaults confirmed on 2 GPUs for bench/device_session.sh, in about 9 minutes:
#   GPU 0: the memory-bound steps and every Triton tile against eager (bench/elementwise_probe.py);
#          then the GPU tests (kernels, bf16 parity without the tiny models' varlen variant, isolation);
#   GPU 1: the 9B benchmark side by side with Hugging Face, the defaults and elementwise=inductor
#          (--mode ab --swaps "$SUITE_SWAPS"; SUITE_SWAPS='' times the defaults alone, a minute less).
set -u
cd "$(dirname "$0")/.."
source bench/plan_common.sh
mkdir -p "$RESULTS/suite" "$RESULTS/probe"

lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  step "elementwise probe (GPU 0)" bash -c "python3 -m bench.elementwise_probe --out '$RESULTS/probe' > '$RESULTS/probe/log.txt' 2>&1"
  gpu_tests 0 confirm tests/gpu/test_kernels.py tests/gpu/test_parity_bf16.py tests/gpu/test_isolation.py \
    -k "'not (bf16_packed_matches_hf_alone and varlen)'"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=$(( GPUS > 1 ? 1 : 0 ))
  step "suite, defaults vs HF (GPU $CUDA_VISIBLE_DEVICES)" bash -c "python3 -m bench.gpu_suite --mode ab --swaps '${SUITE_SWAPS-elementwise=inductor}' --out '$RESULTS/suite' --budget-s 570 > '$RESULTS/suite/log.txt' 2>&1"
}

two_lanes
