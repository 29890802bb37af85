"""The MLP's ``silu(gate) * up`` in one Triton pass, rounding where PyTorch rounds.

Hugging Face computes ``act_fn(gate_proj(x)) * up_proj(x)``: ATen's SiLU in float32
(``g / (1 + exp(-g))`` with CUDA's expf and an IEEE division), rounded to the input dtype, then
the product in float32, rounded again. This kernel does exactly that (``triton_math.silu``),
so its outputs are eager PyTorch's bit for bit (tests/gpu/test_kernels.py). It exists for speed:
on the 9B shape the product streams 4.8 GB per layer per 65k-token row, and this kernel moves it
closer to the H200's bandwidth than Inductor's fused one (bench/elementwise_probe.py).
"""

from __future__ import annotations

import torch

from model_runtime.kernels import triton_math

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use these
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

# (block, warps): elements per program and warps per program; any choice gives the same numbers.
# The default is among the fastest bench/elementwise_probe.py finds on an H200, all within noise.
DEFAULT_TILE = (2048, 4)


def tile_candidates() -> list[tuple[int, int]]:
    """The tiles bench/elementwise_probe.py times: 8 to 32 elements per thread."""
    return [(block, warps) for block in (1024, 2048, 4096, 8192) for warps in (2, 4, 8, 16)
            if 8 <= block // (32 * warps) <= 32]


if triton is not None:
    @triton.jit
    def silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, BLOCK: tl.constexpr, CUDA_MATH: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        g = tl.load(g_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first")
        u = tl.load(u_ptr + offs, mask=ok, other=0.0, eviction_policy="evict_first")
        act = triton_math.silu(g.to(tl.float32), CUDA_MATH).to(g.dtype)  # F.silu's output, in the input dtype
        tl.store(out_ptr + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # PyTorch computes these in float32, as the kernel does


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: contiguous, one shape, one device, and one dtype
    that PyTorch computes in float32 (bf16, fp16 or fp32)."""
    return (gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _DTYPES and gate.is_contiguous()
            and up.is_contiguous() and gate.device == up.device)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """``F.silu(gate) * up`` as eager PyTorch computes it; ``tile`` = ``(block, warps)``."""
    if triton is None:
        raise RuntimeError("the Triton SiLU product needs triton")
    if not supports(gate, up):
        raise ValueError(f"silu_mul takes contiguous gate and up of one shape, dtype (bf16, fp16, fp32) and device; "
                         f"got {tuple(gate.shape)} {gate.dtype} on {gate.device} (contiguous: {gate.is_contiguous()}) "
                         f"and {tuple(up.shape)} {up.dtype} on {up.device} (contiguous: {up.is_contiguous()})")
    block, warps = tile or DEFAULT_TILE
    out = torch.empty_like(gate)
    N = gate.numel()
    meta = dict(BLOCK=block, num_warps=warps, CUDA_MATH=gate.device.type == "cuda",
                **triton_math.aten_rounding_options(gate.device))
    silu_mul_kernel[(triton.cdiv(N, block),)](gate, up, out, N, **meta)
    return out
