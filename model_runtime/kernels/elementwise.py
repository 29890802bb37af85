"""The small memory-bound steps between the matrix products, as pure functions.

Legend: T = tokens, D = hidden size, H = heads, R = rotary dims, I = MLP width.

Each function repeats the arithmetic (and the dtype casts) of the Hugging Face module it
replaces, so the ``eager`` set is the reference. The ``inductor`` set is the same functions
through ``torch.compile``: one fused Triton kernel each instead of five to ten separate
passes over float32 copies (the RMSNorm alone is eight launches in eager mode). On the 9B
shape these passes move about 17 MB per token unfused, roughly a sixth of the forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of Qwen3.5 / Qwen3-Next: ``(x / rms(x)) * (1 + w)`` in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then zero-centred RMSNorm; returns ``(x + delta, norm(x + delta))``."""
    total = x + delta
    return total, rms_norm(total, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated norm: RMSNorm (float32), times ``w`` in the input dtype, times SiLU(gate)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed) * F.silu(gate.float())).to(dtype)


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
_MATCHED: Elementwise | None = None


# The norms' steps after the mean of squares ``ms`` (float32, one per row, keepdim), in Hugging
# Face's order: ``inductor_matched`` computes ``ms`` in ATen's summation order (mean_square.py)
# and fuses these.
def _rms_norm_from_ms(x: torch.Tensor, ms: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(ms + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def _gated_rms_norm_from_ms(x, ms, gate, weight, eps):
    dtype = x.dtype
    normed = (x.float() * torch.rsqrt(ms + eps)).to(dtype)
    return ((weight * normed) * F.silu(gate.float())).to(dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, D]`` rows: a view when its rows lie at one stride (q/k heads cut from a
    wider projection do), else a copy."""
    D = x.shape[-1]
    if x.stride(-1) == 1 and x.dim() >= 2:
        stride = x.stride(-2)
        expected = stride
        for size, st in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
            if size > 1 and st != expected:
                return x.reshape(-1, D)
            expected *= size
        return x.as_strided((x.numel() // D, D), (stride, 1))
    return x.reshape(-1, D)


def eager() -> Elementwise:
    return EAGER


def _compile_options() -> dict:
    import torch._inductor.config as inductor_config

    return {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}


def inductor_matched() -> Elementwise:
    """``inductor``, except that the norms take their mean of squares from a Triton kernel that
    sums in ATen's order (model_runtime/kernels/mean_square.py), so that they equal Hugging
    Face's eager norms bit for bit on rows of 16 tokens or more (tests/gpu/test_kernels.py)."""
    global _MATCHED
    if _MATCHED is None:
        from model_runtime.kernels.mean_square import mean_square

        fast = inductor()
        options = _compile_options()
        rms_from_ms = torch.compile(_rms_norm_from_ms, dynamic=True, fullgraph=True, options=options)
        gated_from_ms = torch.compile(_gated_rms_norm_from_ms, dynamic=True, fullgraph=True, options=options)

        def rms_norm_matched(x, weight, eps):
            return rms_from_ms(x, mean_square(_rows(x)).view(*x.shape[:-1], 1), weight, eps)

        def add_rms_norm_matched(x, delta, weight, eps):
            D = x.shape[-1]
            total, ms = mean_square(x.reshape(-1, D), delta.reshape(-1, D))
            total = total.view(x.shape)
            return total, rms_from_ms(total, ms.view(*x.shape[:-1], 1), weight, eps)

        def gated_rms_norm_matched(x, gate, weight, eps):
            return gated_from_ms(x, mean_square(_rows(x)).view(*x.shape[:-1], 1), gate, weight, eps)

        _MATCHED = Elementwise("inductor_matched", rms_norm_matched, add_rms_norm_matched, gated_rms_norm_matched,
                               fast.silu_mul, fast.gdn_gates, fast.partial_rope, fast.sigmoid_gate)
    return _MATCHED


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
