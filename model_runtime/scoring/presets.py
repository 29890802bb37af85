"""Built-in random-weight models: ``tiny`` for tests and the default service, and the real
shapes of Qwen3.5-9B, -27B and -35B-A3B for benchmarks (shapes only; nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

# Rotary settings shared by every preset: Qwen3.5 rotates a quarter of each 256-dim head
# with interleaved multi-axis rope (text positions equal on all axes).
_ROPE_QWEN35 = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str  # a key of architectures.MODEL_TYPES
    config: dict  # keyword arguments of the text config class
    seed: int = 0
    initializer_range: float | None = None  # None keeps the config's default


def tiny_config() -> dict:
    """Keyword arguments of the tiny preset's text config (tests build their checkpoints from it)."""
    return dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,  # layers 3 and 7 are full attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        rope_parameters={**_ROPE_QWEN35, "rope_theta": 10_000.0, "mrope_section": [2, 1, 1]},
        tie_word_embeddings=False,
    )


def _real_shape(**shape) -> dict:
    """A released Qwen3.5 model's text config: what they all share, then ``shape``."""
    return dict(vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, max_position_embeddings=262144, rope_parameters=dict(_ROPE_QWEN35),
                **shape)


PRESETS: dict[str, Preset] = {
    # Weights drawn with std 0.05 so the tiny model's distributions are not uniform.
    "tiny": Preset("tiny", "qwen3_5_text", tiny_config(), seed=0, initializer_range=0.05),
    "qwen3.5-9b": Preset("qwen3.5-9b", "qwen3_5_text", _real_shape(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, linear_num_value_heads=32)),
    "qwen3.5-27b": Preset("qwen3.5-27b", "qwen3_5_text", _real_shape(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, linear_num_value_heads=48)),
    "qwen3.5-35b-a3b": Preset("qwen3.5-35b-a3b", "qwen3_5_moe_text", _real_shape(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512)),
}


def text_config_class(model_type: str):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    return {"qwen3_5_text": Qwen3_5TextConfig, "qwen3_5_moe_text": Qwen3_5MoeTextConfig, "qwen3_next": Qwen3NextConfig}[
        model_type
    ]


def build_config(preset: Preset, **overrides):
    kwargs = {**preset.config, **overrides}
    if preset.initializer_range is not None:
        kwargs.setdefault("initializer_range", preset.initializer_range)
    return text_config_class(preset.model_type)(**kwargs)
