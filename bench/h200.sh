#!/usr/bin/env bash
# Everything measured on one H200, in one device call (at most TOTAL_S, default 530 s), from the
# repository root:
#     MODE=all bash bench/h200.sh       # parts and budgets: python -m bench.h200 --help
# Installs the carried wheels (.whl/, docs/benchmarks.md says how to fetch them), uses the carried
# expert-GEMM library (.psg/, docs/moe.md says how to build it), keeps compiled
# kernels in $TRITON_CACHE_DIR, turns NVLink multicast off, and writes at most 8 files to $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-bench/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/service/client${PYTHONPATH:+:$PYTHONPATH}  # packscore_client from the source tree
# the MoE experts' CUTLASS library, built here and carried (model_runtime/kernels/expert_gemm.py)
if [ -z "${PACKSCORE_EXPERT_GEMM:-}" ] && [ -f .psg/libpackscore_expert_gemm.so ]; then
  export PACKSCORE_EXPERT_GEMM=$PWD/.psg/libpackscore_expert_gemm.so
fi
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/packscore-kernel-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$TRITON_CACHE_DIR/inductor}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv
exec python3 -m bench.h200 "$@"
