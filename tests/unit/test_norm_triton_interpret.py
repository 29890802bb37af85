"""The exact-order RMSNorm kernels (model_runtime/kernels/norm_triton.py) in Triton's CPU
interpreter: their running sums land in the lanes the module docstring describes (checked
against a NumPy model of ATen's order, bit for bit), and the rest of each norm follows Hugging
Face's arithmetic (within one bf16 step here: the interpreter's rsqrt and exp are NumPy's, not
CUDA's, and its float32 to bf16 conversion truncates where a GPU rounds to nearest). Whether that order is ATen's on a real GPU is tests/gpu/test_kernels.py's job.

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_norm_triton_interpret.py
"""

import numpy as np
import pytest
import torch

from tests.interpret import bf16_steps, only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()

from model_runtime.kernels import elementwise as E  # noqa: E402


def ms_model(x_RD: np.ndarray, vec: int, bw: int) -> np.ndarray:
    """ATen's float32 mean of squares in the order of the module docstring, in NumPy."""
    R, D = x_RD.shape
    sq = (x_RD * x_RD).astype(np.float32)
    lanes = 4 * bw
    acc = np.zeros((R, lanes), np.float32)
    for j in range(D // lanes):
        acc = (acc + sq[:, j * lanes : (j + 1) * lanes]).astype(np.float32)
    per = acc.reshape(R, bw, 4) if vec == 4 else acc.reshape(R, 4, bw).transpose(0, 2, 1)
    thread = ((per[..., 0] + per[..., 1]) + per[..., 2]) + per[..., 3]
    while thread.shape[1] > 1:  # the warp folds in halves: thread t adds thread t + width / 2
        half = thread.shape[1] // 2
        thread = thread[:, :half] + thread[:, half:]
    return thread[:, 0] * np.float32(1.0 / D)


@pytest.mark.parametrize("R,D,plan", [(37, 256, (4, 32)), (20, 128, (1, 32)), (18, 128, (4, 32)), (33, 512, (4, 16))],
                         ids=lambda v: str(v))
def test_sums_follow_the_documented_order(R, D, plan):
    from model_runtime.kernels import norm_triton as NT

    g = torch.Generator().manual_seed(R * D)
    x = (torch.randn(R, D, generator=g) * 3).to(torch.bfloat16)
    d = torch.randn(R, D, generator=g).to(torch.bfloat16)
    w = (torch.randn(D, generator=g) * 0.1).to(torch.bfloat16)
    ms = torch.empty(R)
    total, out = NT.rms_norm(x, w, 1e-6, d, plan=plan, ms_out=ms)
    assert bf16_steps(total, x + d) <= 1.0
    want = ms_model(total.float().numpy(), *plan)  # the kernel's own sum, rounded as it rounds
    assert np.array_equal(ms.numpy(), want), f"max |ms - model| {np.abs(ms.numpy() - want).max():.3e}"
    steps = bf16_steps(out, E.rms_norm(total, w, 1e-6))
    assert steps <= 1.0, f"rms_norm off eager by {steps:.2f} bf16 steps (tolerance 1)"

    gate = torch.randn(R, D, generator=g).to(torch.bfloat16)
    gated = NT.gated_rms_norm(x, gate, w, 1e-6, plan=plan, ms_out=ms)
    want = ms_model(x.float().numpy(), *plan)
    assert np.array_equal(ms.numpy(), want), f"gated: max |ms - model| {np.abs(ms.numpy() - want).max():.3e} (tol 0)"
    steps = bf16_steps(gated, E.gated_rms_norm(x, gate, w, 1e-6))  # three bf16 roundings, each truncated here
    assert steps <= 3.0, f"gated_rms_norm off eager by {steps:.2f} bf16 steps (tolerance 3)"


def test_strided_heads_are_read_in_place():
    """q heads cut from a wider projection ([T, H, 2D][..., :D]) collapse to rows of one stride."""
    from model_runtime.kernels import norm_triton as NT

    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(9, 2, 512, generator=g) * 3).to(torch.bfloat16)
    q = wide[..., :256]
    rows, stride = NT._rows_view(q)
    assert rows.data_ptr() == q.data_ptr() and stride == 512
    w = (torch.randn(256, generator=g) * 0.1).to(torch.bfloat16)
    out = NT.rms_norm(q, w, 1e-6, plan=(4, 32))
    assert out.shape == q.shape and out.is_contiguous()
    assert bf16_steps(out, E.rms_norm(q, w, 1e-6)) <= 1.0


