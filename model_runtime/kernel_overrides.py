"""The ``--kernels`` option's syntax, shared by the settings and the workers (no torch import)."""

from __future__ import annotations


def parse_kernel_overrides(text: str) -> dict[str, str]:
    """``"attention=varlen,head=torch"`` -> ``{"attention": "varlen", "head": "torch"}``.

    Only the syntax is checked here; the loader names an unknown family or backend.
    """
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        family, sep, backend = (x.strip() for x in item.partition("="))
        if not sep or not family or not backend:
            raise ValueError(f"expected FAMILY=BACKEND[,FAMILY=BACKEND...], got {item!r}")
        if family in out:
            raise ValueError(f"{family!r} is given twice")
        out[family] = backend
    return out
