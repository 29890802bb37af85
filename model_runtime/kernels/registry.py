"""Kernel boundary: one function per family, each with a named backend.

Families: ``linear_attention`` (gated delta rule), ``conv1d`` (causal depthwise conv),
``attention`` (causal full attention), ``head`` (log-probability and entropy of a chunk of
logits), ``elementwise`` (norms, gates, rotary, SiLU between the matrix products; its
registry entries return the whole function set) and ``gate_projection`` (the narrow gate
products: GDN decay/beta, MoE router and shared gate; per row, per segment or per run of
segments, or in fixed tiles), ``moe_experts`` (a sparse-MoE block's
routed experts, each token's output independent of the row's size) and ``moe_router`` (the
router's top-k, ``torch.topk``'s answer) and ``moe_shared`` (where the shared expert runs: on the
current stream, or beside the routed experts on a second one). Every fast backend has an exact PyTorch reference
beside it; tests compare them on fresh random inputs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from model_runtime.kernels.attention import (
    causal_attention_flash,
    causal_attention_reference,
    causal_attention_sdpa,
    causal_attention_sdpa_fused,
    causal_attention_varlen,
)
from model_runtime.kernels import elementwise
from model_runtime.kernels.conv import causal_conv1d_fla, causal_conv1d_reference, causal_conv1d_tridao
from model_runtime.kernels.conv_triton import causal_conv1d_silu_triton
from model_runtime.kernels.gate_projection import (
    gate_projection_row,
    gate_projection_runs,
    gate_projection_segment,
    gate_projection_tiles,
)
from model_runtime.kernels.linear_attention import gated_delta_rule_fla, gated_delta_rule_reference
from model_runtime.kernels.moe_experts import (
    experts_grouped_mm,
    experts_grouped_mm_fused,
    experts_expert_tiles,
    experts_expert_tiles_silu,
    experts_grouped_mm_fused_scatter,
    experts_tiled,
    shared_inline,
    shared_side_stream,
)
from model_runtime.kernels.moe_router import top_k_select, top_k_torch
from model_runtime.kernels.logprob_head import logprob_entropy_torch, logprob_entropy_triton
from model_runtime.kernels.overrides import CUDA_ONLY, FAMILIES  # one list for the CLI and the registry

log = logging.getLogger(__name__)

REGISTRY: dict[str, dict[str, Callable]] = {
    "linear_attention": {"reference": gated_delta_rule_reference, "fla": gated_delta_rule_fla},
    "conv1d": {"reference": causal_conv1d_reference, "fla": causal_conv1d_fla, "causal_conv1d": causal_conv1d_tridao,
               "triton": causal_conv1d_silu_triton},
    "attention": {
        "reference": causal_attention_reference,
        "sdpa": causal_attention_sdpa,
        "sdpa_fused": causal_attention_sdpa_fused,
        "varlen": causal_attention_varlen,
        "flash_attn": causal_attention_flash,
    },
    "head": {"torch": logprob_entropy_torch, "triton": logprob_entropy_triton},
    "elementwise": {"eager": elementwise.eager, "inductor": elementwise.inductor,
                    "inductor_exact": elementwise.inductor_exact, "triton_exact": elementwise.triton_exact},
    "gate_projection": {"row": gate_projection_row, "segment": gate_projection_segment, "runs": gate_projection_runs,
                        "tiles": gate_projection_tiles},
    "moe_experts": {"tiled": experts_tiled, "grouped_mm": experts_grouped_mm, "grouped_mm_fused": experts_grouped_mm_fused,
                    "grouped_mm_fused_scatter": experts_grouped_mm_fused_scatter, "expert_tiles": experts_expert_tiles,
                    "expert_tiles_silu": experts_expert_tiles_silu},
    "moe_router": {"topk": top_k_torch, "select": top_k_select},
    "moe_shared": {"inline": shared_inline, "stream": shared_side_stream},
}
# What a CPU run uses: the exact per-segment references, and plain PyTorch for the rest.
_CPU_DEFAULT = {
    "linear_attention": "reference",
    "conv1d": "reference",
    "attention": "reference",
    "head": "torch",
    "elementwise": "eager",
    "gate_projection": "segment",
    "moe_experts": "tiled",
    "moe_router": "topk",
    "moe_shared": "inline",
}


# The fast backends on a GPU, best first. Attention differs by where the model runs (figures in
# docs/benchmarks.md):
# - in the serving process (one GPU): SDPA per segment, the faster there and, being Hugging
#   Face's own call for one sequence, the closer to it;
# - in the worker pool's processes: the varlen kernel, since there SDPA per segment is slower, for
#   a reason not found yet (the pool's runner alone is as fast as Scorer with either kernel).
_GPU_PREFERENCE = {
    "linear_attention": ("fla",),
    # causal_conv1d, when installed, is also what Hugging Face calls (SiLU inside the kernel);
    # otherwise Hugging Face convolves, rounds, then applies SiLU, which the Triton kernel does in
    # one pass, equal to fla's conv plus ATen's SiLU bit for bit and faster.
    "conv1d": ("causal_conv1d", "triton", "fla"),
    # sdpa_fused: the same SDPA calls, with the rotary embedding, the padding and the output gate
    # in two Triton passes (equal bit for bit); always there: flash_attn and varlen only by --kernels
    "attention": ("sdpa_fused", "sdpa"),
    "head": ("triton",),
    # triton_exact: Hugging Face's arithmetic bit for bit (norms summed in ATen's order and the
    # MLP's SiLU product by Triton, the rest fused by Inductor), and no slower than inductor, whose
    # own norms sum in another order (--kernels elementwise=inductor) that 32 layers amplify.
    "elementwise": ("triton_exact",),
    # runs: segment's numbers bit for bit, consecutive segments in one product where the product was
    # measured at start not to round by row count or place (the 35B-A3B's router and decay/beta).
    # tiles (every member of a group shares its prompt, not Hugging Face's rounding): by --kernels only.
    "gate_projection": ("runs", "segment"),
    # grouped_mm_fused(_scatter): grouped_mm's arithmetic bit for bit, CUTLASS's products with the
    # steps around them in Triton; scatter writes the products' rows from the tokens' side. CUTLASS
    # keeps the products: Triton's give the same numbers in a slower block (docs/moe.md).
    # expert_tiles: the same numbers again, both products in packscore's CUTLASS kernel over a
    # tile-aligned layout (faster than grouped_mm's on an H200, docs/moe.md); where its library is built.
    # expert_tiles_silu: the SiLU product in the gate/up epilogue, one pass over the products'
    # outputs fewer (the same bits, and faster: docs/moe.md).
    "moe_experts": ("expert_tiles_silu", "expert_tiles", "grouped_mm_fused_scatter", "grouped_mm_fused", "grouped_mm"),
    # select: torch.topk's answer, its radix select replaced by one Triton pass.
    "moe_router": ("select", "topk"),
    # inline: a second stream (--kernels moe_shared=stream) has not paid: no faster within the runs' spread (docs/moe.md).
    "moe_shared": ("inline",),
}
_POOL_GPU_PREFERENCE = {**_GPU_PREFERENCE, "attention": ("flash_attn", "varlen", "sdpa")}


# The experts backends that run packscore's CUTLASS library (``expert_gemm``).
EXPERT_GEMM_BACKENDS = frozenset({"expert_tiles", "expert_tiles_silu"})


class SlowKernelError(RuntimeError):
    """A GPU run would have to use a per-segment reference kernel."""


@dataclass(frozen=True)
class KernelBackends:
    """The backend chosen for every family; ``names`` is what /v1/models and metrics show."""

    linear_attention: str = "reference"
    conv1d: str = "reference"
    attention: str = "reference"
    head: str = "torch"
    elementwise: str = "eager"
    gate_projection: str = "segment"
    moe_experts: str = "tiled"
    moe_router: str = "topk"
    moe_shared: str = "inline"
    fallbacks: tuple[str, ...] = field(default=())
    # The library file the ``expert_tiles`` experts load (``expert_gemm.library_path``), bound into
    # their function by ``fn``; None: resolved where they run.
    expert_gemm: Path | None = None

    def __post_init__(self):
        for family in FAMILIES:
            name = getattr(self, family)
            if name not in REGISTRY[family]:
                raise ValueError(f"unknown {family} backend {name!r}; known: {sorted(REGISTRY[family])}")

    @property
    def names(self) -> dict[str, str]:
        return {family: getattr(self, family) for family in FAMILIES}

    def fn(self, family: str) -> Callable:
        fn = REGISTRY[family][getattr(self, family)]
        if family == "moe_experts" and self.moe_experts in EXPERT_GEMM_BACKENDS and self.expert_gemm is not None:
            return functools.partial(fn, library=self.expert_gemm)
        return fn


# The module each optional backend is imported from; importing it (not only finding it) is
# the availability test, so a package that is present but broken counts as missing.
_BACKEND_MODULES = {
    "fla": ("fla.ops.gated_delta_rule",),
    "causal_conv1d": ("causal_conv1d",),
    "flash_attn": ("flash_attn",),
    "varlen": ("torch.nn.attention.varlen",),
    "triton": ("triton",),
    "sdpa_fused": ("triton",),
    "inductor": ("triton", "torch._inductor"),
    "inductor_exact": ("triton", "torch._inductor"),
    "triton_exact": ("triton", "torch._inductor"),
    "grouped_mm_fused": ("triton",),
    "grouped_mm_fused_scatter": ("triton",),
    "expert_tiles": ("triton",),
    "expert_tiles_silu": ("triton",),
    "select": ("triton",),
}


def _unavailable_reason(family: str, name: str, expert_gemm_library: Path | None = None, *,
                        load: bool = True) -> str | None:
    """``None`` when backend ``name`` of ``family`` can run here (the ``expert_tiles`` experts with
    ``expert_gemm_library``, ``expert_gemm.library_path``), else why not; ``load=False`` only looks
    for its modules' packages, without importing them."""
    modules = _BACKEND_MODULES.get(name, ())
    if family == "moe_experts" and name.startswith("grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no grouped matrix product"
    if family == "moe_experts" and name in EXPERT_GEMM_BACKENDS:
        from model_runtime.kernels import expert_gemm

        reason = expert_gemm.unavailable_reason(expert_gemm_library)
        if reason is not None:
            return reason
        failed = expert_gemm.silu_layout_check(expert_gemm_library) if name == "expert_tiles_silu" else 0
        if failed:
            return f"the expert GEMM library's SiLU layout check failed ({failed})"
    if family == "conv1d" and name == "fla":
        modules = ("fla.modules",)
    for module in modules:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module.split('.')[0]} is not installed"
        if not load:
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # a broken install must not pass for a working one
            return f"importing {module} failed: {type(err).__name__}: {err}"
    return None


