"""Kernel boundary: one function per family, each with a named backend.

Families: ``linear_attention`` (gated delta rule), ``conv1d`` (causal depthwise conv) and
``attention`` (causal full attention). Every fast backend has an exact PyTorch reference beside
it; tests compare them on fresh random inputs.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from model_runtime.kernels.attention import (
    causal_attention_flash,
    causal_attention_reference,
    causal_attention_sdpa,
    causal_attention_varlen,
)
from model_runtime.kernels.conv import causal_conv1d_fla, causal_conv1d_reference, causal_conv1d_tridao
from model_runtime.kernels.linear_attention import gated_delta_rule_fla, gated_delta_rule_reference

log = logging.getLogger(__name__)

FAMILIES = ("linear_attention", "conv1d", "attention")

REGISTRY: dict[str, dict[str, Callable]] = {
    "linear_attention": {"reference": gated_delta_rule_reference, "fla": gated_delta_rule_fla},
    "conv1d": {"reference": causal_conv1d_reference, "fla": causal_conv1d_fla, "causal_conv1d": causal_conv1d_tridao},
    "attention": {
        "reference": causal_attention_reference,
        "sdpa": causal_attention_sdpa,
        "varlen": causal_attention_varlen,
        "flash_attn": causal_attention_flash,
    },
}

# Backends that run on a GPU without a per-segment Python loop, best first.
_GPU_PREFERENCE = {
    "linear_attention": ("fla",),
    "conv1d": ("causal_conv1d", "fla"),
    "attention": ("flash_attn", "varlen"),
}
# Backends that loop over segments in Python: exact everywhere, slow on a GPU.
SLOW_BACKENDS = frozenset({"reference", "sdpa"})


class SlowKernelError(RuntimeError):
    """A GPU run would have to use a per-segment reference kernel."""


@dataclass(frozen=True)
class KernelBackends:
    """The backend chosen for every family; ``names`` is what /v1/models and metrics show."""

    linear_attention: str = "reference"
    conv1d: str = "reference"
    attention: str = "reference"
    fallbacks: tuple[str, ...] = field(default=())

    def __post_init__(self):
        for family in FAMILIES:
            name = getattr(self, family)
            if name not in REGISTRY[family]:
                raise ValueError(f"unknown {family} backend {name!r}; known: {sorted(REGISTRY[family])}")

    @property
    def names(self) -> dict[str, str]:
        return {family: getattr(self, family) for family in FAMILIES}

    def fn(self, family: str) -> Callable:
        return REGISTRY[family][getattr(self, family)]


def _available(family: str, name: str) -> bool:
    if name == "fla":
        return importlib.util.find_spec("fla") is not None
    if name == "causal_conv1d":
        return importlib.util.find_spec("causal_conv1d") is not None
    if name == "flash_attn":
        return importlib.util.find_spec("flash_attn") is not None
    if name == "varlen":
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return True


def select_backends(
    device: torch.device | str,
    *,
    allow_slow: bool = False,
    overrides: dict[str, str] | None = None,
) -> KernelBackends:
    """Chooses the kernels for ``device``.

    On CPU every family uses its exact reference. On CUDA the fastest installed backend is
    taken; if a family has none, this raises ``SlowKernelError`` unless ``allow_slow``, in
    which case the reference is used, logged as a warning and recorded in ``fallbacks``.
    ``overrides`` pins a family to a named backend (tests and benchmarks).
    """
    device = torch.device(device)
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; known: {list(FAMILIES)}")
    chosen: dict[str, str] = {}
    fallbacks: list[str] = []
    for family in FAMILIES:
        if family in overrides:
            chosen[family] = overrides[family]
            continue
        if device.type != "cuda":
            chosen[family] = "reference"
            continue
        for name in _GPU_PREFERENCE[family]:
            if _available(family, name):
                chosen[family] = name
                break
        else:
            wanted = " or ".join(_GPU_PREFERENCE[family])
            message = (
                f"no fast {family} kernel is installed for CUDA (wanted {wanted}); install the 'gpu' extra "
                "(pip install 'packscore[gpu]') or pass --allow-slow-kernels to run the per-sequence reference"
            )
            if not allow_slow:
                raise SlowKernelError(message)
            log.warning("%s; using the slow reference kernel", message)
            chosen[family] = "reference"
            fallbacks.append(family)
    return KernelBackends(**chosen, fallbacks=tuple(fallbacks))
