"""Tiny random Hugging Face checkpoints of every supported kind, written with save_pretrained.

Each has 8 layers (2 full attention), GQA, more value heads than key heads and, for the MoE
kinds, 4 experts with 2 active. Weights use std 0.05: distributions are visibly non-uniform, yet Hugging Face's float32
chunked delta-rule fallback (the CPU reference we compare with) stays within about 2e-5 of float64 at
temperature 0.7 (a log-prob's rounding grows as 1/temperature).
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


def build_hf_model(kind: str, seed: int = 0, text: dict | None = None, top: dict | None = None):
    """An unpatched, randomly initialised Hugging Face model of ``kind``; ``text`` overrides fields
    of its text config (``rope_parameters`` merged into the default's), ``top`` of a multimodal
    config's top level."""
    import transformers as tf

    text = dict(text or {})
    rope = {**_ROPE, **text.pop("rope_parameters", {})}
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**_COMMON, "rope_parameters": rope, **text}))
    if kind in ("qwen3_5_vl", "qwen3_5_moe_vl"):
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
        inner = dict(_COMMON, rope_parameters=rope, **text) if kind == "qwen3_5_vl" else {**_moe_common(), "rope_parameters": rope, **text}
        config_class, model_class = ((tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration) if kind == "qwen3_5_vl"
                                     else (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration))
        return model_class(config_class(text_config=inner, vision_config=vision, **(top or {})))
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**{**_moe_common(), "rope_parameters": rope, **text}))
    if kind == "qwen3_next":
        rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**_COMMON, **_MOE, "rope_parameters": rope, **text}))
    raise ValueError(f"unknown checkpoint kind {kind!r}; known: {KINDS} and qwen3_5_moe_vl")


def _moe_common() -> dict:
    return {**{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, **_MOE}


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


def rewrite_checkpoint(source: Path, directory: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of the checkpoint ``source`` with its tensors (a name -> tensor dict) and its
    config (a dict) passed through ``edit_tensors`` / ``edit_config``: the broken checkpoints a
    converter or a hand edit can produce."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        tensors.update(load_file(file))
    if edit_tensors is not None:
        tensors = edit_tensors(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((Path(source) / "config.json").read_text())
    if edit_config is not None:
        config = edit_config(config)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if (Path(source) / "generation_config.json").exists():
        shutil.copy(Path(source) / "generation_config.json", directory)
    return directory


def without(*names):
    """An ``edit_tensors`` for ``rewrite_checkpoint`` that leaves out the tensors ``names``."""
    return lambda tensors: {k: v for k, v in tensors.items() if k not in names}


def nan_in(name: str):
    """An ``edit_tensors`` that fills the tensor ``name`` with NaN: refused once loaded (``serve`` binds its port first)."""
    return lambda tensors: {**tensors, name: tensors[name] * float("nan")}


def overflowing_head(tensors: dict) -> dict:
    """An ``edit_tensors`` whose finite head overflows the logits: the start's first readiness pass fails."""
    head = tensors["lm_head.weight"].clone()
    head[100], head[101] = 3e38, -3e38
    return {**tensors, "lm_head.weight": head}


FP8_MAX = 448.0  # the largest float8 e4m3 value


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8 e4m3 of a 2-D weight as Qwen's FP8 releases store it: ``(q, scale_inv)``
    with ``weight ~= q * scale_inv`` over each ``block``."""
    rows, cols = weight.shape
    br, bc = block
    scale = torch.empty(-(-rows // br), -(-cols // bc), dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            scale[i, j] = w.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (w / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def save_fp8_checkpoint(kind: str, directory: Path, block: tuple[int, int] = (128, 128), seed: int = 0) -> Path:
    """A tiny checkpoint of ``kind`` with every projection stored as block-scaled FP8 (the
    embedding, the head, norms and the small gates stay in float, as in Qwen's releases)."""

    def quantize(tensors):
        out = {}
        for name, t in tensors.items():
            if t.dim() == 2 and name.endswith("_proj.weight") and "visual" not in name:
                out[name], out[name + "_scale_inv"] = quantize_fp8(t, block)
            else:
                out[name] = t
        return out

    def fp8_config(config):
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        return {**config, "quantization_config": quant}

    source = save_checkpoint(kind, directory / "source", seed=seed)
    return rewrite_checkpoint(source, directory / "fp8", quantize, fp8_config)


class HostStaging:
    """``tensor_file.Staging``'s slots in plain host memory, with events that are done when
    recorded: the slot-by-slot path of ``TensorFile.read_into`` on a machine without CUDA."""

    class _Done:
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

    def __init__(self, count: int, size: int):
        import queue

        self._free = queue.SimpleQueue()
        for _ in range(count):
            self._free.put((torch.empty(size, dtype=torch.uint8), self._Done()))

    def slot(self):
        from contextlib import contextmanager

        @contextmanager
        def take():
            item = self._free.get()
            try:
                yield item
            finally:
                self._free.put(item)

        return take()


def hf_scores(hf_model, seq, top_k: int):
    """Hugging Face's own forward of ``seq`` (a ``SequenceInput``) alone, then API.md's formulas in
    float32: ``(logprobs, entropy, top_k_ids, top_k_logprobs)`` of its scored positions, as NumPy."""
    with torch.no_grad():
        # no cache: one forward needs none, and Hugging Face's fails to build one without a full-attention layer
        logits = hf_model(torch.as_tensor(seq.input_ids)[None], use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / seq.temperature, dim=-1)[seq.score_from - 1 : seq.length - 1]
    targets = torch.as_tensor(seq.input_ids[seq.score_from :], dtype=torch.long)
    top_logp, top_ids = logp.topk(top_k, dim=-1)
    return (logp.gather(1, targets[:, None])[:, 0].numpy(), (-(logp.exp() * logp).sum(-1)).numpy(),
            top_ids.numpy(), top_logp.numpy())


def refused(path, kind: str, *needles: str):
    """The CheckpointError ``check_checkpoint`` raises for ``path``, checked for its ``kind`` and for each
    of ``needles`` in its message."""
    import pytest

    from model_runtime.scoring.checkpoint import check_checkpoint
    from model_runtime.scoring.checkpoint_error import CheckpointError

    with pytest.raises(CheckpointError) as caught:
        check_checkpoint(path)
    error = caught.value
    assert error.kind == kind, f"kind {error.kind!r}, expected {kind!r}: {error}"
    for needle in needles:
        assert needle in str(error), f"{needle!r} not named in: {error}"
    return error
