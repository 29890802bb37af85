"""The ``--kernels`` option's syntax and kernel families, shared by the settings, the loader and
the workers (no torch import)."""

from __future__ import annotations

# One boundary per family (model_runtime/kernels/), each with its named backends (the registry
# maps every name to its function; tests/unit/test_kernels.py holds the two lists equal).
BACKENDS = {
    "linear_attention": ("reference", "fla"),
    "conv1d": ("reference", "fla", "causal_conv1d", "triton"),
    "attention": ("reference", "sdpa", "sdpa_fused", "varlen", "flash_attn"),
    "head": ("torch", "triton"),
    "elementwise": ("eager", "inductor", "inductor_exact", "triton_exact"),
    "gate_projection": ("row", "segment", "runs", "tiles"),
    "moe_experts": ("tiled", "grouped_mm", "grouped_mm_fused", "grouped_mm_fused_scatter", "expert_tiles",
                    "expert_tiles_silu"),
    "moe_router": ("topk", "select"),
    "moe_shared": ("inline", "stream"),
}
FAMILIES = tuple(BACKENDS)

# Backends whose kernels exist only on CUDA.
CUDA_ONLY = frozenset({"fla", "causal_conv1d", "varlen", "sdpa_fused", "flash_attn", "triton", "inductor_exact", "triton_exact",
                       "grouped_mm", "grouped_mm_fused", "grouped_mm_fused_scatter", "expert_tiles", "expert_tiles_silu",
                       "select", "stream"})


def parse_kernel_overrides(text: str) -> dict[str, str]:
    """``"attention=varlen,head=torch"`` -> ``{"attention": "varlen", "head": "torch"}``.

    The syntax and the family and backend names are checked here, so the CLI refuses a misspelt
    one before anything starts; whether a backend can run on this machine is
    ``registry.check_overrides``'s (the CLI asks it before loading).
    """
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        family, sep, backend = (x.strip() for x in item.partition("="))
        if not sep or not family or not backend:
            raise ValueError(f"expected FAMILY=BACKEND[,FAMILY=BACKEND...], got {item!r}")
        if family in out:
            raise ValueError(f"{family!r} is given twice")
        _check(family, backend)
        out[family] = backend
    return out


def check_kernel_overrides(overrides) -> dict[str, str]:
    """A family -> backend mapping given as one (not as text), checked as ``parse_kernel_overrides`` checks."""
    if not hasattr(overrides, "items"):
        raise ValueError(f"expected FAMILY=BACKEND[,FAMILY=BACKEND...] or a mapping, got {type(overrides).__name__}")
    for family, backend in overrides.items():
        _check(family, backend)
    return dict(overrides)


def _check(family, backend) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    if backend not in BACKENDS[family]:
        raise ValueError(f"unknown {family} backend {backend!r}; known: {', '.join(BACKENDS[family])}")
