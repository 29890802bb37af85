"""Causal depthwise conv1d and SiLU over a packed row in one Triton pass, equal to
``conv.causal_conv1d_fla`` bit for bit.

Legend: T = tokens in the row, C = channels (Ci: one split's), W = kernel width.

Why: ``causal_conv1d_fla`` runs fla's conv, then ATen's SiLU over each strided split of its
output and a copy per split, a strided unvectorised pass that costs twice the conv itself
(docs/benchmarks.md). This kernel reads x once and writes every split (q, k, v) as its own contiguous tensor, one launch per split.
fla's default is assumed: its opt-in Gluon conv (``FLA_GLUON=1``) is another kernel.

The arithmetic it reproduces, step by step:
- fla 0.6's ``causal_conv1d_fwd_kernel`` (``fla/modules/causal_conv1d/ops.py``, activation=None,
  no bias, no initial state): weights loaded as float32 (line 98); a float32 accumulator from 0
  (line 100); taps added oldest first, ``acc + x * w`` with x loaded as float32 and read as 0
  before the segment start (lines 102-109); stored in x's dtype, round to nearest even (line 147,
  into ``empty_like(x)``, line 634).
- ATen's SiLU on that rounded value: ``x_acc / (opmath_t(1) + ::exp(-x_acc))`` in float32
  (pytorch ``aten/src/ATen/native/cuda/ActivationSiluKernel.cu``, ``silu_kernel``), i.e. CUDA's
  ``expf`` (libdevice ``__nv_expf``, here without flush-to-zero as nvcc builds ATen) and IEEE
  division (``div.rn.f32``), rounded to x's dtype.
Both kernels compile with Triton's default fp fusion, so ``acc + x * w`` becomes the same
``fma.rn.f32`` here as in fla (sm_90 PTX of both: four per output, the first onto 0.0); with
bf16 x and w the product is exact in float32 and the FMA cannot change the sum anyway. In
``__nv_expf`` its closing ``* 2^i`` fuses with ``1 +`` into an FMA; that product is exact too.

A token's segment start comes from ``packed.position_ids`` (built from the lengths, 0 at every
segment start): input t - j belongs to t's segment iff j <= position_ids[t].
"""

from __future__ import annotations

import functools

import torch

from model_runtime.kernels import triton_math  # its jit helpers are module globals: the interpreter sees them
from model_runtime.kernels.conv import _check, continue_windows
from model_runtime.model.packing import PackedBatch

# (tokens, channels, warps) per program; any tile gives the same numbers (each output's taps are
# added in one order), and a split narrower than the channel block gets a narrower one. The
# default is bench/elementwise_probe.py's fastest tile on an H200 (docs/benchmarks.md).
DEFAULT_TILE = (32, 128, 4)


def tile_candidates() -> list[tuple[int, int, int]]:
    """The tiles bench/elementwise_probe.py times: 8 to 64 outputs per thread."""
    return [(bt, bc, warps) for bt in (32, 64, 128, 256) for bc in (64, 128, 256) for warps in (4, 8)
            if 8 <= bt * bc // (32 * warps) <= 64]


def causal_conv1d_silu_triton(x_TC: torch.Tensor, weight_CW: torch.Tensor, packed: PackedBatch, splits=None):
    """SiLU(causal depthwise conv1d) of ``x_TC`` [T, C] with ``weight_CW`` [C, W], the window
    restarting at every segment of ``packed``; ``[T, C]``, or with ``splits`` (channel counts
    adding up to C) a tuple of contiguous ``[T, Ci]`` tensors (CUDA, Triton).

    Example: ``q, k, v = causal_conv1d_silu_triton(x_TC, w_CW, packed, splits=(2048, 2048, 4096))``
    """
    outs = conv_splits(x_TC, weight_CW, packed, splits, silu=True)
    return continue_windows(causal_conv1d_silu_triton, x_TC, weight_CW, packed, splits, outs[0] if splits is None else outs)


def conv_splits(x_TC, weight_CW, packed: PackedBatch, splits, silu: bool, tile=None) -> tuple[torch.Tensor, ...]:
    """One contiguous output per split; ``silu=False`` stops after the rounded conv (fla's own
    output with activation=None), which the tests compare on its own; ``tile`` overrides
    ``DEFAULT_TILE``."""
    _check(x_TC, weight_CW, packed)
    T, C = x_TC.shape
    widths = (C,) if splits is None else tuple(int(n) for n in splits)
    if sum(widths) != C or min(widths) < 1:
        raise ValueError(f"splits must be positive and add up to C={C}, got {widths}")
    # Tokens since the segment start: a continuation's rotary positions go on from its parent's.
    pos_T = packed.position_ids if packed.links is None else packed.linked.local_positions
    if pos_T.shape != (T,) or pos_T.device != x_TC.device:
        raise ValueError(f"packed.position_ids must be [T={T}] on {x_TC.device}, "
                         f"got {tuple(pos_T.shape)} on {pos_T.device}")
    if x_TC.stride(-1) != 1:
        x_TC = x_TC.contiguous()
    weight_CW = weight_CW.contiguous()
    width = weight_CW.shape[1]
    kernel, interpreted = _kernel()
    block_t, max_block_c, warps = tile or DEFAULT_TILE
    outs, c0 = [], 0
    for ci in widths:
        y_TC = torch.empty(T, ci, dtype=x_TC.dtype, device=x_TC.device)
        block_c = min(max_block_c, 1 << (ci - 1).bit_length())
        grid = (-(-T // block_t), -(-ci // block_c))
        # Flush-to-zero off in libdevice: ATen's expf is compiled without it.
        kernel[grid](x_TC[:, c0:], x_TC.stride(0), weight_CW[c0:], pos_T, y_TC, T, ci,
                     W=width, BLOCK_T=block_t, BLOCK_C=block_c, SILU=silu, LIBDEVICE=not interpreted,
                     num_warps=warps, enable_reflect_ftz=False)
        outs.append(y_TC)
        c0 += ci
    return tuple(outs)


@functools.cache
def _kernel():
    """Builds the kernel on first use (Triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def conv_silu_kernel(x_ptr, stride_x, w_ptr, pos_ptr, y_ptr, T, Ci,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t_ok = t < T
        c_ok = c < Ci
        pos = tl.load(pos_ptr + t, mask=t_ok, other=0)  # tokens since the segment start
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(W):  # oldest tap first, as fla adds them
            back = W - 1 - k
            ok = (t_ok & (pos >= back))[:, None] & c_ok[None, :]
            rows = (t - back).to(tl.int64)[:, None] * stride_x
            x = tl.load(x_ptr + rows + c[None, :], mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * W + k, mask=c_ok, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        y = acc.to(y_ptr.dtype.element_ty)  # fla's store: round to nearest even
        if SILU:  # ATen's SiLU of the rounded conv (NumPy's exp under the CPU interpreter)
            y = triton_math.silu(y.to(tl.float32), LIBDEVICE).to(y_ptr.dtype.element_ty)
        out = t.to(tl.int64)[:, None] * Ci + c[None, :]
        tl.store(y_ptr + out, y, mask=t_ok[:, None] & c_ok[None, :])

    return conv_silu_kernel, bool(triton.knobs.runtime.interpret)
