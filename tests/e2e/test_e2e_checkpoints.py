"""Broken checkpoints stop ``packscore serve`` and ``packscore score`` before the port is bound,
with one clear line and no traceback; checkpoints with a vision tower or ``mtp.*`` tensors serve."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import nan_in, overflowing_head, rewrite_checkpoint, save_fp8_checkpoint, without
from tests.e2e.helpers import ServerProcess, decode, post, run_watching_port
from tests.ports import held_port

A_LOG = "model.layers.0.linear_attn.A_log"
Q_PROJ = "model.layers.3.self_attn.q_proj.weight"


BROKEN = {
    # name: (edit of the tensors, edit of config.json, words the error must contain)
    "missing_tensor": (without(A_LOG), None, ("incomplete", A_LOG)),
    "renamed_keys": (lambda t: {"transformer." + k: v for k, v in t.items()}, None, ("transformer.lm_head.weight", "model.embed_tokens.weight")),
    "extra_tensor": (lambda t: {**t, "model.layers.1.mlp.extra.weight": torch.zeros(2, 2)}, None, ("model.layers.1.mlp.extra.weight", "not used")),
    "wrong_shape": (lambda t: {**t, Q_PROJ: t[Q_PROJ][:, :-1]}, None, (Q_PROJ, "[256, 63]")),
    "integer_weight": (lambda t: {**t, Q_PROJ: (t[Q_PROJ] * 100).int()}, None, (Q_PROJ, "I32", "no float")),
    "stored_twice": (lambda t: {**t, "layers.1.post_attention_layernorm.weight": t["model.layers.1.post_attention_layernorm.weight"].clone()},
                     None, ("layers.1.post_attention_layernorm.weight", "second copy", "not used")),
    "llama_config": (None, lambda c: {**c, "model_type": "llama"}, ("unsupported model_type 'llama'",)),
    "tied_config_beside_another_head": (None, lambda c: {**c, "tie_word_embeddings": True}, ("not used", "(lm_head.weight)", "tie_word_embeddings")),
    "fp8_config_on_plain_weights": (None, lambda c: {**c, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, ("FP8",)),
}  # fmt: skip


@pytest.fixture(scope="module")
def broken(checkpoint_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    source = checkpoint_dir("qwen3_5")
    return {name: rewrite_checkpoint(source, root / name, t, c) for name, (t, c, _) in BROKEN.items()}


@pytest.mark.parametrize("name", list(BROKEN))
def test_serve_refuses_before_binding_the_port(name, broken):
    with held_port() as port:
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--model", str(broken[name])]
        code, output, connected = run_watching_port(command, port)
    assert code == 2, f"exit status {code}, expected 2:\n{output}"
    assert not connected, f"the port was bound:\n{output}"
    assert "Traceback" not in output and "Uvicorn running" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("packscore: error:")]
    assert len(errors) == 1, output
    for needle in BROKEN[name][2]:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"


def test_a_max_model_len_past_the_models_context_is_refused_before_binding(checkpoint_dir):
    with held_port() as port:
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--model", str(checkpoint_dir("qwen3_5")), "--max-model-len", "10000"]
        code, output, connected = run_watching_port(command, port)
    assert code == 2 and not connected, f"exit status {code} (want 2), port bound: {connected}:\n{output}"
    errors = [line for line in output.splitlines() if line.startswith("packscore: error:")]
    assert "Traceback" not in output and len(errors) == 1 and "--max-model-len 10000" in errors[0], output


@pytest.mark.parametrize("layout", [(), ("--device", "cpu", "--world-size", "2", "--fsdp")], ids=["one-process", "pool"])
def test_nan_weights_end_the_server_with_one_line(checkpoint_dir, tmp_path, layout):
    """NaN is found once the weights are read, after the port is bound (/healthz answers while a
    model loads): the server never turns ready and ends with status 2 and one line naming it,
    in one process and from the worker pool's shard-by-shard reader alike."""
    nan = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "nan", nan_in(Q_PROJ))
    # port 0: the server binds before it fails, and a port chosen here could be taken before that (exit 3)
    command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--model", str(nan), *layout]
    code, output, _ = run_watching_port(command, None)
    assert code == 2, f"exit status {code}, expected 2:\n{output}"
    errors = [line for line in output.splitlines() if line.startswith("packscore: error:")]
    assert "Traceback" not in output and len(errors) == 1 and Q_PROJ in errors[0], output
    assert "forming it again" not in output, output  # a refusal a worker reports is no lost worker: no retry


def test_finite_weights_that_score_non_finite_end_the_server_with_one_line_naming_it(checkpoint_dir, tmp_path):
    """Weights pass the NaN check, yet the head's logits overflow: the first readiness pass fails,
    named with its model and reason in one line, without a traceback."""
    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "overflow", overflowing_head)
    command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--model", str(broken)]
    code, output, _ = run_watching_port(command, None)
    assert code == 1, f"exit status {code}, expected 1:\n{output}"
    errors = [line for line in output.splitlines() if line.startswith("packscore: error:")]
    assert "Traceback" not in output and len(errors) == 1, output
    assert "overflow scored non-finite log-probabilities in float32" in errors[0], errors


def test_score_refuses_before_reading_the_input(broken, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3]}) + "\n")
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--model", str(broken["renamed_keys"])]
    code, output, _ = run_watching_port(command, None)
    assert code == 2, f"exit status {code}, expected 2:\n{output}"
    assert "Traceback" not in output and output.count("packscore: error:") == 1, output
    assert not out.exists(), "nothing may be written from a refused checkpoint"


def _serves(tmp_path, model_dir: Path):
    server = ServerProcess(tmp_path, "--model", str(model_dir), api_key=None)
    try:
        server.wait_ready()
        ids = (np.arange(1, 20) * 7 % 512).tolist()
        response = post(server.url, {"sequences": [{"input_ids": ids, "score_from": 2}]}, headers={})
        assert response.status_code == 200, response.text
        logprobs = decode(response, 0)[0]["logprobs"]
        assert logprobs.shape == (17,) and np.all(np.isfinite(logprobs))
        return logprobs
    finally:
        assert server.stop() == 0, server.log()


def test_vision_tower_and_mtp_checkpoint_serves(checkpoint_dir, tmp_path):
    """A multimodal checkpoint (vision tower, model.language_model.* names) with mtp.* tensors
    serves the same numbers as its text weights alone."""
    extra = {"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)}
    with_mtp = rewrite_checkpoint(checkpoint_dir("qwen3_5_vl"), tmp_path / "vl_mtp", lambda t: {**t, **extra})
    text_only = rewrite_checkpoint(
        checkpoint_dir("qwen3_5_vl"),
        tmp_path / "text",
        lambda t: {k.replace("model.language_model.", "model."): v for k, v in t.items() if "visual" not in k},
        lambda c: {**c["text_config"], "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]},
    )
    np.testing.assert_array_equal(_serves(tmp_path, with_mtp), _serves(tmp_path, text_only))


def test_fp8_checkpoint_serves(tmp_path):
    """FP8 weights with their block scales are dequantized at load (docs/checkpoints.md)."""
    _serves(tmp_path, save_fp8_checkpoint("qwen3_5", tmp_path / "fp8", block=(32, 16)))
