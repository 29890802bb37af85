"""Packed replacements for the token mixers of Qwen3.5 / Qwen3-Next decoder layers.

Legend: T = tokens in the (local) row, D = hidden size, H = heads, K/V = key/value head dims,
C = conv channels. Every forward receives the row's ``PackedBatch`` as an argument; nothing
about a row is kept on the module.

``sp`` is an optional sequence-parallel exchange (see ``model_runtime.parallel.ulysses``):
``sp.to_heads(x)`` turns a token shard with all heads into the whole row with this rank's
heads, ``sp.to_tokens(x)`` does the reverse. Without it both are the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime.kernels import KernelBackends
from model_runtime.packing import PackedBatch


def _head_slice(num_heads: int, sp) -> slice:
    return slice(0, num_heads) if sp is None else sp.head_slice(num_heads)


class PackedGatedDeltaNet(nn.Module):
    """Gated DeltaNet over a packed row: conv window and delta-rule state restart per segment.

    Adopts the projections, conv weight, decay parameters and gated norm of a Hugging Face
    ``*GatedDeltaNet`` module. ``fused_projections`` selects Qwen3-Next's interleaved
    ``in_proj_qkvz``/``in_proj_ba`` layout instead of Qwen3.5's separate projections.
    """

    def __init__(self, source: nn.Module, backends: KernelBackends, *, fused_projections: bool):
        super().__init__()
        self.num_k_heads = source.num_k_heads
        self.num_v_heads = source.num_v_heads
        self.head_k_dim = source.head_k_dim
        self.head_v_dim = source.head_v_dim
        self.fused_projections = fused_projections
        if source.activation not in ("silu", "swish"):
            raise ValueError(f"packed GDN supports a SiLU conv activation, got {source.activation!r}")
        if source.conv1d.bias is not None:
            raise ValueError("packed GDN expects a conv1d without bias")
        if fused_projections:
            self.in_proj_qkvz = source.in_proj_qkvz
            self.in_proj_ba = source.in_proj_ba
            self._split_fused = source.fix_query_key_value_ordering
        else:
            self.in_proj_qkv = source.in_proj_qkv
            self.in_proj_z = source.in_proj_z
            self.in_proj_b = source.in_proj_b
            self.in_proj_a = source.in_proj_a
        self.conv1d = source.conv1d
        self.A_log = source.A_log
        self.dt_bias = source.dt_bias
        self.norm = source.norm
        self.out_proj = source.out_proj
        self.conv_fn = backends.fn("conv1d")
        self.delta_rule_fn = backends.fn("linear_attention")

    def _project(self, x_TD: torch.Tensor):
        """Returns pre-conv ``q_THK, k_THK, v_THV``, gate ``z_THV`` and ``b_TH, a_TH``."""
        T = x_TD.shape[0]
        if self.fused_projections:
            # Hugging Face's own de-interleaving of Qwen3-Next's fused projections (reads [B, T, ...]).
            parts = self._split_fused(self.in_proj_qkvz(x_TD)[None], self.in_proj_ba(x_TD)[None])
            q, k, v, z, b, a = (t[0] for t in parts)
            return q, k, v, z, b, a
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = self.in_proj_qkv(x_TD).split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        return (
            q.reshape(T, self.num_k_heads, self.head_k_dim),
            k.reshape(T, self.num_k_heads, self.head_k_dim),
            v.reshape(T, self.num_v_heads, self.head_v_dim),
            self.in_proj_z(x_TD).reshape(T, self.num_v_heads, self.head_v_dim),
            self.in_proj_b(x_TD),
            self.in_proj_a(x_TD),
        )

    def _conv_weight(self, hk: slice, hv: slice) -> torch.Tensor:
        """Conv weight ``[C, W]`` restricted to the channels of key heads ``hk``, value heads ``hv``."""
        w_CW = self.conv1d.weight[:, 0, :]
        if hk == slice(0, self.num_k_heads) and hv == slice(0, self.num_v_heads):
            return w_CW
        K, V, key_dim = self.head_k_dim, self.head_v_dim, self.num_k_heads * self.head_k_dim
        q_part = w_CW[hk.start * K : hk.stop * K]
        k_part = w_CW[key_dim + hk.start * K : key_dim + hk.stop * K]
        v_part = w_CW[2 * key_dim + hv.start * V : 2 * key_dim + hv.stop * V]
        return torch.cat([q_part, k_part, v_part], dim=0)

    def forward(self, x_TD: torch.Tensor, packed: PackedBatch, sp=None) -> torch.Tensor:
        T = x_TD.shape[0]
        q, k, v, z, b, a = self._project(x_TD)
        beta_TH = b.sigmoid()
        # Decay in float32 so a bf16 model cannot round A to -inf.
        g_TH = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if sp is not None:
            q, k, v, g_TH, beta_TH = (sp.to_heads(t) for t in (q, k, v, g_TH, beta_TH))
        hk, hv = _head_slice(self.num_k_heads, sp), _head_slice(self.num_v_heads, sp)
        rows = q.shape[0]
        qkv_TC = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
        qkv_TC = self.conv_fn(qkv_TC, self._conv_weight(hk, hv), packed)
        q, k, v = qkv_TC.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
        o_THV = self.delta_rule_fn(
            q.reshape(rows, -1, self.head_k_dim),
            k.reshape(rows, -1, self.head_k_dim),
            v.reshape(rows, -1, self.head_v_dim),
            g_TH,
            beta_TH,
            packed,
        )
        if sp is not None:
            o_THV = sp.to_tokens(o_THV)
        o = self.norm(o_THV.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(T, -1))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_partial_rope(q_THD, k_THD, cos_TR, sin_TR):
    """Rotary embedding on the first ``R`` dims of every head; the rest pass through."""
    rot = cos_TR.shape[-1]
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]

    def rotate(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)

    return rotate(q_THD), rotate(k_THD)


class PackedAttention(nn.Module):
    """Gated full attention (Qwen3.5 / Qwen3-Next) over a packed row, causal per segment."""

    def __init__(self, source: nn.Module, backends: KernelBackends):
        super().__init__()
        cfg = source.config
        self.head_dim = source.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = source.scaling
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = source.q_proj, source.k_proj, source.v_proj, source.o_proj
        self.q_norm, self.k_norm = source.q_norm, source.k_norm
        self.attention_fn = backends.fn("attention")

    def forward(self, x_TD: torch.Tensor, packed: PackedBatch, rope: tuple, sp=None) -> torch.Tensor:
        T = x_TD.shape[0]
        q, gate = self.q_proj(x_TD).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_partial_rope(q, k, *rope)
        if sp is not None:
            q, k, v = sp.to_heads(q), sp.to_heads_kv(k), sp.to_heads_kv(v)
        o_THD = self.attention_fn(q, k, v, packed, self.scaling)
        if sp is not None:
            o_THD = sp.to_tokens(o_THD)
        o = o_THD.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(o)
