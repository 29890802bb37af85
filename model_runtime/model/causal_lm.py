"""The packed causal LM: Hugging Face weights and blocks, driven over one THD row.

Legend: T = tokens in the (local) row, D = hidden size, V = vocabulary.

``patch_for_packing`` is the one place where Hugging Face submodules are swapped. It replaces
every token mixer and every sparse-MoE block and then checks that no attention, delta-rule or
sparse-MoE module of the original classes is left anywhere in the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from model_runtime.kernels.registry import KernelBackends
from model_runtime.model.architectures import LAYER_KINDS, Architecture
from model_runtime.model.layers import ModuleOps, PackedAttention, PackedGatedDeltaNet
from model_runtime.model.moe import SPARSE_MOE_BLOCKS, PackedSparseMoe
from model_runtime.model.packing import PackedBatch


class PatchError(RuntimeError):
    """A layer of the loaded model was not switched to its packed implementation."""


@dataclass(frozen=True)
class PatchReport:
    linear_attention: int
    full_attention: int
    sparse_moe: int = 0

    def __str__(self) -> str:
        text = f"{self.linear_attention} linear-attention and {self.full_attention} full-attention layers packed"
        return text + (f", {self.sparse_moe} sparse-MoE blocks batch-invariant" if self.sparse_moe else "")


class PackedCausalLM(nn.Module):
    """Decoder stack of a Qwen3.5-family model whose forward takes a packed row.

    Built by ``patch_for_packing``; holds the original embedding, decoder layers, final norm,
    rotary embedding and LM head (the head is applied by ``model_runtime.scoring.head``, in chunks).
    """

    def __init__(self, hf_causal_lm: nn.Module, architecture: Architecture, backends: KernelBackends | None = None):
        super().__init__()
        inner = hf_causal_lm.model
        self.architecture = architecture
        self.config = hf_causal_lm.config
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_causal_lm.lm_head
        self.layer_types = tuple(self.config.layer_types)
        self.ops = ModuleOps(backends.fn("elementwise")()) if backends is not None else ModuleOps()

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def forward(self, input_ids_T: torch.Tensor, packed: PackedBatch, sp=None) -> torch.Tensor:
        """Final-norm hidden states ``[T, D]`` of the (local shard of the) packed row."""
        x_TD = self.embed_tokens(input_ids_T)
        rope = self._rope(x_TD, packed.position_ids if sp is None else sp.local_tokens(packed.position_ids))
        ops, layers = self.ops, self.layers
        h_TD = ops.norm(layers[0].input_layernorm, x_TD)
        for i, (layer, kind) in enumerate(zip(layers, self.layer_types)):
            x_TD, h_TD = ops.add_norm(layer.post_attention_layernorm, x_TD, self._mix(layer, kind, h_TD, packed, rope, sp))
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x_TD, h_TD = ops.add_norm(next_norm, x_TD, self._mlp(layer.mlp, h_TD, packed, sp))
        return h_TD

    def _rope(self, x_TD: torch.Tensor, positions_T: torch.Tensor):
        """``(cos, sin)`` of shape ``[T, R]``; text positions are equal on every rope axis."""
        if self.architecture.multi_axis_rope:
            # Qwen3.5's rotary takes one position row per rope axis ([3, batch, T]; transformers
            # 5.17 requires it); Qwen3-Next's takes [batch, T].
            positions = positions_T.view(1, 1, -1).expand(3, 1, -1)
        else:
            positions = positions_T.unsqueeze(0)
        cos, sin = self.rotary_emb(x_TD.unsqueeze(0), positions)
        return cos[0], sin[0]

    def _mlp(self, mlp, h_TD, packed, sp):
        if isinstance(mlp, PackedSparseMoe):
            return mlp(h_TD, packed, sp)
        return self.ops.mlp(mlp, h_TD)

    @staticmethod
    def _mix(layer, kind, h_TD, packed, rope, sp):
        if kind == "linear_attention":
            return layer.linear_attn(h_TD, packed, sp)
        return layer.self_attn(h_TD, packed, rope, sp)


_MIXER_NAME = re.compile(r"(Attention|GatedDeltaNet|SparseMoeBlock)$")
_PACKED = (PackedAttention, PackedGatedDeltaNet, PackedSparseMoe)


def patch_for_packing(hf_causal_lm: nn.Module, architecture: Architecture, backends: KernelBackends):
    """Switches every token mixer and sparse-MoE block to packscore's; returns ``(model, report)``.

    Raises ``PatchError`` for a layer kind it does not know, a mixer of an unexpected class, or
    any attention/delta-rule/sparse-MoE module still unswitched afterwards.
    """
    model = PackedCausalLM(hf_causal_lm, architecture, backends)
    counts = {kind: 0 for kind in LAYER_KINDS}
    moe_blocks = 0
    if len(model.layer_types) != len(model.layers):
        raise PatchError(f"config lists {len(model.layer_types)} layer types for {len(model.layers)} layers")
    for i, (layer, kind) in enumerate(zip(model.layers, model.layer_types)):
        if kind == "linear_attention":
            source = getattr(layer, "linear_attn", None)
            _expect(i, kind, source, architecture.gdn_classes)
            layer.linear_attn = PackedGatedDeltaNet(
                source, backends, fused_projections=architecture.fused_gdn_projections
            )
        elif kind == "full_attention":
            source = getattr(layer, "self_attn", None)
            _expect(i, kind, source, architecture.attention_classes)
            layer.self_attn = PackedAttention(source, backends)
        else:
            raise PatchError(f"layer {i} is of kind {kind!r}; packscore knows {list(LAYER_KINDS)}")
        counts[kind] += 1
        if type(layer.mlp).__name__ in SPARSE_MOE_BLOCKS:
            layer.mlp = PackedSparseMoe(layer.mlp, backends)
            moe_blocks += 1
    left = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if _MIXER_NAME.search(type(module).__name__) and not isinstance(module, _PACKED)
    ]
    if left:
        raise PatchError(f"{len(left)} token mixers were not switched to packed implementations: {', '.join(left)}")
    return model, PatchReport(counts["linear_attention"], counts["full_attention"], moe_blocks)


def _expect(index: int, kind: str, module: nn.Module | None, known: frozenset[str]) -> None:
    name = type(module).__name__ if module is not None else "nothing"
    if name not in known:
        raise PatchError(f"layer {index} ({kind}) holds {name}; expected one of {sorted(known)}")
