#!/usr/bin/env bash
# A short follow-up plan for bench/device_session.sh (about 5 minutes on 4 GPUs): tests/gpu split
# over the GPUs by file, then HTTP end to end on all GPUs. For re-checking changes made after a
# full bench/plan_h200.sh run.
set -u
cd "$(dirname "$0")/.."
mkdir -p "$RESULTS/tests" "$RESULTS/multi"
source bench/plan_common.sh
files=(tests/gpu/test_parity_bf16.py tests/gpu/test_isolation.py "tests/gpu/test_kernels.py tests/gpu/test_backend_selection.py" tests/gpu/test_long_sequence.py)
names=(parity isolation kernels long)
pids=()
for i in 0 1 2 3; do
  gpu=$((i % GPUS))
  (gpu_tests "$gpu" "${names[$i]}" ${files[$i]}) & pids+=($!)
  [ "$GPUS" -lt 4 ] && wait $!
done
wait "${pids[@]}"
if [ "$GPUS" -ge 2 ]; then
  step "multi-GPU http ($GPUS GPUs)" python3 -m bench.multi_gpu --gpus "$GPUS" --phases http --out "$RESULTS/multi/http"
fi
