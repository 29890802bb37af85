#!/usr/bin/env bash
# bench/device_session.sh plan (about 3 minutes on 4 GPUs): one 9B replica per GPU in process over
# the whole workload, attention SDPA per segment (default), then the varlen kernel, then the
# default again (run-to-run spread).
set -u
cd "$(dirname "$0")/.."
GPUS=$(nvidia-smi -L | wc -l)
mkdir -p "$RESULTS/ab"
for kernels in "" attention=varlen ""; do
  t0=$SECONDS
  python3 -m bench.multi_gpu --gpus "$GPUS" --phases pool ${kernels:+--kernels $kernels} --out "$RESULTS/ab/${kernels:-default}-$t0"
  echo "pool ${kernels:-default}: exit $? after $((SECONDS - t0))s" | tee -a "$SESSION_DIR/steps.txt"
done
touch "$SESSION_DIR/done"
