"""A checkpoint is checked against the model it describes before any weight is read, and the
loader re-checks what Hugging Face loaded: nothing is ever served from random weights."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from model_runtime.scoring import loading
from model_runtime.scoring.checkpoint import assert_fully_loaded, check_checkpoint
from model_runtime.scoring.checkpoint_config import context_length
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.fp8 import dequantize_fp8
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from tests.checkpoints import build_hf_model, refused, rewrite_checkpoint, save_fp8_checkpoint, without
from tests.unprivileged import unprivileged

A_LOG = "model.layers.0.linear_attn.A_log"


def test_every_supported_layout_passes(kind, checkpoint_dir):
    spec = check_checkpoint(checkpoint_dir(kind))
    model = build_hf_model(kind)
    if kind == "qwen3_5_vl":
        from transformers import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM(model.config.text_config)
    assert spec.tensors == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert spec.max_model_len == 4096 and spec.quantization is None
    assert check_checkpoint(checkpoint_dir(kind), expected=spec.tensors) == spec


def test_a_missing_tensor_is_named(tmp_path, checkpoint_dir):
    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", without(A_LOG))
    refused(broken, "incomplete", A_LOG, "missing")


def test_a_missing_untied_head_is_refused_and_a_tied_one_is_not(tmp_path, checkpoint_dir):
    source = checkpoint_dir("qwen3_5")
    refused(rewrite_checkpoint(source, tmp_path / "untied", without("lm_head.weight")), "incomplete", "lm_head.weight")
    tied = rewrite_checkpoint(source, tmp_path / "tied", without("lm_head.weight"), lambda c: {**c, "tie_word_embeddings": True})
    assert "lm_head.weight" not in check_checkpoint(tied).tensors  # the embedding serves as the head


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
def test_a_stored_head_of_a_tied_config_serves_only_with_the_embeddings_values(tmp_path, checkpoint_dir, kind):
    """The tied model takes the embedding as its head: a stored head with other values would be left
    unused (in the worker pool's reader; Hugging Face's loader unties them instead), so it is refused."""
    def tie(c):
        return {**c, "tie_word_embeddings": True}

    embed = "model.language_model.embed_tokens.weight" if kind == "qwen3_5_vl" else "model.embed_tokens.weight"
    source = checkpoint_dir(kind)
    error = refused(rewrite_checkpoint(source, tmp_path / "other", edit_config=tie), "incomplete",
                    "(lm_head.weight)", embed, "tie_word_embeddings")
    assert "missing" not in str(error), error
    def same_values(t):  # the head in bfloat16, the embedding in float32: equal values serve
        head = t[embed].to(torch.bfloat16)
        return {**t, embed: head.float(), "lm_head.weight": head}

    same = rewrite_checkpoint(source, tmp_path / "same", same_values, tie)
    assert "lm_head.weight" not in check_checkpoint(same).tensors


def test_keys_under_another_prefix_are_refused(tmp_path, checkpoint_dir):
    renamed = rewrite_checkpoint(
        checkpoint_dir("qwen3_5"), tmp_path / "ck", lambda t: {k.replace("model.", "backbone.", 1): v for k, v in t.items()}
    )
    error = refused(renamed, "incomplete", "model.embed_tokens.weight", "backbone.embed_tokens.weight", "not used")
    assert "108 tensors the model needs are missing" in str(error)


def test_an_unknown_extra_tensor_is_refused(tmp_path, checkpoint_dir):
    extra = rewrite_checkpoint(
        checkpoint_dir("qwen3_next"), tmp_path / "ck", lambda t: {**t, "model.layers.0.mlp.bias_extra": torch.zeros(4)}
    )
    refused(extra, "incomplete", "model.layers.0.mlp.bias_extra", "not used")


def test_a_wrong_shape_is_refused(tmp_path, checkpoint_dir):
    key = "model.layers.3.self_attn.q_proj.weight"
    wrong = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", lambda t: {**t, key: t[key][:-1]})
    refused(wrong, "incompatible", key, "[255, 64]", "[256, 64]")


def test_a_missing_expert_is_named(tmp_path, checkpoint_dir):
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5_moe"), tmp_path / "ck", without(key))
    refused(broken, "incomplete", key)


def test_fused_experts_layout_passes_and_loads_the_same(tmp_path, checkpoint_dir):
    """Checkpoints stored in the model's own layout (fused experts) load like per-expert ones."""
    from safetensors.torch import save_file

    source = checkpoint_dir("qwen3_5_moe")
    fused = tmp_path / "fused"
    fused.mkdir()
    model = build_hf_model("qwen3_5_moe")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors", metadata={"format": "pt"})
    (fused / "config.json").write_text((source / "config.json").read_text())
    assert check_checkpoint(fused).tensors == check_checkpoint(source).tensors
    seq = [SequenceInput(np.arange(1, 30) % 512, score_from=3)]
    a = Scorer(load_model(str(fused), device="cpu")).score(seq)[0]
    b = Scorer(load_model(str(source), device="cpu")).score(seq)[0]
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("fused", ["gate_up_proj", "down_proj"])
def test_experts_stored_both_fused_and_one_by_one_are_refused(tmp_path, checkpoint_dir, fused):
    """Hugging Face would load one layout and drop (or trip over) the other: the check refuses
    the fused tensor beside a layer's per-expert ones as unused, before anything binds a port."""
    model = build_hf_model("qwen3_5_moe")
    key = f"model.layers.2.mlp.experts.{fused}"
    both = rewrite_checkpoint(checkpoint_dir("qwen3_5_moe"), tmp_path / "ck", lambda t: {**t, key: model.state_dict()[key]})
    error = refused(both, "incomplete", key, "not used")
    assert "missing" not in str(error), error