def check_overrides(device: torch.device | str, overrides: dict[str, str], expert_gemm: str | Path | None = None) -> None:
    """Raises ``ValueError`` naming the first ``--kernels`` pin that cannot run on ``device`` here (a
    CUDA-only backend elsewhere, a missing or broken module; ``expert_tiles`` with the library
    ``expert_gemm``, ``--expert-gemm``); the CLI asks before loading or binding."""
    device = torch.device(device)
    unknown = set(overrides) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; known: {list(FAMILIES)}")
    for family, name in overrides.items():
        if device.type != "cuda" and name in CUDA_ONLY:
            raise ValueError(f"the {family} backend {name!r} needs CUDA; on {device.type} use one of "
                             f"{sorted(set(REGISTRY[family]) - CUDA_ONLY)}")
        if name in REGISTRY[family]:  # an unknown name is refused with the known ones by KernelBackends
            reason = _unavailable_reason(family, name, expert_gemm)
            if reason is not None:
                raise ValueError(f"the {family} backend {name!r} cannot run here: {reason}")


def select_backends(
    device: torch.device | str,
    *,
    allow_slow: bool = False,
    overrides: dict[str, str] | None = None,
    worker_pool: bool = False,
    expert_gemm: str | Path | None = None,
) -> KernelBackends:
    """Chooses the kernels for ``device``.

    On CPU every family uses its exact reference. On CUDA the fastest installed backend is
    taken (``worker_pool``: the fastest in a worker pool's process); if a family has none, this
    raises ``SlowKernelError`` unless ``allow_slow``, in which case the reference is used,
    logged as a warning and recorded in ``fallbacks``. ``overrides`` pins a family to a named
    backend (``--kernels``, tests and benchmarks). ``expert_gemm`` names the experts' CUTLASS
    library (``--expert-gemm``; None: ``expert_gemm.library_path()``'s default).
    """
    preference = _POOL_GPU_PREFERENCE if worker_pool else _GPU_PREFERENCE
    device = torch.device(device)
    library = None  # the experts' CUTLASS library, resolved once where it may run: the backend loads this file
    if device.type == "cuda":
        from model_runtime.kernels.expert_gemm import library_path

        library = library_path(expert_gemm)
    overrides = dict(overrides or {})
    check_overrides(device, overrides, library)
    chosen: dict[str, str] = {}
    fallbacks: list[str] = []
    for family in FAMILIES:
        if family in overrides:
            chosen[family] = overrides[family]  # an unknown name is refused by KernelBackends below
            continue
        if device.type != "cuda":
            chosen[family] = _CPU_DEFAULT[family]
            continue
        name, reasons = _fastest(family, preference[family], lambda f, n: _unavailable_reason(f, n, library))
        if name is not None:
            chosen[family] = name
            if reasons:  # a faster backend was skipped: say why, once, at start
                log.info("%s: using %s (%s)", family, name, "; ".join(reasons))
            continue
        message = _no_fast_kernel(family, preference[family], reasons)
        if not allow_slow:
            raise SlowKernelError(message)
        log.warning("%s; using the slow reference kernel", message)
        chosen[family] = _CPU_DEFAULT[family]
        fallbacks.append(family)
    experts_library = library if chosen["moe_experts"] in EXPERT_GEMM_BACKENDS else None
    return KernelBackends(**chosen, fallbacks=tuple(fallbacks), expert_gemm=experts_library)


