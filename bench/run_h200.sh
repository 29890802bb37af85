#!/usr/bin/env bash
# The H200 suite in one command, from the repository root:
#     bash bench/run_h200.sh [full|tests|smoke|extra]
# Installs carried wheels (.whl/, see the README), keeps compiled kernels in
# /tmp/packscore-kernel-cache (unpacked from .kcache/ when carried, packed into $OUT with
# PACK_KERNEL_CACHE=1) and writes the results JSON, chart, profile and log to $OUT.
set -o pipefail
MODE=${1:-full}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/service/client${PYTHONPATH:+:$PYTHONPATH}  # packscore_client from the source tree
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/packscore-kernel-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$TRITON_CACHE_DIR/inductor}
if ls .kcache/kcache.tgz.part-* >/dev/null 2>&1; then
  mkdir -p "$TRITON_CACHE_DIR" && cat .kcache/kcache.tgz.part-* | tar xzf - -C "$TRITON_CACHE_DIR" && echo "kernel cache unpacked: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,driver_version --format=csv
python3 -m bench.gpu_suite --mode "$MODE" --out "$OUT" --budget-s "${BUDGET_S:-540}" 2>&1 | tee "$OUT/log.txt"
status=$?
if [ "${PACK_KERNEL_CACHE:-0}" = 1 ]; then
  # At most three 15 MB parts come back with the other files (8 files per call).
  (cd "$TRITON_CACHE_DIR" && tar czf /tmp/kcache.tgz .)
  size=$(stat -c %s /tmp/kcache.tgz)
  if [ "$size" -le $((45 * 1024 * 1024)) ]; then
    split -b 15m /tmp/kcache.tgz "$OUT/kcache.tgz.part-" && echo "kernel cache packed: $size bytes"
  else
    echo "kernel cache too large to bring back: $size bytes"
  fi
fi
exit $status
