"""The MLP's SiLU product kernel (model_runtime/kernels/pointwise_triton.py) in Triton's CPU
interpreter: every tile gives the same numbers, a last partial block is masked, and the result is
eager PyTorch's within one bf16 step (the interpreter's exp is NumPy's and its float32 -> bf16
cast truncates where a GPU rounds; bit-for-bit equality is tests/gpu/test_kernels.py's job).

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_pointwise_triton_interpret.py
"""

import pytest
import torch

from tests.interpret import bf16_steps, only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()


def test_silu_mul_is_eagers_within_a_step_and_tile_free():
    from model_runtime.kernels import pointwise_triton as PT

    g = torch.Generator().manual_seed(4)
    gate = (torch.randn(3, 1037, generator=g) * 4).to(torch.bfloat16)  # 3111 values: a partial last block
    up = torch.randn(3, 1037, generator=g).to(torch.bfloat16)
    want = torch.nn.functional.silu(gate) * up
    first = PT.silu_mul(gate, up)
    steps = bf16_steps(first, want)
    assert first.shape == gate.shape and steps <= 2.0, f"off eager by {steps:.2f} bf16 steps (tolerance 2)"
    for tile in PT.tile_candidates():
        differ = int((PT.silu_mul(gate, up, tile=tile) != first).sum())
        assert differ == 0, f"tile {tile}: {differ} values differ from the default tile's"


def test_silu_mul_refuses_what_it_does_not_take():
    from model_runtime.kernels import pointwise_triton as PT

    a = torch.randn(4, 8).to(torch.bfloat16)
    assert PT.supports(a, a.clone())
    assert not PT.supports(a.t(), a.t().contiguous())  # strided
    assert not PT.supports(a, a.float())  # dtypes differ
    with pytest.raises(ValueError, match="contiguous gate and up"):
        PT.silu_mul(a[:, :4], a[:, 4:])
