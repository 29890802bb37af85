"""Shared by the tests that run Triton kernels in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
the last step of .ci/run): they skip everywhere else, since the interpreter must be chosen
before triton is imported."""

import os

import pytest
import torch

ACTIVE = os.environ.get("TRITON_INTERPRET") == "1"
only_when_interpreting = pytest.mark.skipif(not ACTIVE, reason="needs TRITON_INTERPRET=1 and triton")


def require_triton():
    """Triton under the interpreter (the test module is skipped without it), or None when inactive."""
    return pytest.importorskip("triton") if ACTIVE else None


def bf16_steps(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-3) -> float:
    """Largest difference in units of the bf16 spacing at the larger magnitude (2^-7 relative at
    most); magnitudes below ``floor`` count as ``floor``."""
    return float(((a.float() - b.float()).abs() / b.float().abs().clamp_min(floor)).max() / 2**-7)
