"""A narrow product ``x @ w.T`` whose every output row is computed the same way whatever the row
count: the ``tiles`` gate-projection backend's kernel (``kernels/gate_projection.py``).

cuBLAS picks a narrow product's kernel, and with it the summation order, by the row count, so a
sequence's decay, beta and router logits round by the length of the sequence (docs/prefix-sharing.md).
This kernel has one configuration per ``(N, K, dtype)``, chosen without looking at the row count
(no autotuning, the row count not specialised): each program takes ``BLOCK_M`` rows, zero-padded
past the end, and sums ``K`` in ``BLOCK_K`` steps in order into a float32 accumulator, then
rounds once. A row's output is then one function of that row alone: packed, alone, or split
across a shared prompt and its continuation, it gets the same bits. It is not Hugging Face's
rounding (that follows cuBLAS's kernel), so it is opt-in (``--kernels gate_projection=tiles``).

Legend: T = rows (tokens), D = input features (``K`` of the product), N = output features.
"""

from __future__ import annotations

import torch

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use this
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

BLOCK_M = 64
BLOCK_K = 64
MIN_BLOCK_N = 16  # tl.dot's smallest width: a one-output product (the shared-expert gate) is masked
MAX_BLOCK_N = 128
NUM_WARPS = 4
NUM_STAGES = 3
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def narrow_tiles_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range((K + BLOCK_K - 1) // BLOCK_K):  # in order: the one summation order of every row
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def block_n(out_features: int) -> int:
    """Output columns per program: the product's width rounded up to a power of two, 16 to 128."""
    return min(MAX_BLOCK_N, max(MIN_BLOCK_N, triton.next_power_of_2(out_features)))


def supports(x_TD: torch.Tensor, weight_ND: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: 2-D, one dtype (bf16, fp16, fp32) and device, ``K`` matching."""
    return (triton is not None and x_TD.dim() == 2 and weight_ND.dim() == 2 and x_TD.shape[1] == weight_ND.shape[1]
            and x_TD.dtype == weight_ND.dtype and x_TD.dtype in _DTYPES and x_TD.device == weight_ND.device)


def narrow_tiles(x_TD: torch.Tensor, weight_ND: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x_TD, weight_ND, bias_N)`` with every row computed alike whatever ``T`` (float32
    sums, float32 products for float32 operands, rounded once to ``x_TD``'s dtype)."""
    if not supports(x_TD, weight_ND):
        raise ValueError(f"narrow_tiles takes 2-D x and weight of one dtype (bf16, fp16, fp32), device and K; got "
                         f"x {tuple(x_TD.shape)} {x_TD.dtype}, weight {tuple(weight_ND.shape)} {weight_ND.dtype}")
    x_TD = x_TD.contiguous()
    weight_ND = weight_ND.contiguous()
    T, K = x_TD.shape
    N = weight_ND.shape[0]
    y_TN = x_TD.new_empty(T, N)
    if T == 0:
        return y_TN
    bn = block_n(N)
    bias = bias_N.contiguous() if bias_N is not None else weight_ND
    grid = (triton.cdiv(T, BLOCK_M), triton.cdiv(N, bn))
    narrow_tiles_kernel[grid](x_TD, weight_ND, bias, y_TN, T, N, x_TD.stride(0), weight_ND.stride(0), y_TN.stride(0), K,
                              HAS_BIAS=bias_N is not None, IEEE=x_TD.dtype == torch.float32,
                              BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y_TN
