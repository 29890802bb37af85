"""Triton kernels around the routed experts' two grouped products, rounding where PyTorch rounds.

Legend: T = tokens, D = hidden size, K = experts per token, I = an expert's intermediate size,
S = T * K routed pairs (rows of the grouped products, sorted by expert).

The ``grouped_mm`` composition (model_runtime/kernels/moe_experts.py) moves far more memory than
its two products: ``silu(gate) * up`` in two passes, the weighted rows scattered back to pair
order, K float32 passes over ``[T, D]`` for the top-k sum, then ``routed + gate * shared`` in two
more. These kernels do the same arithmetic in one pass each:

- ``silu_mul_rows``: ``h = bf16(f32(bf16(silu(f32(g)))) * f32(u))`` over the first S rows of the
  first product's ``[rows, 2I]`` output (gate columns, then up columns), read in place. SiLU is
  ATen's CUDA formula ``x / (1 + exp(-x))`` with CUDA's expf and an IEEE division
  (``triton_math.silu``), as the MLP's SiLU product kernel (pointwise_triton.py).
- ``scatter_rows``: every token's row read once and written to its K places in the grouped
  product's input (``out[pos[t, k]] = x[t]``): the row gather ``index_select(x, 0, order // K)``
  seen from the tokens' side, which reads each row once instead of K times. A copy, so the
  numbers cannot change; used by ``moe_experts=grouped_mm_fused_scatter`` and ``expert_tiles``,
  being faster than the gather (docs/moe.md).
- ``combine_top_k``: for each token, its K rows of the second product (found through ``pos``,
  the position of pair ``t * K + k`` in the sorted order) times its routing weights, each product
  rounded to the model dtype, summed in float32 in the order of PyTorch's CUDA sum
  (``moe_experts.combine_top_k``: four accumulators, each from +0.0), rounded once; then, when
  given, the block's ``routed + gate * shared`` (the product rounded, then the sum rounded), so
  the routed output is never written in float32 nor re-read.

Every step is one IEEE float32 operation then a cast, as ATen's kernels compute them (opmath
float32 for bf16), so any tile gives the same numbers; tests/gpu/test_moe_fused.py checks them
against the composition bit for bit. In the sm_90 code LLVM turns a float32 product or sum of two
bf16 values that is rounded to bf16 into one ``mul.rn.bf16`` / ``add.rn.bf16``: the same numbers,
since such a product is exact in float32 and float32 carries more than 2 * 8 + 2 bits (so rounding
a sum twice equals rounding it once). Under Triton's CPU interpreter (no libdevice) NumPy's exp
stands in and casts to bf16 truncate instead of rounding to nearest.
"""

from __future__ import annotations

import torch

from model_runtime.kernels import triton_math

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use these
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

# Elements per program and warps; the numbers do not depend on them (one value per lane, no sums
# across lanes). 16 elements per thread, as the MLP's SiLU product kernel.
SILU_BLOCK, SILU_WARPS = 2048, 4
COMBINE_BLOCK_D, COMBINE_WARPS = 2048, 4
SCATTER_BLOCK_D, SCATTER_WARPS = 2048, 4

