"""Model FLOPs of scoring a workload, counted the same way for every side of the benchmark.

Per sequence of length L with n scored positions:

    2 * P * L                                  non-embedding matmul parameters used per token
  + A * 2 * H * Dh * L * (L + 1)               causal attention: QK^T and PV over the L(L+1)/2
                                               visible pairs, in each of the A full-attention layers
  + 2 * D * V * n                              vocabulary projection of the scored positions

P counts every weight matrix of the decoder layers (projections, MLP, router, shared
expert) once, and routed experts scaled by top_k / num_experts (the experts a token actually
uses). Embedding lookups, norms, the depthwise conv (4 taps per channel) and the gated
delta rule's own state arithmetic are not counted, so the figure is a lower bound on the work
done. ``all_positions`` also gives the variant with the vocabulary projection on every
position, which is what a plain Hugging Face forward computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class FlopModel:
    matmul_params_per_token: float  # P
    attention_layers: int  # A
    attention_width: int  # H * Dh
    hidden_size: int  # D
    vocab_size: int  # V

    def sequence_flops(self, length: int, scored: int) -> float:
        L = float(length)
        return (
            2.0 * self.matmul_params_per_token * L
            + self.attention_layers * 2.0 * self.attention_width * L * (L + 1.0)
            + 2.0 * self.hidden_size * self.vocab_size * scored
        )

    def workload_flops(self, sequences, *, all_positions: bool = False) -> float:
        return sum(self.sequence_flops(s.length, s.length if all_positions else s.num_scored) for s in sequences)

    def as_dict(self) -> dict:
        return {
            "matmul_params_per_token": self.matmul_params_per_token,
            "attention_layers": self.attention_layers,
            "attention_width": self.attention_width,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


def flop_model(layers: nn.ModuleList, config) -> FlopModel:
    """Reads P, A, H * Dh, D and V from a Hugging Face Qwen3.5-family model's layers and config."""
    experts = int(getattr(config, "num_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    total = 0.0
    for name, param in layers.named_parameters():
        if param.dim() < 2 or "conv1d" in name:
            continue
        if ".experts." in name and experts:
            total += param.numel() * top_k / experts
        else:
            total += param.numel()
    attention_layers = sum(1 for kind in config.layer_types if kind == "full_attention")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return FlopModel(
        matmul_params_per_token=total,
        attention_layers=attention_layers,
        attention_width=config.num_attention_heads * head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
    )
