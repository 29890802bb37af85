"""The fused conv1d + SiLU kernel (model_runtime/kernels/conv_triton.py) in Triton's CPU
interpreter, against a NumPy model of fla's float32 order on a packed row.

Two things of the interpreter's own keep this from being a bit-for-bit test, so each check says
how far it may be off and why:
- its float32 -> bf16 cast truncates (Triton 3.6's ``_convert_float`` rounds only when a rounding
  mode reaches it, and a plain cast passes none), where the GPU rounds to nearest even: a conv
  element must equal the model's float32 sum rounded either way, which still catches any other
  tap order or a window that crosses a segment boundary;
- its exp and division are NumPy's, not CUDA's expf and div.rn: the SiLU must be within one
  bf16 step of the correctly rounded SiLU of the kernel's own conv output.
That the kernel equals fla and ATen bit for bit on a GPU is tests/gpu/test_kernels.py's job.

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_conv_triton_interpret.py
"""

import numpy as np
import pytest
import torch

from tests.interpret import only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()

from model_runtime.model.packing import PackedBatch  # noqa: E402

LENGTHS = (1, 3, 17, 29)  # T = 50
SPLITS = (8, 8, 8)


def conv_model(x_TC: np.ndarray, w_CW: np.ndarray, lengths) -> np.ndarray:
    """fla's order in float32: accumulator from 0, taps oldest first, zeros before a segment."""
    T, C = x_TC.shape
    W = w_CW.shape[1]
    acc_TC = np.zeros((T, C), np.float32)
    start = 0
    for n in lengths:
        for t in range(start, start + n):
            for k in range(W):
                src = t - (W - 1 - k)
                tap = x_TC[src] if src >= start else np.zeros(C, np.float32)
                acc_TC[t] = (acc_TC[t] + (tap * w_CW[:, k]).astype(np.float32)).astype(np.float32)
        start += n
    return acc_TC


def inputs(T, C, W, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=g).to(torch.bfloat16)
    w = (torch.randn(C, W, generator=g) * 0.5).to(torch.bfloat16)
    return x, w


