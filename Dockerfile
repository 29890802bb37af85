# syntax=docker/dockerfile:1.7
# packscore for NVIDIA H200 (Hopper, sm_90) nodes. Build with BuildKit:
#   docker build -t packscore:0.1.0 .
# Run and deploy: see deploy/README.md.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# ---------------------------------------------------------------------------
# build: compile causal-conv1d against the same torch the runtime stage installs, and
# packscore's expert-GEMM library.
# ---------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu${UBUNTU_VERSION} AS build

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG CAUSAL_CONV1D_VERSION=1.7.0
# Hopper (H200, H100). Another generation: --build-arg TORCH_CUDA_ARCH_LIST="9.0;10.0".
ARG TORCH_CUDA_ARCH_LIST=9.0
ARG MAX_JOBS=8

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    MAX_JOBS=${MAX_JOBS}

# The base image tag pins the distribution; Ubuntu drops superseded package versions
# from its archive, so pinning them here would only break later rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git ca-certificates \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
 && pip install torch==${TORCH_VERSION} --index-url ${TORCH_INDEX_URL} \
 && pip install setuptools==80.9.0 wheel==0.45.1 packaging==25.0 ninja==1.13.0

# causal-conv1d's setup.py hard-codes its GPU architectures (six with CUDA 12.8) and torch
# then ignores TORCH_CUDA_ARCH_LIST; cuda_arch.py trims that list to TORCH_CUDA_ARCH_LIST
# and afterwards checks that the wheel holds SASS for exactly those architectures.
COPY deploy/docker/cuda_arch.py /build/cuda_arch.py
WORKDIR /build
RUN pip download --no-deps --no-binary causal-conv1d --no-build-isolation \
        -d /build/sdist causal-conv1d==${CAUSAL_CONV1D_VERSION} \
 && tar -xzf /build/sdist/causal_conv1d-${CAUSAL_CONV1D_VERSION}.tar.gz -C /build \
 && python cuda_arch.py patch /build/causal_conv1d-${CAUSAL_CONV1D_VERSION}/setup.py \
 && pip wheel --no-deps --no-build-isolation -w /wheels /build/causal_conv1d-${CAUSAL_CONV1D_VERSION} \
 && python cuda_arch.py check /wheels/causal_conv1d-${CAUSAL_CONV1D_VERSION}-*.whl

# packscore's expert-GEMM library (the MoE experts' default kernel on Hopper,
# model_runtime/kernels/expert_gemm.py): two CUTLASS kernels (the product, and the gate/up product
# with its SiLU epilogue), headers only, sm_90a.
ARG CUTLASS_VERSION=v4.7.0
RUN --mount=type=bind,source=.,target=/src \
    git clone --quiet --depth 1 --branch ${CUTLASS_VERSION} https://github.com/NVIDIA/cutlass /build/cutlass \
 && PYTHONPATH=/src python -m model_runtime.kernels.expert_gemm --cutlass /build/cutlass \
        --out /wheels/libpackscore_expert_gemm.so

# ---------------------------------------------------------------------------
# runtime: CUDA runtime, a CUDA build of torch, packscore with the `gpu` extra.
# ---------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

LABEL org.opencontainers.image.title="packscore" \
      org.opencontainers.image.description="Per-token log-probability and entropy scoring service for RL trainers" \
      org.opencontainers.image.licenses="Apache-2.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Triton (used by flash-linear-attention) compiles a small C launcher at run time,
# so the runtime image needs a C compiler and Python's headers; tini is the container's init (ENTRYPOINT).
# Ubuntu 24.04 images ship a user "ubuntu" with uid 1000; packscore takes that uid.
# The caches are writable by any uid, as /tmp (sticky), for `docker run --user` and new volumes copied from them.
# The home is the WORKDIR and holds only /etc/skel's files: 0755, not useradd's 0750, so another uid can read its cwd.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv gcc libc6-dev tini \
 && rm -rf /var/lib/apt/lists/* \
 && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && groupadd --gid 1000 packscore \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/packscore --shell /usr/sbin/nologin packscore \
 && chmod 0755 /home/packscore \
 && mkdir -p /cache/triton /cache/xdg /models \
 && chown -R 1000:1000 /cache \
 && chmod 1777 /cache /cache/triton /cache/xdg

# Same install steps as the README: the CUDA build of torch first, then the project
# with the `gpu` extra (flash-linear-attention, causal-conv1d). The causal-conv1d wheel
# built above is installed first so that pip keeps it instead of building from source.
RUN python3 -m venv /opt/venv \
 && pip install torch==${TORCH_VERSION} --index-url ${TORCH_INDEX_URL}
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install /wheels/causal_conv1d-*.whl \
 && install -D -m 0755 /wheels/libpackscore_expert_gemm.so /opt/packscore/lib/libpackscore_expert_gemm.so
# The build context is bind-mounted (rw: setuptools writes build/ into it, the writes
# are discarded), so no source tree is left in a layer; .dockerignore keeps it small.
RUN --mount=type=bind,source=.,target=/src,rw \
    pip install "/src[gpu]" \
 && pip check \
 && command -v packscore

# Caches that must be writable. Mount a volume on /cache/triton to keep compiled
# Triton kernels across restarts (the first forward of each shape compiles them).
ENV HOME=/home/packscore \
    TRITON_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    PACKSCORE_TRITON_CACHE_DIR=/cache/triton \
    XDG_CACHE_HOME=/cache/xdg \
    HF_HUB_OFFLINE=1 \
    PACKSCORE_EXPERT_GEMM=/opt/packscore/lib/libpackscore_expert_gemm.so \
    PACKSCORE_HOST=0.0.0.0 \
    PACKSCORE_PORT=8000

USER 1000:1000
WORKDIR /home/packscore
EXPOSE 8000

# /healthz answers while the process serves HTTP at all, also while a checkpoint loads.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PACKSCORE_PORT', '8000'), timeout=4)"]

# tini as PID 1 reaps orphaned processes (a dead worker's children), which packscore never waits for, and
# forwards signals to packscore alone (no -g: SIGTERM must reach it, not its workers, so that it drains),
# returning its exit status unchanged; -s keeps reaping under another init (docker run --init).
# No arguments: the built-in `tiny` model. Real models: `--model /models/<checkpoint>`.
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "packscore", "serve"]