if triton is not None:
    @triton.jit
    def _silu_mul_rows_kernel(gu_ptr, h_ptr, S, I, stride_gu, stride_h,
                              BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, CUDA_MATH: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        ok = (rows[:, None] < S) & (cols[None, :] < I)
        gate_ptrs = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
        g = tl.load(gate_ptrs, mask=ok, other=0.0, eviction_policy="evict_first")
        u = tl.load(gate_ptrs + I, mask=ok, other=0.0, eviction_policy="evict_first")
        act = triton_math.silu(g.to(tl.float32), CUDA_MATH).to(g.dtype)  # F.silu's output, in the input dtype
        h = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=ok)

    @triton.jit
    def _combine_top_k_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, gate_ptr, shared_ptr, D, stride_y,
                              K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        # PyTorch's CUDA sum over K (moe_experts.combine_top_k): term k into accumulator k % 4,
        # each from +0.0, then the four in turn
        acc0 = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):
            p = tl.load(pos_ptr + t * K + k).to(tl.int64)
            w = tl.load(w_ptr + t * K + k)
            y = tl.load(y_ptr + p * stride_y + cols, mask=ok, other=0.0)
            term = (y.to(tl.float32) * w.to(tl.float32)).to(y.dtype).to(tl.float32)
            if k % 4 == 0:
                acc0 = acc0 + term
            elif k % 4 == 1:
                acc1 = acc1 + term
            elif k % 4 == 2:
                acc2 = acc2 + term
            else:
                acc3 = acc3 + term
        out = (((acc0 + acc1) + acc2) + acc3).to(out_ptr.dtype.element_ty)
        if HAS_SHARED:
            g = tl.load(gate_ptr + t)
            s = tl.load(shared_ptr + t * D + cols, mask=ok, other=0.0)
            gs = (g.to(tl.float32) * s.to(tl.float32)).to(s.dtype)
            out = (out.to(tl.float32) + gs.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * D + cols, out, mask=ok)


    @triton.jit
    def _scatter_rows_kernel(x_ptr, pos_ptr, out_ptr, D, stride_x, stride_out, K: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_ptr + t * stride_x + cols, mask=ok)
        for k in tl.static_range(K):
            p = tl.load(pos_ptr + t * K + k).to(tl.int64)
            tl.store(out_ptr + p * stride_out + cols, x, mask=ok)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # PyTorch computes these in float32, as the kernels do


def _meta(device: torch.device, warps: int) -> dict:
    return dict(num_warps=warps, CUDA_MATH=device.type == "cuda", **triton_math.aten_rounding_options(device))


def _require_triton():
    if triton is None:
        raise RuntimeError("the fused MoE kernels need triton")


def silu_mul_rows(gate_up_R2I: torch.Tensor, num_rows: int, out_RI: torch.Tensor | None = None) -> torch.Tensor:
    """``F.silu(gate) * up`` of the first ``num_rows`` rows of ``gate_up_R2I`` (``[R, 2I]``, gate
    columns then up columns, rows contiguous), into ``out_RI`` (``[R, I]``; rows from
    ``num_rows`` on are left as they are). Returns ``out_RI``.

    >>> h = silu_mul_rows(gate_up, S)  # == F.silu(gate_up[:S, :I]) * gate_up[:S, I:] on [:S]
    """
    _require_triton()
    R, two_i = gate_up_R2I.shape
    I = two_i // 2
    if two_i % 2 or gate_up_R2I.stride(1) != 1 or gate_up_R2I.dtype not in _DTYPES or not 0 <= num_rows <= R:
        raise ValueError(f"silu_mul_rows takes [R, 2I] rows of unit column stride in bf16, fp16 or fp32 and "
                         f"0 <= num_rows <= R; got {tuple(gate_up_R2I.shape)} {gate_up_R2I.dtype}, strides "
                         f"{gate_up_R2I.stride()}, num_rows {num_rows}")
    if out_RI is None:
        out_RI = gate_up_R2I.new_empty(R, I)
    if out_RI.shape != (R, I) or out_RI.stride(1) != 1 or out_RI.dtype != gate_up_R2I.dtype:
        raise ValueError(f"out_RI must be [{R}, {I}] {gate_up_R2I.dtype} with unit column stride, "
                         f"got {tuple(out_RI.shape)} {out_RI.dtype}, strides {out_RI.stride()}")
    if num_rows == 0:
        return out_RI
    block_i = min(triton.next_power_of_2(I), SILU_BLOCK)
    block_r = max(1, SILU_BLOCK // block_i)
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(I, block_i))
    _silu_mul_rows_kernel[grid](gate_up_R2I, out_RI, num_rows, I, gate_up_R2I.stride(0), out_RI.stride(0),
                                BLOCK_R=block_r, BLOCK_I=block_i, **_meta(gate_up_R2I.device, SILU_WARPS))
    return out_RI


