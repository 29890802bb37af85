"""Shared by the tests that run Triton kernels in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
the last step of .ci/run): they skip everywhere else, since the interpreter must be chosen
before triton is imported."""

import os

import pytest

ACTIVE = os.environ.get("TRITON_INTERPRET") == "1"
only_when_interpreting = pytest.mark.skipif(not ACTIVE, reason="needs TRITON_INTERPRET=1 and triton")


def require_triton():
    """Triton under the interpreter (the test module is skipped without it), or None when inactive."""
    return pytest.importorskip("triton") if ACTIVE else None