def test_a_stray_per_expert_tensor_beside_fused_experts_is_named_as_unused(tmp_path, checkpoint_dir):
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    tensors = {k: v.contiguous() for k, v in build_hf_model("qwen3_5_moe").state_dict().items()}
    stray = "model.layers.2.mlp.experts.0.up_proj.weight"
    tensors[stray] = torch.zeros(8, 8)
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    (fused / "config.json").write_text((checkpoint_dir("qwen3_5_moe") / "config.json").read_text())
    error = refused(fused, "incomplete", stray, "1 tensor in the files is not used")
    assert "missing" not in str(error), error


def test_a_vision_checkpoints_missing_decoder_tensor_is_named_as_its_files_name_it(tmp_path, checkpoint_dir):
    key = "model.language_model.layers.0.linear_attn.A_log"
    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5_vl"), tmp_path / "ck", without(key))
    refused(broken, "incomplete", f"({key})", "missing")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("how", ["hugging_face", "meta_then_read"])
def test_weights_holding_nan_or_infinity_are_refused_at_load(tmp_path, checkpoint_dir, value, how):
    """Shapes and names are right, the values are not: every token would score NaN. Refused
    whether Hugging Face loads it or the pool's workers read it into a model built on meta."""
    from model_runtime.scoring.weights import materialize

    def poison(t):
        bad = t["model.layers.1.mlp.down_proj.weight"].clone()
        bad[2, 7] = value
        return {**t, "model.layers.1.mlp.down_proj.weight": bad}

    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", poison)
    with pytest.raises(CheckpointError) as caught:
        if how == "hugging_face":
            load_model(str(broken), device="cpu")
        else:
            materialize(load_model(str(broken), device="cpu", weights_later=True).model, broken, torch.device("cpu"))
    assert caught.value.kind == "non_finite" and "model.layers.1.mlp.down_proj.weight" in str(caught.value), caught.value


def test_vision_tower_and_mtp_tensors_are_ignored(tmp_path, checkpoint_dir):
    mtp = {"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.mlp.up_proj.weight": torch.zeros(8, 64)}
    with_mtp = rewrite_checkpoint(checkpoint_dir("qwen3_5_vl"), tmp_path / "ck", lambda t: {**t, **mtp})
    spec = check_checkpoint(with_mtp)
    assert not any(k.startswith(("mtp.", "model.visual.")) for k in spec.tensors)
    load_model(str(with_mtp), device="cpu")  # and Hugging Face's load report agrees