def scatter_rows(x_TD: torch.Tensor, pos_TK: torch.Tensor, out_RD: torch.Tensor) -> torch.Tensor:
    """``out_RD[pos_TK[t, k]] = x_TD[t]`` for every token t and k (rows of ``out_RD`` that no
    ``pos`` names are left as they are). Returns ``out_RD``.

    >>> scatter_rows(x, pos.view(T, K), x_R)  # x_R[:T * K] == x.index_select(0, order // K)
    """
    _require_triton()
    T, K = pos_TK.shape
    D = x_TD.shape[1]
    if (x_TD.shape[0] != T or out_RD.shape[1] != D or out_RD.shape[0] < T * K or out_RD.dtype != x_TD.dtype
            or x_TD.stride(1) != 1 or out_RD.stride(1) != 1 or not pos_TK.is_contiguous()
            or pos_TK.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"scatter_rows takes x [T, D], contiguous int pos [T, K] and out [>= T * K, D] of x's dtype, "
                         f"unit column strides; got x {tuple(x_TD.shape)} {x_TD.dtype} strides {x_TD.stride()}, "
                         f"pos {tuple(pos_TK.shape)} {pos_TK.dtype}, out {tuple(out_RD.shape)} {out_RD.dtype}")
    if T == 0:
        return out_RD
    block_d = min(triton.next_power_of_2(D), SCATTER_BLOCK_D)
    _scatter_rows_kernel[(T, triton.cdiv(D, block_d))](x_TD, pos_TK, out_RD, D, x_TD.stride(0), out_RD.stride(0),
                                                       K=K, BLOCK_D=block_d, num_warps=SCATTER_WARPS)
    return out_RD


def combine_top_k(
    y_RD: torch.Tensor,
    pos_TK: torch.Tensor,
    top_w_TK: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[T, D]``: token t's rows ``y_RD[pos_TK[t, k]]`` times ``top_w_TK[t, k]`` (each rounded to
    the dtype), summed over k in float32 in PyTorch's CUDA order and rounded; with ``shared = (gate_T1, shared_TD)``
    then ``out + gate * shared`` (each step rounded), the sparse-MoE block's output.

    >>> out = combine_top_k(y, pos, w)  # == moe_experts.combine_top_k(y[pos.flatten()] * w.flatten()[:, None], T, dtype)
    """
    _require_triton()
    T, K = pos_TK.shape
    D = y_RD.shape[1]
    if (top_w_TK.shape != (T, K) or y_RD.dtype not in _DTYPES or top_w_TK.dtype != y_RD.dtype or y_RD.stride(1) != 1
            or not pos_TK.is_contiguous() or not top_w_TK.is_contiguous() or pos_TK.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"combine_top_k takes y [R, D] (unit column stride), contiguous int pos [T, K] and weights [T, K] "
                         f"of y's dtype (bf16, fp16, fp32); got y {tuple(y_RD.shape)} {y_RD.dtype} strides {y_RD.stride()}, "
                         f"pos {tuple(pos_TK.shape)} {pos_TK.dtype}, weights {tuple(top_w_TK.shape)} {top_w_TK.dtype}")
    out_TD = y_RD.new_empty(T, D)
    if shared is not None:
        gate_T1, shared_TD = shared
        if (gate_T1.shape != (T, 1) or shared_TD.shape != (T, D) or gate_T1.dtype != y_RD.dtype
                or shared_TD.dtype != y_RD.dtype or not gate_T1.is_contiguous() or not shared_TD.is_contiguous()):
            raise ValueError(f"shared must be (gate [T, 1], shared [T, D]) contiguous in {y_RD.dtype}, T={T}, D={D}; got "
                             f"{tuple(gate_T1.shape)} {gate_T1.dtype}, {tuple(shared_TD.shape)} {shared_TD.dtype}")
    else:
        gate_T1 = shared_TD = out_TD  # never read
    if T == 0:
        return out_TD
    grid = (T, triton.cdiv(D, COMBINE_BLOCK_D))
    meta = _meta(y_RD.device, COMBINE_WARPS)
    meta.pop("CUDA_MATH")  # no exp or division here
    _combine_top_k_kernel[grid](y_RD, pos_TK, top_w_TK, out_TD, gate_T1, shared_TD, D, y_RD.stride(0),
                                K=K, HAS_SHARED=shared is not None, BLOCK_D=min(triton.next_power_of_2(D), COMBINE_BLOCK_D),
                                **meta)
    return out_TD
