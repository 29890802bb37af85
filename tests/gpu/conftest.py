"""Shared helpers of the GPU tests (every module skips itself without CUDA).

``gpu_record(name, **numbers)`` prints one line and, when ``PACKSCORE_GPU_REPORT`` names a
file, appends the numbers to it as a JSON line, so the benchmark suite can put what the tests
measured into its results. ``PACKSCORE_GPU_SMOKE=1`` shrinks the long-sequence test;
``skip_unavailable(family, backend)`` skips a backend that cannot run here, with the reason.
"""

import json
import os

import pytest


@pytest.fixture
def gpu_record(capsys):
    def record(name: str, **numbers):
        with capsys.disabled():
            print(f"\n[{name}] " + ", ".join(f"{k}={_fmt(v)}" for k, v in numbers.items()))
        path = os.environ.get("PACKSCORE_GPU_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"name": name, **numbers}) + "\n")

    return record


@pytest.fixture(scope="session")
def slice_9b_twin():
    """The first 4 layers of the Qwen3.5-9B shape (seeded random bf16 weights), packed, and its
    Hugging Face twin: built once for the isolation and parity tests, which swap kernels on it in
    place and put them back."""
    import torch

    from bench.hf_reference import build_twin

    twin = build_twin("qwen3.5-9b", num_layers=4)
    yield twin
    del twin
    torch.cuda.empty_cache()


def _fmt(value):
    return f"{value:.3e}" if isinstance(value, float) else str(value)


def smoke() -> bool:
    return os.environ.get("PACKSCORE_GPU_SMOKE") == "1"


def skip_unavailable(family: str, backend: str) -> None:
    """Skips with the registry's reason where ``backend`` cannot run here (``expert_tiles`` without
    its library, which is built ahead of time: docs/gpu.md)."""
    from model_runtime.kernels.registry import _unavailable_reason

    reason = _unavailable_reason(family, backend)
    if reason is not None:
        pytest.skip(f"{backend} unavailable: {reason}")
