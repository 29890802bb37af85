"""The mean of squares of every row, summed in the order PyTorch's CUDA reduction sums it.

Legend: R = rows, D = the reduced (last) dimension.

Hugging Face's RMSNorms compute ``x.float().pow(2).mean(-1)``: a float32 sum over D whose order
is set by PyTorch's reduction kernel (ATen's ``Reduce.cuh``). A fused kernel that sums in
another order lands a float32 rounding away, and about one element in 10^4 of the bf16 output
then rounds the other way. A random 9B-shaped model amplifies such differences through its
layers to 5e-3 (mean |logprob|) after four layers, more than DESIGN.md's bf16 bound, so the
fused norms of ``elementwise=inductor_matched`` take their mean from this kernel, which sums
in ATen's order, and Inductor does the rest.

ATen's order for a reduction over the contiguous last dimension, R >= 16 rows (``plan``):
- D > 128 ("vectorised input"): the row is read as vectors of 4; thread ``t`` of a warp of
  ``bw`` threads keeps 4 running sums, one per vector lane, over vectors t, t + bw, t + 2 bw...,
  then adds them in lane order ((s0 + s1) + s2) + s3;
- D <= 128: thread ``t`` keeps 4 running sums over elements t + (4 j + i) bw (sum i takes
  every fourth stride), added in the same order;
- then the ``bw`` threads' values are added pairwise (warp shuffles at offsets 1, 2, 4, ...),
  and the sum is multiplied by float32(1 / D).
A shape outside this plan (D not a multiple of 4 bw, fewer than 16 rows) falls back to ATen's
own ``mean``. tests/gpu/test_kernels.py checks the kernel bit for bit against ATen.
"""

from __future__ import annotations

import numpy as np
import torch

_MAX_THREADS = 512  # ATen's max_reduce_threads for float32
_WARP = 32


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def plan(rows: int, dim: int) -> tuple[int, int] | None:
    """``(vec, bw)``: vector width and threads per row of ATen's reduction, or None when this
    kernel does not reproduce its order (the caller then uses ATen)."""
    if rows < 16:
        return None
    vec = 4 if dim > 128 and dim % 4 == 0 else 1
    dim0 = dim // vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < _MAX_THREADS else _MAX_THREADS
    dim1_pow2 = _last_pow2(rows) if rows < _MAX_THREADS else _MAX_THREADS
    bw = min(dim0_pow2, _WARP)
    bh = min(dim1_pow2, _MAX_THREADS // bw)
    bw = min(dim0_pow2, _MAX_THREADS // bh)
    if bw > _WARP:
        return None  # a block-wide (shared memory) stage: not reproduced here
    values_per_thread = -(-dim0 // bw)
    if values_per_thread >= bh * 16 or values_per_thread >= 256:
        return None  # the sum is split across warps too
    per_pass = bw if vec == 4 else 4 * bw
    if dim0 % per_pass or (vec == 1 and dim % (4 * bw)):
        return None
    return vec, bw


def mean_square_reference(x_RD: torch.Tensor) -> torch.Tensor:
    """``x.float().pow(2).mean(-1)``: ATen's own, as Hugging Face's norms compute it."""
    return x_RD.float().pow(2).mean(-1)


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def mean_square_kernel(x_ptr, stride_x, d_ptr, total_ptr, out_ptr, R, D: tl.constexpr, FACTOR,
                           VEC: tl.constexpr, BW: tl.constexpr, LOG_BW: tl.constexpr, ROWS: tl.constexpr,
                           HAS_DELTA: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * ROWS + tl.arange(0, ROWS)
        row_ok = rows < R
        base = rows.to(tl.int64)[:, None] * stride_x
        out_base = rows.to(tl.int64)[:, None] * D
        LANES: tl.constexpr = BW * 4
        lanes = tl.arange(0, LANES)[None, :]
        acc = tl.zeros([ROWS, LANES], tl.float32)
        for j in tl.static_range(D // LANES):
            # VEC 4: lane t * 4 + i is vector lane i of thread t; VEC 1: lane i * BW + t is
            # running sum i of thread t. Either way one pass covers LANES consecutive elements.
            mask = row_ok[:, None]
            x = tl.load(x_ptr + base + j * LANES + lanes, mask=mask, other=0.0)
            if HAS_DELTA:
                offs = out_base + j * LANES + lanes
                x = (x.to(tl.float32) + tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
                tl.store(total_ptr + offs, x, mask=mask)
            xf = x.to(tl.float32)
            acc = acc + xf * xf
        if VEC == 4:
            per = tl.reshape(acc, (ROWS, BW, 4))
        else:
            per = tl.permute(tl.reshape(acc, (ROWS, 4, BW)), (0, 2, 1))
        # Lanes i = 0..3 of every thread, added in order: ((s0 + s1) + s2) + s3.
        even, odd = tl.split(tl.reshape(per, (ROWS, BW, 2, 2)))  # even: i = 0, 2; odd: i = 1, 3
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        thread = ((s0 + s1) + s2) + s3
        # The threads' values, adjacent pairs added level by level (warp shuffles at 1, 2, 4, ...).
        for level in tl.static_range(LOG_BW):
            a, b = tl.split(tl.reshape(thread, (ROWS, BW >> (level + 1), 2)))
            thread = a + b
        tl.store(out_ptr + rows, tl.reshape(thread, (ROWS,)) * FACTOR, mask=row_ok)

    _KERNEL = mean_square_kernel
    return _KERNEL


def mean_square(x_RD: torch.Tensor, delta_RD: torch.Tensor | None = None, vec_bw: tuple[int, int] | None = None):
    """Float32 ``[R]`` mean of squares of every row of ``x_RD`` (or of ``x_RD + delta_RD``,
    rounded to their dtype, which is then also returned: ``(total_RD, ms_R)``), summed in
    ATen's order; ``vec_bw`` overrides ``plan`` (tests)."""
    R, D = x_RD.shape
    chosen = vec_bw or plan(R, D)
    if chosen is None or not (x_RD.is_cuda or _interpreting()):
        total = x_RD if delta_RD is None else x_RD + delta_RD
        ms = mean_square_reference(total)
        return ms if delta_RD is None else (total, ms)
    vec, bw = chosen
    if x_RD.stride(1) != 1 or (delta_RD is not None and not x_RD.is_contiguous()):
        x_RD = x_RD.contiguous()
    out = torch.empty(R, dtype=torch.float32, device=x_RD.device)
    total = torch.empty_like(x_RD) if delta_RD is not None else x_RD
    rows = max(1, min(16, 8192 // D))
    grid = (triton_cdiv(R, rows),)
    _kernel()[grid](x_RD, x_RD.stride(0), x_RD if delta_RD is None else delta_RD.contiguous(), total, out, R, D,
                    float(np.float32(1.0) / np.float32(D)), VEC=vec, BW=bw, LOG_BW=bw.bit_length() - 1, ROWS=rows,
                    HAS_DELTA=delta_RD is not None)
    return out if delta_RD is None else (total, out)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
