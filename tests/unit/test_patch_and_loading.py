"""The patch covers every token mixer of every architecture; loading fails loudly on what it cannot serve."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from model_runtime.kernels.registry import select_backends
from model_runtime.model.architectures import ARCHITECTURES
from model_runtime.model.causal_lm import PatchError, patch_for_packing
from model_runtime.model.layers import PackedAttention, PackedGatedDeltaNet
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.presets import PRESETS
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from tests.checkpoints import build_hf_model

FAMILY = {"qwen3_5": "qwen3_5", "qwen3_5_vl": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next"}


def causal_lm(kind):
    model = build_hf_model(kind)
    if kind == "qwen3_5_vl":  # the loader takes the text part; here build the text model the same way
        from transformers import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM(model.config.text_config)
    return model


def test_every_mixer_is_switched(kind, checkpoint_dir):
    loaded = load_model(str(checkpoint_dir(kind)), device="cpu")
    types = loaded.model.layer_types
    assert loaded.architecture == FAMILY[kind]
    assert loaded.patch_report.linear_attention == types.count("linear_attention") == 6
    assert loaded.patch_report.full_attention == types.count("full_attention") == 2
    for layer, layer_type in zip(loaded.model.layers, types):
        mixer = layer.linear_attn if layer_type == "linear_attention" else layer.self_attn
        assert isinstance(mixer, PackedGatedDeltaNet if layer_type == "linear_attention" else PackedAttention)
    names = {type(m).__name__ for m in loaded.model.modules()}
    assert not any(n.endswith(("GatedDeltaNet", "Attention")) and not n.startswith("Packed") for n in names), names


def test_the_model_card_names_the_kernel_families_the_model_runs(kind, checkpoint_dir):
    from model_runtime.scoring.backend import ModelInfo

    loaded = load_model(str(checkpoint_dir(kind)), device="cpu")
    kernels = ModelInfo.of(loaded).kernels
    moe = {family for family in kernels if family.startswith("moe_")}
    assert moe == ({"moe_experts", "moe_router", "moe_shared"} if FAMILY[kind] != "qwen3_5" else set()), kernels
    assert {"linear_attention", "conv1d", "attention", "head", "gate_projection"} <= set(kernels), kernels
    # a slow fallback counts only in a family the model runs (--allow-slow-kernels on a GPU)
    slow = replace(loaded, backends=replace(loaded.backends, fallbacks=("head", "moe_experts")))
    expected = ("head", "moe_experts") if FAMILY[kind] != "qwen3_5" else ("head",)
    assert ModelInfo.of(slow).slow_kernels == expected, ModelInfo.of(slow).slow_kernels


def test_vision_tower_is_never_allocated(checkpoint_dir):
    loaded = load_model(str(checkpoint_dir("qwen3_5_vl")), device="cpu")
    assert not any("Vision" in type(m).__name__ for m in loaded.model.modules())
    text_only = load_model(str(checkpoint_dir("qwen3_5")), device="cpu")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(loaded.model) == count(text_only.model)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("top, text", [(True, False), (False, True), (True, True)])
def test_a_multimodal_checkpoint_ties_its_head_as_its_top_level_says(tmp_path, moe, top, text):
    """Hugging Face's multimodal class ties the head to the embedding as the config's top level
    says, and its save writes the tie only there: such a checkpoint serves, scoring as that class
    does (the head stored when untied, the embedding when tied), at start and read shard by shard."""
    import transformers as tf

    from model_runtime.scoring.weights import materialize
    from tests.checkpoints import _COMMON, _MOE, _ROPE

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    text_config = dict(_COMMON, rope_parameters=_ROPE, tie_word_embeddings=text)
    if moe:
        text_config = {**{k: v for k, v in text_config.items() if k != "intermediate_size"}, **_MOE}
    config_class, model_class = ((tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration) if moe
                                 else (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration))
    torch.manual_seed(0)
    hf = model_class(config_class(text_config=text_config, vision_config=vision, tie_word_embeddings=top)).eval()
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("tie_word_embeddings", False) is top and saved["text_config"].get("tie_word_embeddings", False) is text
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.log_softmax(hf(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0].numpy()
    loaded = load_model(str(tmp_path), device="cpu")
    later = load_model(str(tmp_path), device="cpu", weights_later=True)
    materialize(later.model, tmp_path, torch.device("cpu"))
    for how, model in (("at start", loaded), ("shard by shard", later)):
        (got,) = Scorer(model).score_row([SequenceInput(ids[0].numpy(), score_from=1)])
        diff = float(np.abs(got.logprobs - want).max())
        assert diff <= 1e-5, f"top {top}, text {text}, {how}: max |diff| {diff:.2e} against Hugging Face's multimodal class, tolerance 1e-5"


def test_unknown_layer_kind_fails():
    model = causal_lm("qwen3_5")
    model.config.layer_types = list(model.config.layer_types)
    model.config.layer_types[2] = "sliding_attention"
    with pytest.raises(PatchError, match="layer 2 is of kind 'sliding_attention'"):
        patch_for_packing(model, ARCHITECTURES["qwen3_5"], select_backends("cpu"))


def test_unexpected_mixer_class_fails():
    model = causal_lm("qwen3_5")
    model.model.layers[0].linear_attn = torch.nn.Identity()
    with pytest.raises(PatchError, match="layer 0 \\(linear_attention\\) holds Identity"):
        patch_for_packing(model, ARCHITECTURES["qwen3_5"], select_backends("cpu"))


def test_a_mixer_hidden_elsewhere_is_caught():
    model = causal_lm("qwen3_5")
    model.model.layers[1].mlp.extra = type(model.model.layers[3].self_attn)(model.config, 3)
    with pytest.raises(PatchError, match="1 token mixers were not switched.*layers.1.mlp.extra"):
        patch_for_packing(model, ARCHITECTURES["qwen3_5"], select_backends("cpu"))


def test_wrong_architecture_for_the_model_fails():
    with pytest.raises(PatchError, match="expected one of \\['Qwen3NextGatedDeltaNet'\\]"):
        patch_for_packing(causal_lm("qwen3_5"), ARCHITECTURES["qwen3_next"], select_backends("cpu"))


def test_unsupported_checkpoint_names_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="qwen3_5, qwen3_5_moe and qwen3_next"):
        load_model(str(tmp_path), device="cpu")


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a preset"):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_sharded_checkpoint_loads_to_the_same_numbers(tmp_path, checkpoint_dir):
    build_hf_model("qwen3_5_moe").save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    seq = [SequenceInput(np.arange(1, 40) % 512, score_from=5)]
    sharded = Scorer(load_model(str(tmp_path), device="cpu")).score(seq)[0].logprobs
    single = Scorer(load_model(str(checkpoint_dir("qwen3_5_moe")), device="cpu")).score(seq)[0].logprobs
    np.testing.assert_array_equal(sharded, single)


def test_weights_version_is_the_content_hash(tmp_path):
    """Other weights, another version; the same bytes copied elsewhere (another replica, newer
    mtimes), the same version, and the one a weight update without a version would name."""
    import shutil

    from model_runtime.scoring.content_hash import content_version

    build_hf_model("qwen3_5").save_pretrained(tmp_path / "a")
    first = load_model(str(tmp_path / "a"), device="cpu").weights_version
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    (tmp_path / "copy" / "model.safetensors").touch()
    assert load_model(str(tmp_path / "copy"), device="cpu").weights_version == first == content_version(tmp_path / "a")
    build_hf_model("qwen3_5", seed=1).save_pretrained(tmp_path / "a")
    second = load_model(str(tmp_path / "a"), device="cpu").weights_version
    assert first != second and first.startswith("xxh3-"), (first, second)
    assert load_model(str(tmp_path / "a"), device="cpu", weights_version="step-7").weights_version == "step-7"


def test_the_content_hash_names_the_tensors_not_their_files(tmp_path):
    """The same tensors in one file or in shards of another size, with config.json written in
    another key order, are one version; one changed value, or one changed setting, is another."""
    import json

    from model_runtime.scoring.content_hash import content_version

    model = build_hf_model("qwen3_5")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    model.save_pretrained(tmp_path / "other-shards", max_shard_size="300KB")
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > len(list((tmp_path / "other-shards").glob("*.safetensors"))) > 1
    reordered = tmp_path / "other-shards" / "config.json"
    reordered.write_text(json.dumps(dict(reversed(json.loads(reordered.read_text()).items())), indent=4))
    versions = {name: content_version(tmp_path / name) for name in ("one", "shards", "other-shards")}
    assert len(set(versions.values())) == 1, versions
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    (tmp_path / "one" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert content_version(tmp_path / "one") != versions["one"]
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert content_version(tmp_path / "shards") != versions["shards"]


def test_presets_have_the_advertised_shapes():
    from model_runtime.scoring.presets import build_config

    nine = build_config(PRESETS["qwen3.5-9b"])
    assert (nine.hidden_size, nine.num_hidden_layers, nine.vocab_size) == (4096, 32, 248320)
    assert nine.layer_types.count("full_attention") == 8
    moe = build_config(PRESETS["qwen3.5-35b-a3b"])
    assert (moe.num_experts, moe.num_experts_per_tok) == (256, 8)


def test_tiny_preset_is_deterministic_and_defaults_to_float32_on_cpu():
    a, b = load_model("tiny", device="cpu"), load_model("tiny", device="cpu")
    assert a.dtype == torch.float32 and a.name == "tiny" and a.weights_version == "preset:tiny#seed0"
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), f"{name}: two loads differ by {(pa - pb).abs().max():.3e} (tol 0)"


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_weight_estimate_matches_the_loaded_model(kind, checkpoint_dir, tmp_path):
    """The FSDP workers decide GPU-or-CPU loading from this estimate, before building anything."""
    from model_runtime.scoring.loading import estimated_weight_bytes

    path = checkpoint_dir(kind)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    actual = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert estimated_weight_bytes(str(path), torch.float32) == actual
    assert estimated_weight_bytes(str(path), torch.bfloat16) == actual // 2
    stray = tmp_path / "beside"  # a file beside the weights that is never read is not counted
    shutil.copytree(path, stray)
    shutil.copy(stray / "model.safetensors", stray / "optimizer.safetensors")
    assert estimated_weight_bytes(str(stray), torch.float32) == actual
    tiny = load_model("tiny", device="cpu", dtype="float32")
    assert estimated_weight_bytes("tiny", torch.float32) == sum(p.numel() * 4 for p in tiny.model.parameters())
    # The 27B preset is counted on the meta device, without allocating 54 GB.
    assert 50e9 < estimated_weight_bytes("qwen3.5-27b", torch.bfloat16) < 60e9


def test_hugging_faces_loading_bar_stays_out_of_a_log_file(checkpoint_dir, capfd):
    """Off a terminal (a container's log, `2> log`) the "Loading weights" bar would write a redraw per
    update; on a terminal it still shows, and the setting is left as it was found."""
    from transformers.utils import logging as hf_logging

    path = str(checkpoint_dir("qwen3_5"))
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    load_model(path, device="cpu", dtype="float32")
    err = capfd.readouterr().err
    assert "Loading weights" not in err, err[-2000:]
    assert hf_logging.is_progress_bar_enabled()