def test_unsupported_model_type_and_quantization_are_refused(tmp_path, checkpoint_dir):
    source = checkpoint_dir("qwen3_5")
    llama = rewrite_checkpoint(source, tmp_path / "llama", edit_config=lambda c: {**c, "model_type": "llama"})
    refused(llama, "unsupported", "'llama'", "qwen3_5, qwen3_5_moe and qwen3_next")
    gptq = rewrite_checkpoint(source, tmp_path / "gptq", edit_config=lambda c: {**c, "quantization_config": {"quant_method": "gptq"}})
    refused(gptq, "unsupported", "'gptq'")
    listed = rewrite_checkpoint(source, tmp_path / "listed", edit_config=lambda c: {**c, "model_type": ["qwen3_5"]})
    refused(listed, "unsupported", "model_type ['qwen3_5']")  # any JSON value, not a TypeError


@pytest.mark.parametrize("field", ["vocab_size"])  # max_position_embeddings: tests/e2e/test_e2e_start_checks.py
def test_a_config_transformers_refuses_is_named_in_one_line(tmp_path, checkpoint_dir, field):
    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", edit_config=lambda c: {**c, field: str(c[field])})
    error = refused(broken, "incompatible", "does not describe a buildable model", field)
    assert "\n" not in str(error), f"the CLI prints one line: {error!r}"