def bf16_either_way(a_TC: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 -> bf16 rounded to nearest even (the GPU) and truncated (the interpreter)."""
    nearest = torch.from_numpy(a_TC).to(torch.bfloat16)
    truncated = torch.from_numpy(a_TC.view(np.uint32) & np.uint32(0xFFFF0000)).view(torch.float32).to(torch.bfloat16)
    return nearest, truncated


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last bf16 place (8 significant bits)."""
    _, exponent = torch.frexp(b.float())
    return (a.float() - b.float()).abs() / torch.ldexp(torch.ones_like(b, dtype=torch.float32), exponent - 8)


@pytest.mark.parametrize("width", [4, 3, 2])
def test_conv_follows_fla_order_and_silu_within_a_step(width):
    from model_runtime.kernels.conv_triton import causal_conv1d_silu_triton, conv_splits

    packed = PackedBatch.from_lengths(LENGTHS)
    x, w = inputs(packed.total_tokens, sum(SPLITS), width, seed=width)
    nearest, truncated = bf16_either_way(conv_model(x.float().numpy(), w.float().numpy(), LENGTHS))

    raw = torch.cat(conv_splits(x, w, packed, SPLITS, silu=False), dim=-1)
    bad = int(((raw != nearest) & (raw != truncated)).sum())
    assert bad == 0, f"conv differs from fla's order, rounded either way, in {bad} of {raw.numel()} elements"

    outs = causal_conv1d_silu_triton(x, w, packed, splits=SPLITS)
    c64 = raw.double()
    silu = (c64 / (1 + torch.exp(-c64))).to(torch.bfloat16)  # correctly rounded SiLU of the kernel's conv
    for part, want in zip(outs, silu.split(list(SPLITS), dim=-1)):
        assert part.is_contiguous() and part.shape == want.shape and part.dtype == torch.bfloat16
        steps = float(bf16_ulps(part, want).max())
        assert steps <= 1.0, f"SiLU off by {steps:.2f} bf16 steps (tolerance 1: NumPy's exp, truncating cast)"

    whole = causal_conv1d_silu_triton(x, w, packed)
    diff = (whole.float() - torch.cat(outs, dim=-1).float()).abs().max()
    assert torch.equal(whole, torch.cat(outs, dim=-1)), f"unsplit output off the split one by {diff:.3e} (tol 0)"


def test_float32_sums_taps_in_fla_order():
    """float32 in and out: nothing rounds the sum away, so the tap order shows bit for bit (with
    bf16 inputs the products are exact and the sums mostly are too). The interpreter does not
    contract ``acc + x * w`` into an FMA and neither does the model; on a GPU both fla and this
    kernel do."""
    from model_runtime.kernels.conv_triton import conv_splits

    packed = PackedBatch.from_lengths(LENGTHS)
    g = torch.Generator().manual_seed(3)
    scale_T1 = torch.exp2(torch.randint(-6, 7, (packed.total_tokens, 1), generator=g).float())
    x = torch.randn(packed.total_tokens, 24, generator=g) * scale_T1
    w = torch.randn(24, 4, generator=g) * 0.5
    want = torch.from_numpy(conv_model(x.numpy(), w.numpy(), LENGTHS))
    (got,) = conv_splits(x, w, packed, None, silu=False)
    assert got.dtype == torch.float32
    bad = int((got != want).sum())
    assert bad == 0, f"float32 conv differs from fla's order in {bad} of {want.numel()} elements"


def test_segment_alone_equals_segment_in_the_row():
    from model_runtime.kernels.conv_triton import conv_splits

    packed = PackedBatch.from_lengths(LENGTHS)
    x, w = inputs(packed.total_tokens, 24, 4, seed=11)
    (row,) = conv_splits(x, w, packed, None, silu=False)
    for start, end in packed.segments():
        (alone,) = conv_splits(x[start:end], w, PackedBatch.from_lengths([end - start]), None, silu=False)
        assert torch.equal(row[start:end], alone), f"segment [{start}, {end}) sees its neighbours"


def test_every_tile_gives_the_same_numbers():
    """Tiles only cut the row differently (a split narrower than the channel block gets a
    narrower block; rows past T are masked): every candidate bench/elementwise_probe.py may pick
    gives the default tile's outputs bit for bit, on a row several token blocks long. The
    interpreter runs a program as one block of NumPy operations, so tiles that differ only in their
    warps compute alike here: one tile of each block shape is run."""
    from model_runtime.kernels.conv_triton import DEFAULT_TILE, conv_splits, tile_candidates

    lengths = (1, 70, 3, 150, 76)  # T = 300: segments across block edges of 32 to 256 tokens
    packed = PackedBatch.from_lengths(lengths)
    x, w = inputs(packed.total_tokens, 40, 4, seed=7)
    splits = (8, 8, 24)
    want = conv_splits(x, w, packed, splits, silu=True, tile=DEFAULT_TILE)
    assert DEFAULT_TILE in tile_candidates()
    one_per_block = {(bt, bc): (bt, bc, warps) for bt, bc, warps in tile_candidates()}
    for tile in one_per_block.values():
        for got, ref in zip(conv_splits(x, w, packed, splits, silu=True, tile=tile), want):
            assert torch.equal(got, ref), f"tile {tile}: {int((got != ref).sum())} of {ref.numel()} values differ"


def test_bad_splits_raise():
    from model_runtime.kernels.conv_triton import causal_conv1d_silu_triton

    packed = PackedBatch.from_lengths(LENGTHS)
    x, w = inputs(packed.total_tokens, 24, 4, seed=1)
    with pytest.raises(ValueError, match="add up to C=24"):
        causal_conv1d_silu_triton(x, w, packed, splits=(8, 8))
