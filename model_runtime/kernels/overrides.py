"""The ``--kernels`` option's syntax and kernel families, shared by the settings, the loader and
the workers (no torch import)."""

from __future__ import annotations

# One boundary per family (model_runtime/kernels/); each has named backends.
FAMILIES = ("linear_attention", "conv1d", "attention", "head", "elementwise", "gate_projection", "moe_experts",
            "moe_router", "moe_shared")


def parse_kernel_overrides(text: str) -> dict[str, str]:
    """``"attention=varlen,head=torch"`` -> ``{"attention": "varlen", "head": "torch"}``.

    The syntax and the family names are checked here (so the CLI refuses a misspelt family
    before any worker starts); the loader names an unknown backend.
    """
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        family, sep, backend = (x.strip() for x in item.partition("="))
        if not sep or not family or not backend:
            raise ValueError(f"expected FAMILY=BACKEND[,FAMILY=BACKEND...], got {item!r}")
        if family in out:
            raise ValueError(f"{family!r} is given twice")
        if family not in FAMILIES:
            raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
        out[family] = backend
    return out