def test_files_and_formats_are_named(tmp_path, checkpoint_dir):
    refused(tmp_path / "nope", "unsupported", "not a directory")
    refused(tmp_path, "unsupported", "no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    refused(tmp_path, "unsupported", "safetensors only", "pytorch_model.bin")
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 12345\n")
    refused(tmp_path, "unsupported", "model.safetensors is a Git LFS pointer", "git lfs pull")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()
    refused(tmp_path, "unsupported", "model.safetensors is not a regular file")
    (tmp_path / "model.safetensors").rmdir()
    os.mkfifo(tmp_path / "model.safetensors")  # opening it would wait for a writer forever
    import threading

    caught = []
    check = threading.Thread(target=lambda: caught.append(pytest.raises(CheckpointError, check_checkpoint, tmp_path)), daemon=True)
    check.start()
    check.join(60)
    assert caught and "model.safetensors is not a regular file" in str(caught[0].value), "a pipe held the check"


def test_a_weight_file_without_read_permission_is_named_with_the_reason(checkpoint_dir):
    """Not safetensors' own words for it ("No such file or directory"). Checked as an unprivileged
    user: root reads any file."""
    import shutil
    import subprocess
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp())
    try:
        root.chmod(0o755)
        ck = Path(shutil.copytree(checkpoint_dir("qwen3_5"), root / "ck"))
        ck.chmod(0o755)
        (ck / "config.json").chmod(0o644)
        (ck / "model.safetensors").chmod(0o000)
        code = ("from model_runtime.scoring.checkpoint import check_checkpoint\n"
                "from model_runtime.scoring.checkpoint_error import CheckpointError\n"
                f"try: check_checkpoint({str(ck)!r})\nexcept CheckpointError as e: print(e.kind, e)")
        out = subprocess.run([*unprivileged(), sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[2])
        assert out.stdout.startswith("unreadable ") and "model.safetensors cannot be read: Permission denied" in out.stdout, out
    finally:
        shutil.rmtree(root)


def test_a_shard_missing_from_the_index_is_named(tmp_path):
    build_hf_model("qwen3_5_moe").save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    check_checkpoint(tmp_path)
    shards[1].unlink()
    refused(tmp_path, "incomplete", shards[1].name)


def test_an_index_naming_shards_outside_its_directory_is_refused(tmp_path):
    """Hugging Face writes shards as file names beside the index: a path in their place would read
    files from elsewhere, which is refused before any is opened."""
    build_hf_model("qwen3_5").save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    for elsewhere in ("../other/model.safetensors", "/tmp/model.safetensors", "sub/model.safetensors", ".."):
        index.write_text(json.dumps({**data, "weight_map": {**data["weight_map"], first: elsewhere}}))
        refused(tmp_path, "unsupported", "not files of", elsewhere)


def test_expected_shapes_must_match(checkpoint_dir):
    served = check_checkpoint(checkpoint_dir("qwen3_5")).tensors
    with pytest.raises(CheckpointError) as caught:
        check_checkpoint(checkpoint_dir("qwen3_next"), expected=served)
    assert caught.value.kind == "incompatible" and "in_proj_qkvz" in str(caught.value)
    narrower = {**served, "lm_head.weight": (511, 64)}
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        check_checkpoint(checkpoint_dir("qwen3_5"), expected=narrower)


def test_a_config_checked_again_builds_no_model_and_gives_the_same_tensors(kind, checkpoint_dir, tmp_path, monkeypatch):
    """A weight update checks a checkpoint whose config is usually the served one's: the model
    built from it on the meta device is not built again (it holds the GIL beside the forwards),
    and what the check returns is still each call's own; another config is built."""
    from model_runtime.scoring import checkpoint_config

    checkpoint_config._tensors_of_config.cache_clear()
    first = check_checkpoint(checkpoint_dir(kind))
    first.tensors.clear()  # a caller's change reaches no later check
    built = []
    real = checkpoint_config.build_meta_model
    monkeypatch.setattr(checkpoint_config, "build_meta_model", lambda config: built.append(config) or real(config))
    again = check_checkpoint(checkpoint_dir(kind))
    assert not built, "the same config was built again"
    fresh = check_checkpoint(checkpoint_dir(kind))
    assert again.tensors == fresh.tensors and again.tensors, "a cached check returned other tensors"
    saved_elsewise = rewrite_checkpoint(checkpoint_dir(kind), tmp_path / "saved", edit_config=lambda c: {
        **c, "dtype": "bfloat16", "transformers_version": "5.99.0", "_name_or_path": "elsewhere"})
    check_checkpoint(saved_elsewise)
    assert not built, "a config differing only in how it was saved was built again"
    other = rewrite_checkpoint(checkpoint_dir(kind), tmp_path / "other", edit_config=lambda c: {**c, "rms_norm_eps": 1e-5})
    check_checkpoint(other)
    assert len(built) == 1, f"a changed config was not built: {len(built)} builds"


@pytest.mark.parametrize(
    "rope, want",
    [
        (None, 4096),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384),
        ({"rope_type": "yarn", "factor": 4.0}, 16384),
        ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}, 4096),
        ({"rope_type": "default"}, 4096),
    ],
)
def test_yarn_rope_scaling_raises_the_context(rope, want):
    config = {"model_type": "qwen3_5_text", "max_position_embeddings": 4096}
    if rope:
        config["rope_scaling"] = rope
    assert context_length(config) == want
    nested = {"model_type": "qwen3_5", "text_config": {**config, "rope_parameters": config.pop("rope_scaling", None)}}
    assert context_length(nested) == want


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
def test_a_config_without_max_position_embeddings_has_its_config_classs_context(tmp_path, checkpoint_dir, kind):
    """The model is built with transformers' default; the admitted length was the admission bound instead."""
    from transformers import Qwen3_5TextConfig

    def strip(c):
        c = {k: v for k, v in c.items() if k != "max_position_embeddings"}
        if "text_config" in c:
            c["text_config"] = {k: v for k, v in c["text_config"].items() if k != "max_position_embeddings"}
        return c

    spec = check_checkpoint(rewrite_checkpoint(checkpoint_dir(kind), tmp_path / "ck", edit_config=strip))
    assert spec.max_model_len == Qwen3_5TextConfig().max_position_embeddings, spec.max_model_len