def check_fast_kernels(
    device: torch.device | str, *, allow_slow: bool = False, overrides: dict[str, str] | None = None,
    worker_pool: bool = False,
) -> None:
    """Raises ``SlowKernelError`` where ``select_backends`` would for want of an import (``fla``
    missing or broken on CUDA without ``allow_slow``), without a GPU: the CLI asks before the port
    is bound. The experts' CUTLASS backends count as usable here, since probing their library runs
    on the GPU; ``select_backends`` decides them when the model loads. For a worker pool only the
    packages are looked for: importing fla starts CUDA in the process that leaves the GPUs to its
    workers, which import it and say a broken install as they load."""
    if allow_slow or torch.device(device).type != "cuda":
        return
    preference = _POOL_GPU_PREFERENCE if worker_pool else _GPU_PREFERENCE

    def reason(family: str, name: str) -> str | None:
        return None if name in EXPERT_GEMM_BACKENDS else _unavailable_reason(family, name, load=not worker_pool)

    for family in FAMILIES:
        if family not in (overrides or {}):
            name, reasons = _fastest(family, preference[family], reason)
            if name is None:
                raise SlowKernelError(_no_fast_kernel(family, preference[family], reasons))


def _fastest(family: str, preference: tuple[str, ...], reason_of: Callable) -> tuple[str | None, list[str]]:
    """The first backend of ``preference`` that ``reason_of(family, name)`` finds no reason against
    (None: none), and the reasons against those before it."""
    reasons = []
    for name in preference:
        reason = reason_of(family, name)
        if reason is None:
            return name, reasons
        reasons.append(f"{name}: {reason}")
    return None, reasons


def _no_fast_kernel(family: str, preference: tuple[str, ...], reasons: list[str]) -> str:
    return (f"no fast {family} kernel is usable on CUDA (wanted {' or '.join(preference)}; {'; '.join(reasons)}); "
            "install the 'gpu' extra (pip install 'packscore[gpu]') or pass --allow-slow-kernels to run the slow "
            "reference")
