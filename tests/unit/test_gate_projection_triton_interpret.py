"""The ``tiles`` gate-projection kernel (model_runtime/kernels/gate_projection_triton.py) in
Triton's CPU interpreter: close to ``F.linear`` (a masked last tile, widths of 1 to 256 outputs, a
bias), and a row's output the same in a product of any number of rows. In float32
only: the interpreter's ``tl.dot`` multiplies bf16 operands' raw bits (Triton 3.6), so the bf16
path, and the same properties on operands made to expose a change of summation order, are
checked on the H200 (tests/gpu/test_gate_projection_tiles.py).

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_gate_projection_triton_interpret.py
"""

import pytest
import torch
import torch.nn.functional as F

from tests.interpret import only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()


@pytest.mark.parametrize("k,n", [(96, 1), (200, 48), (128, 256)])
def test_tiles_equal_linear_within_rounding(k, n, dtype=torch.float32):
    from model_runtime.kernels.gate_projection_triton import narrow_tiles

    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(131, k, generator=g).to(dtype)  # 131 rows: a partial last tile of 64
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        got = narrow_tiles(x, w, bias)
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        err = float((got.double() - want).abs().max())
        tol = 1e-5  # float32 sums of at most 200 products of order one
        assert got.shape == (131, n) and got.dtype == dtype and err <= tol, (
            f"{k}x{n} {dtype} bias={bias is not None}: max |tiles - float64| {err:.3e}, tolerance {tol:.3e}")


def test_a_row_does_not_depend_on_the_row_count():
    from model_runtime.kernels.gate_projection_triton import narrow_tiles

    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 256, generator=g)
    w = torch.randn(32, 256, generator=g) / 16
    whole = narrow_tiles(x, w)
    wide = torch.cat([x, torch.randn(300, 7, generator=g)], dim=1)[:, :256]  # a view of wider rows
    assert torch.equal(narrow_tiles(wide, w), whole), "strided rows give other numbers"
    # Slices starting on a tile boundary: the interpreter's tl.dot is NumPy's BLAS, whose result for a
    # row may follow its place in the tile; the GPU test checks slices starting anywhere.
    for a, b in [(0, 1), (0, 63), (0, 65), (0, 299), (64, 128), (64, 300), (256, 257)]:
        part = narrow_tiles(x[a:b], w)
        assert torch.equal(part, whole[a:b]), f"rows {a}:{b} alone differ from the same rows of the whole product"


def test_empty_and_refused():
    from model_runtime.kernels.gate_projection_triton import narrow_tiles

    w = torch.randn(4, 16)
    assert narrow_tiles(torch.zeros(0, 16), w).shape == (0, 4)
    with pytest.raises(ValueError, match="narrow_tiles"):
        narrow_tiles(torch.zeros(3, 8), w)
    with pytest.raises(ValueError, match="narrow_tiles"):
        narrow_tiles(torch.zeros(3, 16, dtype=torch.bfloat16), w)  # one dtype for both