@pytest.mark.parametrize("kind", ["qwen3_5_vl", "qwen3_5_moe_vl"])
@pytest.mark.parametrize("top", [1024, 1_000_000], ids=["top-smaller", "top-larger"])
def test_a_multimodal_text_config_without_max_position_embeddings_has_its_text_config_classs_context(tmp_path, kind, top):
    """transformers builds the language model from text_config alone, with its class's default where the
    field is left out: a top-level max_position_embeddings bounds nothing it builds, so neither here."""
    from transformers import AutoConfig

    from tests.checkpoints import build_hf_model

    build_hf_model(kind).save_pretrained(tmp_path / "saved")

    def strip(c):
        return {**c, "max_position_embeddings": top,
                "text_config": {k: v for k, v in c["text_config"].items() if k != "max_position_embeddings"}}

    path = rewrite_checkpoint(tmp_path / "saved", tmp_path / "ck", edit_config=strip)
    built = AutoConfig.from_pretrained(path).text_config.max_position_embeddings
    assert built != top, (built, top)  # the case this test is about
    spec = check_checkpoint(path)
    assert spec.max_model_len == built, f"max_model_len {spec.max_model_len}, transformers builds {built} positions"


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 0}, {"rope_type": "linear", "factor": 4.0}],
                         ids=["factor-0", "factor-4"])
def test_a_multimodal_top_levels_rope_scaling_scales_nothing(tmp_path, rope):
    """transformers builds the language model's rope from text_config alone: a top-level rope_scaling
    neither lengthens the context nor, when its factor is 0, refuses a model that builds."""
    from transformers import AutoConfig

    from tests.checkpoints import build_hf_model

    build_hf_model("qwen3_5_vl").save_pretrained(tmp_path / "saved")

    def edit(c):  # the text config's own rope left to its class's default
        return {**c, "rope_scaling": rope,
                "text_config": {k: v for k, v in c["text_config"].items() if k not in ("rope_parameters", "rope_scaling")}}

    path = rewrite_checkpoint(tmp_path / "saved", tmp_path / "ck", edit_config=edit)
    built = AutoConfig.from_pretrained(path).text_config
    assert built.rope_parameters["rope_type"] == "default", built.rope_parameters  # the case this test is about
    spec = check_checkpoint(path)
    assert spec.max_model_len == built.max_position_embeddings, (spec.max_model_len, built.max_position_embeddings)


