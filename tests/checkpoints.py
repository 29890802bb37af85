"""Tiny random Hugging Face checkpoints of every supported kind, written with save_pretrained.

Each has 8 layers (2 full attention), GQA, more value heads than key heads and, for the MoE
kinds, 4 experts with 2 active. Weights use std 0.05: distributions are visibly non-uniform, yet Hugging Face's float32
chunked delta-rule fallback (the CPU reference we compare with) stays within 1e-5 of float64.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model_runtime.scoring.presets import tiny_config

KINDS = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next")

# The tiny preset's shapes, with a smaller vocabulary and context.
_COMMON = {
    **{k: v for k, v in tiny_config().items() if k not in ("rope_parameters", "tie_word_embeddings")},
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
}
_ROPE = tiny_config()["rope_parameters"]
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def build_hf_model(kind: str, seed: int = 0):
    """An unpatched, randomly initialised Hugging Face model of ``kind``."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_COMMON, rope_parameters=_ROPE))
    if kind == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        config = tf.Qwen3_5Config(text_config=dict(_COMMON, rope_parameters=_ROPE), vision_config=vision)
        return tf.Qwen3_5ForConditionalGeneration(config)
    if kind == "qwen3_5_moe":
        common = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**common, **_MOE, rope_parameters=_ROPE))
    if kind == "qwen3_next":
        rope = {k: _ROPE[k] for k in ("rope_type", "rope_theta", "partial_rotary_factor")}
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**_COMMON, **_MOE, rope_parameters=rope))
    raise ValueError(f"unknown checkpoint kind {kind!r}; known: {KINDS}")


def save_checkpoint(kind: str, directory: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    model = build_hf_model(kind, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def as_hub_cache(checkpoint: Path, cache: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lays ``checkpoint``'s files out as huggingface_hub's cache holds a downloaded ``repo_id`` at
    ``main``: ``models--ORG--NAME/{blobs/<id>, snapshots/<commit>/<file> -> blob, refs/main}``.
    Returns the snapshot directory (what resolving ``repo_id`` offline must find)."""
    import hashlib

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot
