#!/usr/bin/env bash
# bench/device_session.sh plan (about 3 minutes on 4 GPUs): one 9B replica per GPU in process over
# the whole workload, attention pinned to SDPA per segment, then to the varlen kernel, then to
# SDPA again (run-to-run spread). Both are pinned: the pool's own default is the varlen kernel.
set -u
cd "$(dirname "$0")/.."
source bench/plan_common.sh
mkdir -p "$RESULTS/ab"
i=0
for kernels in attention=sdpa attention=varlen attention=sdpa; do
  i=$((i + 1))
  step "pool $kernels" python3 -m bench.multi_gpu --gpus "$GPUS" --phases pool --kernels "$kernels" --out "$RESULTS/ab/$i-$kernels"
done
