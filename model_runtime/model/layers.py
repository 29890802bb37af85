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
from torch import nn

from model_runtime.kernels.attention import ROPE_AND_GATE
from model_runtime.kernels.elementwise import EAGER, Elementwise
from model_runtime.kernels.gate_projection import NO_RUNS, RunLimits, narrow_products, row_invariant, shard_segments
from model_runtime.kernels.registry import KernelBackends
from model_runtime.model.packing import PackedBatch

# Hugging Face classes whose arithmetic the fused elementwise functions reproduce. Anything
# else (a future norm with another formula) keeps running as its own module.
ZERO_CENTRED_NORMS = frozenset({"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm"})
GATED_NORMS = frozenset({"Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "Qwen3NextRMSNormGated"})
DENSE_MLPS = frozenset({"Qwen3_5MLP", "Qwen3_5MoeMLP", "Qwen3NextMLP"})


def _head_slice(num_heads: int, sp) -> slice:
    return slice(0, num_heads) if sp is None else sp.head_slice(num_heads)


def mlp_forward(mlp: nn.Module, h_TD: torch.Tensor) -> torch.Tensor:
    """Runs a Hugging Face MLP or sparse-MoE block on ``[T, D]`` rows."""
    # Hugging Face's sparse MoE blocks read [batch, seq, dim]; some versions also return router logits.
    out = mlp(h_TD.unsqueeze(0))
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(h_TD.shape)


class ModuleOps:
    """Runs the norms and MLPs of a Hugging Face model, fused where the backend allows.

    With the ``eager`` elementwise backend every call is the Hugging Face module itself (the
    CPU reference path). With a fused backend, modules of the classes above go through the
    fused functions with the module's own weights; others still run as modules.
    """

    def __init__(self, ew: Elementwise = EAGER):
        self.ew = ew
        self.fused = ew.name != "eager"

    def norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.fused and type(module).__name__ in ZERO_CENTRED_NORMS:
            return self.ew.rms_norm(x, module.weight, module.eps)
        return module(x)

    def add_norm(self, module: nn.Module, x: torch.Tensor, delta: torch.Tensor):
        """``(x + delta, norm(x + delta))``: the residual add and the next norm in one pass."""
        if self.fused and type(module).__name__ in ZERO_CENTRED_NORMS:
            return self.ew.add_rms_norm(x, delta, module.weight, module.eps)
        x = x + delta
        return x, module(x)

    def gated_norm(self, module: nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fused and type(module).__name__ in GATED_NORMS and module.activation in ("silu", "swish"):
            return self.ew.gated_rms_norm(x, gate, module.weight, module.variance_epsilon)
        return module(x, gate)

    def mlp(self, mlp: nn.Module, h_TD: torch.Tensor) -> torch.Tensor:
        if self.fused and type(mlp).__name__ in DENSE_MLPS and _is_silu(mlp.act_fn):
            return mlp.down_proj(self.ew.silu_mul(mlp.gate_proj(h_TD), mlp.up_proj(h_TD)))
        return mlp_forward(mlp, h_TD)


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _adopt(target: nn.Module, source: nn.Module, *names: str) -> None:
    """Gives ``target`` these attributes of ``source``: its modules and parameters are shared, not copied."""
    for name in names:
        setattr(target, name, getattr(source, name))


class PackedGatedDeltaNet(nn.Module):
    """Gated DeltaNet over a packed row: conv window and delta-rule state restart per segment.

    Adopts the projections, conv weight, decay parameters and gated norm of a Hugging Face
    ``*GatedDeltaNet`` module. ``fused_projections`` selects Qwen3-Next's interleaved
    ``in_proj_qkvz``/``in_proj_ba`` layout instead of Qwen3.5's separate projections.
    """

    def __init__(self, source: nn.Module, backends: KernelBackends, *, fused_projections: bool):
        super().__init__()
        _adopt(self, source, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
        self.fused_projections = fused_projections
        if source.activation not in ("silu", "swish"):
            raise ValueError(f"packed GDN supports a SiLU conv activation, got {source.activation!r}")
        if source.conv1d.bias is not None:
            raise ValueError("packed GDN expects a conv1d without bias")
        if fused_projections:
            _adopt(self, source, "in_proj_qkvz", "in_proj_ba")
            self._split_fused = source.fix_query_key_value_ordering
        else:
            _adopt(self, source, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        _adopt(self, source, "conv1d", "A_log", "dt_bias", "norm", "out_proj")
        self.conv_fn = backends.fn("conv1d")
        self.delta_rule_fn = backends.fn("linear_attention")
        self.gate_projection_fn = backends.fn("gate_projection")
        self.run_limits = NO_RUNS  # rows a narrow product may span under ``runs``: ``use_run_limits``
        self.ops = ModuleOps(backends.fn("elementwise")())

    def narrow_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights of the narrow gate products, whose rounding follows the sequence's length
        (``model_runtime.scoring.rounding``); none with a row-invariant backend (``tiles``)."""
        if row_invariant(self.gate_projection_fn):
            return ()
        return (self.in_proj_ba.weight,) if self.fused_projections else (self.in_proj_a.weight, self.in_proj_b.weight)

    def use_run_limits(self, limits: RunLimits) -> None:
        """The rows one narrow product may span under the ``runs`` backend (``rounding.prepare_runs``)."""
        self.run_limits = limits

    def _gate_products(self, linears, x_TD: torch.Tensor, packed: PackedBatch, sp) -> tuple[torch.Tensor, ...]:
        """The narrow gate products of ``linears`` per segment (``narrow_products``); under ``sp``
        over the segments within this rank's tokens."""
        return narrow_products(self.gate_projection_fn, linears, x_TD, packed, shard_segments(x_TD, packed, sp),
                               self.run_limits)

    def _project(self, x_TD: torch.Tensor, packed: PackedBatch, sp):
        """Returns pre-conv ``q_THK, k_THK, v_THV``, gate ``z_THV`` and ``b_TH, a_TH``."""
        T = x_TD.shape[0]
        if self.fused_projections:
            (ba,) = self._gate_products((self.in_proj_ba,), x_TD, packed, sp)
            # Hugging Face's own de-interleaving of Qwen3-Next's fused projections (reads [B, T, ...]).
            parts = self._split_fused(self.in_proj_qkvz(x_TD)[None], ba[None])
            q, k, v, z, b, a = (t[0] for t in parts)
            return q, k, v, z, b, a
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = self.in_proj_qkv(x_TD).split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        a, b = self._gate_products((self.in_proj_a, self.in_proj_b), x_TD, packed, sp)
        return (
            q.reshape(T, self.num_k_heads, self.head_k_dim),
            k.reshape(T, self.num_k_heads, self.head_k_dim),
            v.reshape(T, self.num_v_heads, self.head_v_dim),
            self.in_proj_z(x_TD).reshape(T, self.num_v_heads, self.head_v_dim),
            b,
            a,
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
        if sp is None and not self.fused_projections:
            q, k, v, z, g_TH, beta_TH = self._mix_qkv_local(x_TD, packed)
        else:
            q, k, v, z, g_TH, beta_TH = self._mix_qkv_split(x_TD, packed, sp)
        o_THV = self.delta_rule_fn(q, k, v, g_TH, beta_TH, packed)
        if sp is not None:
            o_THV = sp.to_tokens(o_THV)
        o = self.ops.gated_norm(self.norm, o_THV.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(T, -1))

    def _mix_qkv_local(self, x_TD: torch.Tensor, packed: PackedBatch):
        """Qwen3.5 layout on one rank: the conv reads ``in_proj_qkv``'s output as it comes."""
        T = x_TD.shape[0]
        key_dim = self.num_k_heads * self.head_k_dim
        splits = (key_dim, key_dim, self.num_v_heads * self.head_v_dim)
        q, k, v = self.conv_fn(self.in_proj_qkv(x_TD), self.conv1d.weight[:, 0, :], packed, splits=splits)
        z = self.in_proj_z(x_TD).reshape(T, self.num_v_heads, self.head_v_dim)
        a_TH, b_TH = self._gate_products((self.in_proj_a, self.in_proj_b), x_TD, packed, None)
        g_TH, beta_TH = self.ops.ew.gdn_gates(a_TH, b_TH, self.A_log, self.dt_bias)
        return (
            q.reshape(T, self.num_k_heads, self.head_k_dim),
            k.reshape(T, self.num_k_heads, self.head_k_dim),
            v.reshape(T, self.num_v_heads, self.head_v_dim),
            z,
            g_TH,
            beta_TH,
        )

    def _mix_qkv_split(self, x_TD: torch.Tensor, packed: PackedBatch, sp):
        """General path: fused Qwen3-Next projections and/or a sequence-parallel head exchange."""
        q, k, v, z, b, a = self._project(x_TD, packed, sp)
        # Decay in float32 so a bf16 model cannot round A to -inf.
        g_TH, beta_TH = self.ops.ew.gdn_gates(a, b, self.A_log, self.dt_bias)
        if sp is not None:
            q, k, v, g_TH, beta_TH = (sp.to_heads(t) for t in (q, k, v, g_TH, beta_TH))
        hk, hv = _head_slice(self.num_k_heads, sp), _head_slice(self.num_v_heads, sp)
        rows = q.shape[0]
        qkv_TC = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
        q, k, v = self.conv_fn(qkv_TC, self._conv_weight(hk, hv), packed, splits=(q[0].numel(), k[0].numel(), v[0].numel()))
        return (
            q.reshape(rows, -1, self.head_k_dim),
            k.reshape(rows, -1, self.head_k_dim),
            v.reshape(rows, -1, self.head_v_dim),
            z,
            g_TH,
            beta_TH,
        )


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
        self.ops = ModuleOps(backends.fn("elementwise")())

    def forward(self, x_TD: torch.Tensor, packed: PackedBatch, rope: tuple, sp=None) -> torch.Tensor:
        T = x_TD.shape[0]
        q, gate = self.q_proj(x_TD).view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.ops.norm(self.q_norm, q)
        k = self.ops.norm(self.k_norm, self.k_proj(x_TD).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_TD).view(T, self.num_kv_heads, self.head_dim)
        # A backend that also takes the rotary embedding and the output gate (one pass each side
        # of attention) returns o_proj's input, or None for operands it does not take.
        rope_and_gate = ROPE_AND_GATE.get(self.attention_fn) if sp is None else None
        if rope_and_gate is not None:
            gated = rope_and_gate(q, k, v, *rope, gate, packed, self.scaling)
            if gated is not None:
                return self.o_proj(gated)
        q, k = self.ops.ew.partial_rope(q, k, *rope)
        if sp is not None:
            q, k, v = sp.to_heads(q), sp.to_heads_kv(k), sp.to_heads_kv(v)
        o_THD = self.attention_fn(q, k, v, packed, self.scaling)
        if sp is not None:
            o_THD = sp.to_tokens(o_THD)
        # The gate stays a strided [T, H, D] view of q_proj's output: the fused product reads it
        # in place, where reshaping it to [T, H * D] first would copy it.
        return self.o_proj(self.ops.ew.sigmoid_gate(o_THD, gate).reshape(T, -1))
