"""The small memory-bound steps between the matrix products, as pure functions.

Legend: T = tokens, D = hidden size, H = heads, R = rotary dims, I = MLP width.

Each function repeats the arithmetic (and the dtype casts) of the Hugging Face module it
replaces, so the ``eager`` set is the reference. The ``inductor`` set is the same functions
through ``torch.compile``: one fused Triton kernel each instead of five to ten separate
passes over float32 copies (the RMSNorm alone is eight launches in eager mode). On the 9B
shape these passes move about 17 MB per token unfused, roughly a sixth of the forward.

Fused norms sum their squares in the fusing compiler's order, not PyTorch's, and land a float32
step away in about 3 of every million bf16 outputs; random 9B weights amplify that to 2.6e-2
mean |logprob| over 32 layers. ``triton_exact`` (the CUDA default) and ``inductor_exact`` sum in
PyTorch's order and so equal ``eager`` bit for bit (tests/gpu/test_kernels.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def _mean_square(x: torch.Tensor, square=None) -> torch.Tensor:
    """``x.float().pow(2).mean(-1, keepdim=True)``: the mean is ATen's reduction, whose float32
    summation order Inductor does not reproduce (norm_triton's kernels do). ``square`` may be a
    fused (compiled) ``_square`` returning a contiguous tensor: one float32 product per element
    either way."""
    return (square or _square)(x).mean(-1, keepdim=True)


def _square(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2)


# Each norm is its mean of squares ``ms`` (float32, one per row, keepdim), then the steps below
# in Hugging Face's order: ``inductor`` fuses all of it, ``inductor_exact`` only these steps.
def _rms_norm_from_ms(x: torch.Tensor, ms: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(ms + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def _gated_rms_norm_from_ms(x, ms, gate, weight, eps):
    dtype = x.dtype
    normed = (x.float() * torch.rsqrt(ms + eps)).to(dtype)
    return ((weight * normed) * F.silu(gate.float())).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of Qwen3.5 / Qwen3-Next: ``(x / rms(x)) * (1 + w)`` in float32."""
    return _rms_norm_from_ms(x, _mean_square(x), weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then zero-centred RMSNorm; returns ``(x + delta, norm(x + delta))``."""
    total = x + delta
    return total, rms_norm(total, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated norm: RMSNorm (float32), times ``w`` in the input dtype, times SiLU(gate)."""
    return _gated_rms_norm_from_ms(x, _mean_square(x), gate, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gdn_gates(a_TH, b_TH, A_log_H, dt_bias_H):
    """Delta-rule log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta = sigmoid(b)``."""
    g_TH = -A_log_H.float().exp() * F.softplus(a_TH.float() + dt_bias_H)
    return g_TH, b_TH.sigmoid()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def partial_rope(q_THD, k_THD, cos_TR, sin_TR):
    """Rotary embedding on the first ``R`` dims of every head; the rest pass through."""
    rot = cos_TR.shape[-1]
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]

    def rotate(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)

    return rotate(q_THD), rotate(k_THD)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * torch.sigmoid(gate)


@dataclass(frozen=True)
class Elementwise:
    """One implementation of every elementwise step; ``name`` is what /v1/models shows."""

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    gdn_gates: Callable
    partial_rope: Callable
    sigmoid_gate: Callable


_FUNCTIONS = ("rms_norm", "add_rms_norm", "gated_rms_norm", "silu_mul", "gdn_gates", "partial_rope", "sigmoid_gate")
EAGER = Elementwise("eager", *(globals()[n] for n in _FUNCTIONS))
_INDUCTOR: Elementwise | None = None
_EXACT: Elementwise | None = None
_TRITON_EXACT: Elementwise | None = None


def eager() -> Elementwise:
    return EAGER


def _compile_options() -> dict:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # Each function is compiled dynamic in its sizes, yet once per layout it meets (q heads cut
    # from a wider projection, rows of heads, whole rows): a process that scores several models
    # or shapes passes the default limit of 8, and fullgraph=True makes that an error.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
            break

    return {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}


def inductor_exact() -> Elementwise:
    """``inductor``, except that each norm takes its mean of squares from ATen (``_mean_square``)
    and Inductor fuses only what follows; every step then rounds as Hugging Face's eager norms do.

    It costs a float32 copy of every norm's squared input (written by one fused kernel, read by
    ATen's mean), a few percent of the 9B benchmark's rate. ``triton_exact`` does the same in one
    pass and falls back to this path where its plan does not apply.
    """
    global _EXACT
    if _EXACT is None:
        fast = inductor()
        options = _compile_options()
        rms_from_ms = torch.compile(_rms_norm_from_ms, dynamic=True, fullgraph=True, options=options)
        gated_from_ms = torch.compile(_gated_rms_norm_from_ms, dynamic=True, fullgraph=True, options=options)
        compiled_square = torch.compile(_square, dynamic=True, fullgraph=True, options=options)

        def square(x):  # ATen's mean then reads the rows as Hugging Face's pow output lays them out
            return compiled_square(x).contiguous()

        def rms_norm_exact(x, weight, eps):
            return rms_from_ms(x, _mean_square(x, square), weight, eps)

        def add_rms_norm_exact(x, delta, weight, eps):
            total = x + delta
            return total, rms_from_ms(total, _mean_square(total, square), weight, eps)

        def gated_rms_norm_exact(x, gate, weight, eps):
            return gated_from_ms(x, _mean_square(x, square), gate, weight, eps)

        _EXACT = Elementwise("inductor_exact", rms_norm_exact, add_rms_norm_exact, gated_rms_norm_exact,
                             fast.silu_mul, fast.gdn_gates, fast.partial_rope, fast.sigmoid_gate)
    return _EXACT


_WARNED: set[str] = set()


def _warn_once(what: str) -> None:
    """Logs, once per kind of operand, that triton_exact passed a CUDA step to Inductor's kernel
    (as exact, slower): nothing this model runs should reach it."""
    if what not in _WARNED:
        _WARNED.add(what)
        log.warning("triton_exact: %s is not one the Triton kernel takes; Inductor's kernel runs it", what)


def triton_exact() -> Elementwise:
    """``inductor_exact``'s arithmetic with each norm in one Triton kernel (``norm_triton``) that
    sums its squares in ATen's order: Hugging Face's outputs bit for bit without the float32 copy
    of the squares; the MLP's SiLU product is ``pointwise_triton``'s kernel (also exact).
    A norm whose width no Triton plan reproduces (calibrated once per width
    against ATen on this GPU; the tiny test models' widths) or with fewer than 16 rows takes
    ``inductor_exact``'s path, which is exact too.

    The CUDA default: no slower than ``inductor`` on the 9B benchmark, and equal to Hugging Face
    where ``inductor``'s sums drift (figures in docs/benchmarks.md).
    """
    global _TRITON_EXACT
    if _TRITON_EXACT is None:
        from model_runtime.kernels import norm_triton as NT
        from model_runtime.kernels import pointwise_triton as PT

        exact = inductor_exact()

        def plan(x, weight, other=None):
            """The Triton plan for this norm, or None for ``inductor_exact``'s path (CPU tensors,
            fewer than 16 rows, a width no plan reproduces, operands the kernels do not take)."""
            if not x.is_cuda or x.numel() < 16 * x.shape[-1] or not NT.supports(x, weight, other):
                return None
            return NT.plan_for(x.shape[-1], x.device.index or 0)

        def rms_norm_triton(x, weight, eps):
            p = plan(x, weight)
            return exact.rms_norm(x, weight, eps) if p is None else NT.rms_norm(x, weight, eps, plan=p)

        def add_rms_norm_triton(x, delta, weight, eps):
            p = plan(x, weight, delta)
            return exact.add_rms_norm(x, delta, weight, eps) if p is None else NT.rms_norm(x, weight, eps, delta, plan=p)

        def gated_rms_norm_triton(x, gate, weight, eps):
            p = plan(x, weight) if gate.shape == x.shape else None  # the kernel reads the gate in any dtype
            return exact.gated_rms_norm(x, gate, weight, eps) if p is None else NT.gated_rms_norm(x, gate, weight, eps, plan=p)

        def silu_mul_triton(gate, up):
            if gate.is_cuda and PT.supports(gate, up):
                return PT.silu_mul(gate, up)
            if gate.is_cuda:
                _warn_once(f"SiLU product of {gate.dtype} {tuple(gate.stride())} and {up.dtype} {tuple(up.stride())}")
            return exact.silu_mul(gate, up)

        _TRITON_EXACT = Elementwise("triton_exact", rms_norm_triton, add_rms_norm_triton, gated_rms_norm_triton,
                                    silu_mul_triton, exact.gdn_gates, exact.partial_rope, exact.sigmoid_gate)
    return _TRITON_EXACT


def inductor() -> Elementwise:
    """The same functions compiled once per process (dynamic in the token count).

    ``emulate_precision_casts`` makes the fused kernels round where eager PyTorch rounds
    (after the bf16 residual add, before the bf16 weight product), so they stay within float32
    rounding of the Hugging Face modules instead of drifting by a bf16 ulp.
    """
    global _INDUCTOR
    if _INDUCTOR is None:
        options = _compile_options()
        compiled = [torch.compile(globals()[n], dynamic=True, fullgraph=True, options=options) for n in _FUNCTIONS]
        _INDUCTOR = Elementwise("inductor", *compiled)
    return _INDUCTOR