def test_yarn_checkpoint_serves_the_longer_context(tmp_path, checkpoint_dir):
    def yarn(config):
        rope = {**config["rope_parameters"], "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        return {**config, "rope_parameters": rope}

    path = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", edit_config=yarn)
    assert load_model(str(path), device="cpu").max_model_len == 16384


def test_the_loader_refuses_gaps_even_past_the_check(tmp_path, checkpoint_dir, monkeypatch):
    """Defence in depth: with the pre-check made blind, Hugging Face's own loading report still
    stops a model with a tensor left at its random initialisation."""
    source = checkpoint_dir("qwen3_5")
    broken = rewrite_checkpoint(source, tmp_path / "ck", without(A_LOG))
    good_spec = check_checkpoint(source)
    monkeypatch.setattr(loading, "check_checkpoint", lambda path: type(good_spec)(**{**good_spec.__dict__, "path": path}))
    with pytest.raises(CheckpointError, match="A_log") as caught:
        load_model(str(broken), device="cpu")
    assert caught.value.kind == "incomplete"


def test_loading_report_is_read_in_full():
    assert_fully_loaded("ck", {"missing_keys": [], "unexpected_keys": ["mtp.fc.weight", "model.visual.x"], "mismatched_keys": []})
    with pytest.raises(CheckpointError, match="extra.weight"):
        assert_fully_loaded("ck", {"missing_keys": [], "unexpected_keys": ["extra.weight"]})
    with pytest.raises(CheckpointError, match="q.weight") as caught:
        assert_fully_loaded("ck", {"mismatched_keys": [("q.weight", (2, 2), (3, 2))]})
    assert caught.value.kind == "incompatible"


# FP8.


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float32, block by block."""
    out = torch.empty(q.shape, dtype=torch.float32)
    br, bc = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = q[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float() * scale[i, j]
    return out


@pytest.mark.parametrize("shape, block", [((256, 64), (128, 128)), ((100, 70), (32, 16)), ((3, 5), (128, 128))], ids=str)
def test_fp8_dequantize_matches_the_float32_reference(shape, block):
    from tests.checkpoints import quantize_fp8

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8(weight, block)
    got = dequantize_fp8(q, scale, block, torch.float32)
    want = reference_dequantize(q, scale, block)
    diff = (got - want).abs().max().item()
    assert diff == 0.0, f"dequantized FP8 differs from the float32 reference by {diff:.3e} (tol 0)"
    err, tol = float((got - weight).abs().max()), float(weight.abs().max()) * 0.07  # e4m3 keeps 3 mantissa bits
    assert err <= tol, f"FP8 round trip off the weight by {err:.3e} (tol {tol:.3e})"


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_fp8_checkpoint_serves_its_dequantized_weights(tmp_path, kind):
    """An FP8 checkpoint (block 32 x 16, so the tiny projections span several blocks) scores
    exactly like a float32 checkpoint holding the reference dequantization of its weights."""
    from safetensors.torch import load_file

    block = (32, 16)
    fp8 = save_fp8_checkpoint(kind, tmp_path, block=block)
    spec = check_checkpoint(fp8)
    assert spec.quantization == "fp8"
    stored = load_file(fp8 / "model.safetensors")

    def dequantized(tensors):
        return {k: reference_dequantize(v, stored[k + "_scale_inv"], block) if k + "_scale_inv" in stored else v
                for k, v in tensors.items() if not k.endswith("_scale_inv")}  # fmt: skip

    plain = rewrite_checkpoint(fp8, tmp_path / "plain", dequantized, lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    a, b = load_model(str(fp8), device="cpu"), load_model(str(plain), device="cpu")
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), f"{name}: FP8 load differs from the float32 reference by {(x - y).abs().max():.3e}"
    seq = [SequenceInput(np.arange(1, 30) % 512, score_from=3)]
    np.testing.assert_array_equal(Scorer(a).score(seq)[0].logprobs, Scorer(b).score(seq)[0].logprobs)


def test_fp8_scales_are_checked(tmp_path):
    fp8 = save_fp8_checkpoint("qwen3_5", tmp_path / "a", block=(32, 16))
    key = "model.layers.0.mlp.up_proj.weight_scale_inv"
    refused(rewrite_checkpoint(fp8, tmp_path / "noscale", without(key)), "incomplete", key.removesuffix("_scale_inv"))
    bad = rewrite_checkpoint(fp8, tmp_path / "badscale", lambda t: {**t, key: t[key][:1]})
    refused(bad, "incompatible", key)
    unflagged = rewrite_checkpoint(fp8, tmp_path / "noconfig", edit_config=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    refused(unflagged, "unsupported", "float8")
    plain_with_fp8_config = rewrite_checkpoint(
        tmp_path / "a" / "source", tmp_path / "fp8config", edit_config=lambda c: {**c, "quantization_config": {"quant_method": "fp8"}}
    )
    refused(plain_with_fp8_config, "incompatible", "declares FP8", "weight_scale_inv")


def test_every_command_refuses_before_it_starts(tmp_path, checkpoint_dir, monkeypatch, capsys):
    """serve (also with the worker pool) and score stop with status 2 and one line naming the tensor."""
    import os

    from service import cli

    for name in [n for n in os.environ if n.startswith("PACKSCORE_")]:
        monkeypatch.delenv(name)
    broken = str(rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", without(A_LOG)))
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"input_ids": [1, 2, 3]}\n')
    capsys.readouterr()
    for argv in (
        ["serve", "--model", broken, "--port", "0"],
        ["serve", "--model", broken, "--port", "0", "--world-size", "2", "--device", "cpu"],
        ["score", str(source), "-o", str(out), "--model", broken],
    ):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("packscore: error: checkpoint") == 1 and A_LOG in err and "Traceback" not in err, err
    assert not out.exists()
