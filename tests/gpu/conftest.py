"""Shared helpers of the GPU tests (every module skips itself without CUDA).

``gpu_record(name, **numbers)`` prints one line and, when ``PACKSCORE_GPU_REPORT`` names a
file, appends the numbers to it as a JSON line, so the benchmark suite can put what the tests
measured into its results. ``PACKSCORE_GPU_SMOKE=1`` shrinks the long-sequence test.
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


def _fmt(value):
    return f"{value:.3e}" if isinstance(value, float) else str(value)


def smoke() -> bool:
    return os.environ.get("PACKSCORE_GPU_SMOKE") == "1"
