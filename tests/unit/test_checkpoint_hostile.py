"""Checkpoints damaged as a user could damage them: a tensor under two prefixes or in two files, integer
weights, a config.json or an index that cannot be read. Each is refused at start (and by a weight update)
naming the problem; the layouts Hugging Face's loader takes serve. More in test_checkpoint_check.py."""

import json
from pathlib import Path

import pytest
import torch

from model_runtime.scoring import weights
from model_runtime.scoring.checkpoint import check_checkpoint
from model_runtime.scoring.loading import load_model
from tests.checkpoints import refused, rewrite_checkpoint, save_checkpoint
from tests.unprivileged import unprivileged


@pytest.mark.parametrize("kind, tensor", [("qwen3_5", "layers.0.input_layernorm.weight"),
                                          ("qwen3_5_vl", "layers.0.input_layernorm.weight"),
                                          ("qwen3_5_moe", "layers.2.mlp.experts.1.up_proj.weight")])
@pytest.mark.parametrize("other", ["bare", "other_prefix"])
def test_a_tensor_stored_under_two_prefixes_is_refused(tmp_path, checkpoint_dir, kind, tensor, other):
    """``model.X`` beside ``X`` or ``model.language_model.X``: Hugging Face's loader takes one copy (the
    bare one, where the weight reader of an update takes the other): the copy left over is named."""
    prefix = "model.language_model." if kind == "qwen3_5_vl" else "model."
    second = {"bare": tensor, "other_prefix": "model." + tensor if kind == "qwen3_5_vl" else "model.language_model." + tensor}[other]
    twice = rewrite_checkpoint(checkpoint_dir(kind), tmp_path / "ck", lambda t: {**t, second: t[prefix + tensor] + 1})
    error = refused(twice, "incomplete", "1 tensor in the files is not used", prefix + tensor, second)
    assert "missing" not in str(error), error


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_a_bare_decoders_experts_stored_one_by_one_serve(tmp_path, checkpoint_dir, kind):
    """Names without ``model.``, experts per expert: Hugging Face's loader takes them, and so do the check
    and an update's reader, with the same values."""
    source = checkpoint_dir(kind)
    bare = rewrite_checkpoint(source, tmp_path / "bare", lambda t: {k.removeprefix("model."): v for k, v in t.items()})
    assert check_checkpoint(bare).tensors == check_checkpoint(source).tensors
    loaded = load_model(str(bare), device="cpu").model
    reference = load_model(str(source), device="cpu").model
    plan = weights.plan_reads(loaded, bare)
    for name, value in weights.read_parameters(loaded, plan).items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=0)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_checkpoint_mixing_prefixes_serves_and_updates_with_the_same_values(tmp_path, checkpoint_dir, kind):
    """Layer 0 under ``model.language_model.``, the rest under ``model.``: Hugging Face's loader and the check
    take it, so the reader of an update (and of the worker pool) must too, tensor by tensor."""
    source = checkpoint_dir(kind)
    mixed = rewrite_checkpoint(source, tmp_path / "mixed", lambda t: {
        (k.replace("model.", "model.language_model.", 1) if k.startswith(("model.layers.0.", "model.layers.2.")) else k): v
        for k, v in t.items()})
    reference = load_model(str(source), device="cpu").model.state_dict()
    loaded = load_model(str(mixed), device="cpu").model
    for name, value in [*weights.read_parameters(loaded, weights.plan_reads(loaded, mixed)).items(), *loaded.state_dict().items()]:
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_a_weight_stored_as_integers_is_refused(tmp_path, checkpoint_dir, dtype):
    """Hugging Face's loader casts any dtype to the model's: integer weights (a quantization without its
    quantization_config) would serve as garbage. Float dtypes other than the model's serve."""
    key = "model.layers.3.self_attn.q_proj.weight"
    source = checkpoint_dir("qwen3_5")
    odd = rewrite_checkpoint(source, tmp_path / "odd", lambda t: {**t, key: (t[key] * 100).to(dtype)})
    error = refused(odd, "unsupported", key, "no float")
    assert "\n" not in str(error), error
    ignored = rewrite_checkpoint(source, tmp_path / "vision", lambda t: {**t, "model.visual.x": torch.zeros(2, dtype=dtype)})
    check_checkpoint(ignored)  # the vision tower is never read
    for i, float_dtype in enumerate((torch.float16, torch.bfloat16, torch.float64)):
        check_checkpoint(rewrite_checkpoint(source, tmp_path / f"float{i}", lambda t: {**t, key: t[key].to(float_dtype)}))


