#!/usr/bin/env bash
# Runs a GPU plan longer than one device call allows (10 minutes), from the repository root:
#
#     bash bench/device_session.sh start bench/plan_h200.sh   # first call: starts, then follows
#     bash bench/device_session.sh follow                       # each later call: follows on
#
# `start` installs the carried wheels (.whl/, see the README), copies the working tree to
# $SESSION_DIR/repo (every device call sends the tree again, and files rewritten under a running
# job have broken a server's imports), then runs the plan from that copy in its own process
# session (setsid), so it outlives the call as long as the machine is held (the next call must
# come within the machine's idle release). Both verbs return after FOLLOW_S seconds
# (default 560) or when the plan is done, and pack everything the plan has written so far
# (logs, JSON, charts) into $OUT/session.tgz plus a copy of the log, so a call cut short still
# brings its results back. The plan's exit status per step is in steps.txt.
set -u
WORK=${SESSION_DIR:-/tmp/packscore-session}
OUT=$(realpath -m "${OUT:-bench/out}")
FOLLOW_S=${FOLLOW_S:-560}
verb=${1:-follow}

pack() {
  mkdir -p "$OUT"
  tar czf "$OUT/session.tgz" -C "$WORK" --exclude=./kernel-cache --exclude=./repo . 2>/dev/null
  cp "$WORK/session.log" "$OUT/session.log" 2>/dev/null
  tail -n 40 "$WORK/session.log" 2>/dev/null
  [ -f "$WORK/steps.txt" ] && cat "$WORK/steps.txt"
}

follow() {
  local started=$SECONDS
  while [ ! -f "$WORK/done" ] && [ $((SECONDS - started)) -lt "$FOLLOW_S" ]; do
    sleep 5
  done
  [ -f "$WORK/done" ] && echo "== plan finished" || echo "== plan still running after ${FOLLOW_S}s of this call"
  pack
}

case "$verb" in
  start)
    plan=${2:?usage: device_session.sh start PLAN}
    rm -rf "$WORK" && mkdir -p "$WORK/results"
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    fi
    tar cf - --exclude=./.git --exclude=./.whl . | (mkdir -p "$WORK/repo" && cd "$WORK/repo" && tar xf -)
    cd "$WORK/repo" || exit 1
    # service/client: packscore_client, which an install would map (the tree is not installed here)
    export PYTHONPATH=$PWD:$PWD/service/client:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1 SESSION_DIR=$WORK RESULTS=$WORK/results
    export TRITON_CACHE_DIR=$WORK/kernel-cache TORCHINDUCTOR_CACHE_DIR=$WORK/kernel-cache/inductor
    # NVLink multicast stays off (device README): NCCL, PyTorch symmetric memory, NVSHMEM.
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > "$WORK/results/gpus.csv"
    # The done marker is written here, after the plan however it ends, so `follow` never waits
    # out its time on a plan that already stopped.
    setsid nohup bash -c 'bash "$0"; touch "$1/done"' "$plan" "$WORK" > "$WORK/session.log" 2>&1 < /dev/null &
    follow
    ;;
  follow)
    follow
    ;;
  *)
    echo "usage: device_session.sh start PLAN | follow" >&2
    exit 2
    ;;
esac