def test_kernel_reproduces_aten_sums_recorded_on_the_h200():
    """Rows of D = 128, 256 and 4096 and ATen's ``x.float().pow(2).mean(-1)`` of them as the H200
    computed it (torch 2.11, data/aten_mean_of_squares_h200.npz; how it was found: docs/benchmarks.md):
    the kernel's plan for torch 2.11 gives the same float32 values bit for bit."""
    from pathlib import Path

    from model_runtime.kernels import norm_triton as NT

    data = np.load(Path(__file__).parent / "data" / "aten_mean_of_squares_h200.npz")
    for D in (128, 256, 4096):
        bits = data[f"x_bits_D{D}"].astype(np.int16)
        x = torch.from_numpy(bits.copy()).view(torch.bfloat16)
        ms = torch.empty(x.shape[0])
        NT.rms_norm(x, torch.zeros(D, dtype=torch.bfloat16), 1e-6, plan=(4, 32), ms_out=ms)
        differ = int((ms.numpy() != data[f"aten_ms_D{D}"]).sum())
        assert differ == 0, f"D={D}: {differ} of {x.shape[0]} rows differ from the H200's ATen"


@pytest.mark.parametrize("shape,strides", [((5, 1, 128), (128, 7, 1)), ((1, 6, 128), (999, 256, 1)),
                                           ((4, 5, 3, 128), (1920, 1920, 128, 1))], ids=str)
def test_rows_view_ignores_size_one_dims_and_copies_what_does_not_collapse(shape, strides):
    """Size-1 dimensions may carry any stride; leading dimensions that do not step by one stride
    (the last case: 4 x 5 rows of 3 where 5 steps as far as 4) are copied."""
    from model_runtime.kernels import norm_triton as NT

    g = torch.Generator().manual_seed(1)
    base = (torch.randn(20000, generator=g) * 3).to(torch.bfloat16)
    x = base.as_strided(shape, strides)
    rows, stride = NT._rows_view(x)
    R = x.numel() // 128
    got = torch.stack([rows.flatten()[i * stride : i * stride + 128] if rows.is_contiguous() else
                       base[rows.storage_offset() + i * stride : rows.storage_offset() + i * stride + 128]
                       for i in range(R)])
    assert torch.equal(got, x.reshape(R, 128)), f"rows of {shape} with strides {strides} read wrongly"
    w = (torch.randn(128, generator=g) * 0.1).to(torch.bfloat16)
    assert bf16_steps(NT.rms_norm(x, w, 1e-6, plan=(4, 32)), E.rms_norm(x, w, 1e-6)) <= 2.0


@pytest.mark.parametrize("D,plan", [(128, (4, 32)), (256, (4, 32)), (1024, (4, 32)), (1024, (1, 32))], ids=str)
def test_every_tile_gives_the_same_numbers(D, plan):
    """A tile (rows per program, chunks per load, warps) only changes how the work is cut: every
    candidate bench/elementwise_probe.py may pick must give the default tile's sums, norms and
    residual sums bit for bit, rows left over in the last program included (R = 19: 16-row tiles
    leave 3, 32-row tiles run one partial program), for both lane layouts (vec 4 and vec 1).
    The interpreter runs a program as one block of NumPy operations, so tiles that differ only in
    their warps compute alike here: one tile of each (rows, chunks) pair is run."""
    from model_runtime.kernels import norm_triton as NT

    R = 19
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(R, D, generator=g) * 3).to(torch.bfloat16)
    d = torch.randn(R, D, generator=g).to(torch.bfloat16)
    w = (torch.randn(D, generator=g) * 0.1).to(torch.bfloat16)
    gate = torch.randn(R, D, generator=g).to(torch.bfloat16)

    def run(tile):
        ms, ms_gated = torch.empty(R), torch.empty(R)
        total, out = NT.rms_norm(x, w, 1e-6, d, plan=plan, ms_out=ms, tile=tile)
        gated = NT.gated_rms_norm(x, gate, w, 1e-6, plan=plan, ms_out=ms_gated, tile=tile)
        return {"total": total, "out": out, "ms": ms, "gated": gated, "ms_gated": ms_gated,
                "plain": NT.rms_norm(x, w, 1e-6, plan=plan, tile=tile)}

    want = run(None)
    tiles = NT.tile_candidates(D, plan)
    assert NT.default_tile(D, plan) in tiles
    one_per_cut = {(rows, unroll): (rows, unroll, warps) for rows, unroll, warps in tiles}
    for tile in one_per_cut.values():
        for name, got in run(tile).items():
            differ = int((got != want[name]).sum())
            assert differ == 0, f"D={D}, tile {tile}: {differ} values of {name} differ from the default tile's"