def test_a_config_or_index_it_may_not_read_is_unreadable_and_named_with_the_reason(checkpoint_dir):
    """config.json or the index without read permission, or a directory it may not search: the
    retryable kind with the reason, never a bare PermissionError. As an unprivileged user: root reads any file."""
    import shutil
    import subprocess
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp())
    try:
        root.chmod(0o755)
        cases = {"config": "config.json", "index": "model.safetensors.index.json", "directory": None}
        for name, unreadable in cases.items():
            ck = Path(shutil.copytree(checkpoint_dir("qwen3_5"), root / name))
            (ck / "model.safetensors").rename(ck / "model-00001-of-00001.safetensors")  # sharded: the index is read
            (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}}))
            for file in ck.iterdir():
                file.chmod(0o644)
            if unreadable:
                (ck / unreadable).chmod(0o000)
            ck.chmod(0o755 if unreadable else 0o700)
        code = ("from model_runtime.scoring.checkpoint import check_checkpoint\n"
                "from model_runtime.scoring.checkpoint_error import CheckpointError\n"
                f"for name in {list(cases)!r}:\n"
                f"    try: check_checkpoint({str(root)!r} + '/' + name)\n"
                "    except CheckpointError as e: print(name, e.kind, e)\n")
        out = subprocess.run([*unprivileged(), sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[2])
        lines = out.stdout.splitlines()
        assert len(lines) == 3, out
        for line, (name, unreadable) in zip(lines, cases.items()):
            assert line.startswith(f"{name} unreadable ") and f"{unreadable or 'config.json'} cannot be read: Permission denied" in line, out
    finally:
        for ck in root.iterdir():
            ck.chmod(0o755)
        shutil.rmtree(root)


def test_an_index_cut_short_is_unreadable(tmp_path, checkpoint_dir):
    """An index still being written, as config.json: the retryable kind (422 unreadable_checkpoint)."""
    ck = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck")
    (ck / "model.safetensors").rename(ck / "model-00001-of-00001.safetensors")
    (ck / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": "model-000')
    refused(ck, "unreadable", "model.safetensors.index.json cannot be read")
    (ck / "model.safetensors.index.json").write_text('{"metadata": {}}')
    refused(ck, "unsupported", "model.safetensors.index.json is not a safetensors index: it has no weight_map object")


def test_the_files_read_at_start_are_those_an_update_reads(tmp_path, checkpoint_dir):
    """A sharded save over an older single-file one (save_pretrained leaves model.safetensors there): the
    index's shards serve at start too (Hugging Face's loader alone reads model.safetensors first), as an
    update and the pool read them. Without an index, model.safetensors alone; with neither, refused at start
    (Hugging Face's loader failed on it once the port was bound)."""
    import shutil

    from safetensors.torch import load_file, save_file

    sharded = save_checkpoint("qwen3_5", tmp_path / "sharded", seed=1, max_shard_size="200KB")
    want = load_model(str(sharded), device="cpu").model.state_dict()
    shutil.copy(checkpoint_dir("qwen3_5") / "model.safetensors", sharded / "model.safetensors")  # the older save
    assert (sharded / "model.safetensors") not in check_checkpoint(sharded).files
    for name, value in load_model(str(sharded), device="cpu").model.state_dict().items():
        assert torch.equal(value, want[name]), f"{name} read from the older model.safetensors"
    for shard in sharded.glob("model-*.safetensors"):  # a single-file save over the sharded one: the index stays
        shard.unlink()
    refused(sharded, "incomplete", "shards listed in model.safetensors.index.json are missing",
            "a model.safetensors is beside it: if that is the newer save, remove the index")
    single = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "single")
    want = load_model(str(single), device="cpu").model.state_dict()
    # config.json naming another file (transformers_weights) Hugging Face's loader would read instead
    other = {k: v + 1 for k, v in load_file(sharded / "model.safetensors").items()}
    save_file(other, single / "extra.safetensors")
    config = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**config, "transformers_weights": "extra.safetensors"}))
    assert check_checkpoint(single).files == (single / "model.safetensors",)
    for name, value in load_model(str(single), device="cpu").model.state_dict().items():
        assert torch.equal(value, want[name]), f"{name} read from the file config.json's transformers_weights names"
    (single / "model.safetensors").rename(single / "weights.safetensors")
    refused(single, "unsupported", "has neither model.safetensors nor model.safetensors.index.json",
            "extra.safetensors, weights.safetensors")


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path, checkpoint_dir):
    from safetensors.torch import load_file, save_file

    ck = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck")
    tensors = load_file(ck / "model.safetensors")
    (ck / "model.safetensors").rename(ck / "model-00001-of-00001.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, ck / "extra.safetensors")
    names = {k: "model-00001-of-00001.safetensors" for k in tensors} | {"model.norm.weight": "extra.safetensors"}
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    refused(ck, "incompatible", "'model.norm.weight' is stored twice, in extra.safetensors and again in model-00001-of-00001.safetensors")
