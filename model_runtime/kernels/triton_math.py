"""Eager PyTorch's float32 math for Triton kernels that must round exactly as it does.

ATen's CUDA kernels are built by nvcc without fast math: ``expf`` and ``rsqrtf`` are libdevice's
accurate functions, denormals kept, and ``/`` is an IEEE division (``div.rn``). The kernels that
call these helpers compile with ``enable_reflect_ftz=False`` so that libdevice keeps denormals
too. With ``CUDA_MATH=False`` (Triton's CPU interpreter, which has no libdevice) NumPy's
functions stand in, so the interpreter tests check the order of operations, not the last bit.
"""

from __future__ import annotations


def aten_rounding_options(device) -> dict:
    """Compiler options of a kernel that must round as ATen's do: on CUDA no FMA contraction
    (ATen rounds every step) and libdevice without flush-to-zero (as nvcc builds ATen); none
    elsewhere (Triton's interpreter takes no compiler options)."""
    return dict(enable_fp_fusion=False, enable_reflect_ftz=False) if device.type == "cuda" else {}


try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use these
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def rsqrt(x, CUDA_MATH: tl.constexpr):
        """CUDA's rsqrtf (what ATen and Inductor call)."""
        if CUDA_MATH:
            return libdevice.rsqrt(x)
        else:
            return tl.math.rsqrt(x)

    @triton.jit
    def silu(g, CUDA_MATH: tl.constexpr):
        """ATen's SiLU in float32: ``g / (1 + exp(-g))`` with CUDA's expf and an IEEE division."""
        if CUDA_MATH:
            return tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
        else:
            return tl.math.div_rn(g, 1.0 + tl.exp(-g))

    @triton.jit
    def sigmoid(g, CUDA_MATH: tl.constexpr):
        """ATen's sigmoid in float32: ``1 / (1 + exp(-g))`` with CUDA's expf and an IEEE division."""
        if CUDA_MATH:
            return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-g))
        else:
            return tl.math.div_rn(1.0, 1.0 + tl.exp(-g))
