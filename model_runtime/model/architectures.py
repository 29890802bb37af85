"""What packscore knows about each supported model family."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str  # the family name shown in /v1/models
    gdn_classes: frozenset[str]  # Hugging Face class names of its linear-attention mixers
    attention_classes: frozenset[str]  # ... and of its full-attention mixers
    fused_gdn_projections: bool  # Qwen3-Next packs q, k, v, z (and b, a) into one interleaved projection
    multi_axis_rope: bool  # Qwen3.5's interleaved rope takes [3, batch, T] positions (equal axes for text)


ARCHITECTURES = {
    "qwen3_5": Architecture(
        "qwen3_5", frozenset({"Qwen3_5GatedDeltaNet"}), frozenset({"Qwen3_5Attention"}), False, True
    ),
    "qwen3_5_moe": Architecture(
        "qwen3_5_moe", frozenset({"Qwen3_5MoeGatedDeltaNet"}), frozenset({"Qwen3_5MoeAttention"}), False, True
    ),
    "qwen3_next": Architecture(
        "qwen3_next", frozenset({"Qwen3NextGatedDeltaNet"}), frozenset({"Qwen3NextAttention"}), True, False
    ),
}

# config.json model_type -> family. Text-only configs of the multimodal families map to the family.
MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}

LAYER_KINDS = ("linear_attention", "full_attention")


class UnsupportedModelError(ValueError):
    """The checkpoint is not of a family packscore can score."""


def architecture_for(model_type: str | None) -> Architecture:
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:  # config.json may hold any JSON value
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}: packscore serves qwen3_5, qwen3_5_moe and qwen3_next "
            "checkpoints (as *ForCausalLM or *ForConditionalGeneration)"
        )
    return ARCHITECTURES[MODEL_TYPES[model_type]]
