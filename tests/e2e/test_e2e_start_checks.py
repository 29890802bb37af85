"""What the real CLI refuses at start, before the port is bound, and what it leaves alone: each
command reads the variables of its own options only, and a config.json whose context bounds
nothing, whose rope scaling factor is no number above 0, whose ``text_config`` is no object
(or one where the model_type has none), or whose multimodal top level holds a rope setting
transformers cannot build from stops ``serve`` and ``score`` with one line; a port in use
stops ``serve`` with its own status, and a first readiness pass that times out with 1."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from tests.checkpoints import rewrite_checkpoint
from tests.e2e.helpers import ServerProcess, post, run_watching_port
from tests.ports import held_port

# Values each option's own command refuses (exit 2), set for the other command.
SERVE_ONLY = {"PACKSCORE_PORT": "abc", "PACKSCORE_HOST": "", "PACKSCORE_MAX_QUEUED_TOKENS": "0",
              "PACKSCORE_API_KEY": "k", "PACKSCORE_API_KEY_FILE": "/nonexistent/key"}
SCORE_ONLY = {"PACKSCORE_TOP_K": "99", "PACKSCORE_TEMPERATURE": "0", "PACKSCORE_RETURN_ENTROPY": "maybe"}


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("packscore: error:")]


def test_score_reads_no_variable_of_an_option_only_serve_has(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3, 4]}) + "\n")
    command = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--log-level", "warning"]
    code, output, _ = run_watching_port(command, None, env=SERVE_ONLY)
    assert code == 0, f"exit status {code}, expected 0:\n{output}"
    assert "PACKSCORE_" not in output, f"a serve-only variable was read or reported:\n{output}"
    line = json.loads(out.read_text().splitlines()[0])
    assert line["id"] == "a" and len(line["logprobs"]) == 3, line
    # its own options' variables are still read and checked
    code, output, _ = run_watching_port(command, None, env={"PACKSCORE_TOP_K": "99"})
    assert code == 2 and "--top-k (from PACKSCORE_TOP_K): " in output, output


def test_serve_reads_no_variable_of_an_option_only_score_has(tmp_path):
    server = ServerProcess(tmp_path, "--log-level", "warning", api_key=None, env=SCORE_ONLY)
    try:
        server.wait_ready()
        response = post(server.url, {"sequences": [{"input_ids": [1, 2, 3, 4]}]}, headers={})
        assert response.status_code == 200, response.text
        assert "entropy" in response.json()["results"][0]  # return_entropy is the request's, default true
    finally:
        assert server.stop() == 0, server.log()
    assert "PACKSCORE_" not in server.log(), server.log()
    with held_port() as port:
        command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
        code, output, connected = run_watching_port(command, port, env={"PACKSCORE_MAX_QUEUED_TOKENS": "0"})
    assert code == 2 and not connected and "--max-queued-tokens (from PACKSCORE_MAX_QUEUED_TOKENS): " in output, output


def _rope(rope_type, **fields):
    return lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_type": rope_type, **fields}}


def _yarn(**fields):
    return _rope("yarn", **fields)


def _text(**fields):
    return lambda c: {**c, "text_config": {**c["text_config"], **fields}}


def _flattened(config):
    text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
    return {**{k: v for k, v in config.items() if k != "text_config"}, **text}


def _nested(config):
    return {**config, "text_config": {k: v for k, v in config.items() if k != "model_type"}}


YARN = dict(factor=4.0, original_max_position_embeddings=1024)
BAD_CONFIGS = {
    # name: (checkpoint kind, edit of config.json, the field and value the one line names)
    "mpe-0": ("qwen3_5", lambda c: {**c, "max_position_embeddings": 0}, "max_position_embeddings is 0;"),
    "mpe-negative": ("qwen3_5", lambda c: {**c, "max_position_embeddings": -1}, "max_position_embeddings is -1;"),
    "mpe-fraction": ("qwen3_5", lambda c: {**c, "max_position_embeddings": 4096.5}, "max_position_embeddings is 4096.5;"),
    "mpe-bool": ("qwen3_5", lambda c: {**c, "max_position_embeddings": True}, "max_position_embeddings is true (a boolean);"),
    "mpe-string": ("qwen3_5", lambda c: {**c, "max_position_embeddings": "4096"}, 'max_position_embeddings is "4096" (a string);'),
    "text-mpe-0": ("qwen3_5_vl", _text(max_position_embeddings=0), "text_config.max_position_embeddings is 0;"),
    "yarn-factor-0": ("qwen3_5", _yarn(**{**YARN, "factor": 0}), "rope_parameters.factor is 0;"),
    "yarn-factor-string": ("qwen3_5", _yarn(**{**YARN, "factor": "4"}), 'rope_parameters.factor is "4" (a string);'),
    "yarn-original-0": ("qwen3_5", _yarn(**{**YARN, "original_max_position_embeddings": 0}),
                        "rope_parameters.original_max_position_embeddings is 0;"),
    "yarn-original-bool": ("qwen3_5", _yarn(**{**YARN, "original_max_position_embeddings": True}),
                           "rope_parameters.original_max_position_embeddings is true (a boolean);"),
    "linear-factor-0": ("qwen3_5", _rope("linear", factor=0), "rope_parameters.factor is 0;"),
    "linear-factor-negative": ("qwen3_next", _rope("linear", factor=-2.0), "rope_parameters.factor is -2.0;"),
    "linear-factor-null": ("qwen3_5", _rope("linear", factor=None), "rope_parameters.factor is null;"),
    "dynamic-factor-0": ("qwen3_5", _rope("dynamic", factor=0), "rope_parameters.factor is 0;"),
    "dynamic-factor-string": ("qwen3_5", _rope("dynamic", factor="2"), 'rope_parameters.factor is "2" (a string);'),
    "rope-scaling-linear-0": ("qwen3_5", lambda c: {**c, "rope_scaling": {"type": "linear", "factor": 0}},
                              "rope_scaling.factor is 0;"),
    "text-linear-0": ("qwen3_5_vl", lambda c: _text(rope_parameters={**c["text_config"]["rope_parameters"],
                                                                     "rope_type": "linear", "factor": 0})(c),
                      "text_config.rope_parameters.factor is 0;"),
    # a multimodal top level's rope that transformers cannot build from, named in our words, not its AttributeError
    "top-level-yarn": ("qwen3_5_vl", lambda c: {**c, "rope_scaling": {"rope_type": "yarn", **YARN}},
                       "has rope_scaling (yarn rope) at its top level; a qwen3_5 checkpoint's rope settings belong in "
                       "text_config"),
    "top-level-yarn-moe": ("qwen3_5_moe_vl", lambda c: {**c, "rope_scaling": {"type": "yarn", "factor": 4.0}},
                           "has rope_scaling (yarn rope) at its top level; a qwen3_5_moe checkpoint's rope settings "
                           "belong in text_config"),
    "top-level-llama3": ("qwen3_5_vl", lambda c: {**c, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
                         "has rope_parameters (llama3 rope) at its top level"),
    "text-config-null": ("qwen3_5_vl", lambda c: {**c, "text_config": None}, "text_config is null;"),
    "text-config-list": ("qwen3_5_vl", lambda c: {**c, "text_config": [1]}, "text_config holds [1] (a list);"),
    "text-config-string": ("qwen3_5_vl", lambda c: {**c, "text_config": "qwen"}, 'text_config holds "qwen" (a string);'),
    "text-config-absent": ("qwen3_5_vl", lambda c: {k: v for k, v in c.items() if k != "text_config"},
                           "has no text_config;"),
    "text-config-empty": ("qwen3_5_vl", lambda c: {**c, "text_config": {}}, "text_config is an empty object;"),
    "text-config-flattened": ("qwen3_5_vl", _flattened, "has no text_config;"),  # top-level fields build no language model
    "text-config-in-qwen3_next": ("qwen3_next", _nested, "has a text_config object, but a qwen3_next config is text-only"),
    "text-config-in-qwen3_5_text": ("qwen3_5", _nested, "has a text_config object, but a qwen3_5_text config is text-only"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_a_config_whose_context_bounds_nothing_or_with_no_text_config_object_stops_serve_before_binding(
        name, checkpoint_dir, tmp_path):
    kind, edit, named = BAD_CONFIGS[name]
    broken = rewrite_checkpoint(checkpoint_dir(kind), tmp_path / name, edit_config=edit)
    with held_port() as port:
        command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--model", str(broken)]
        code, output, connected = run_watching_port(command, port)
    assert code == 2 and not connected, f"exit status {code} (want 2), port bound: {connected}:\n{output}"
    errors = _errors(output)
    assert "Traceback" not in output and len(errors) == 1, output
    assert f"config.json {named}" in errors[0], f"{named!r} not in {errors[0]!r}"


def test_score_refuses_a_context_of_0_before_reading_its_input(checkpoint_dir, tmp_path):
    broken = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck", edit_config=BAD_CONFIGS["mpe-0"][1])
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3]}) + "\n")
    command = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--model", str(broken)]
    code, output, _ = run_watching_port(command, None)
    assert code == 2 and len(_errors(output)) == 1 and "max_position_embeddings is 0;" in output, output
    assert not out.exists()


def test_a_context_of_0_that_yarn_bounds_is_served_with_yarns_bound(checkpoint_dir, tmp_path):
    """transformers builds and runs it (yarn reads factor and the original context, not
    max_position_embeddings): refused would stop a checkpoint Hugging Face runs; its bound is
    factor x original_max_position_embeddings, 4096 here, as --max-model-len beyond it shows."""
    edit = _yarn(**YARN)
    yarn = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "ck",
                              edit_config=lambda c: edit({**c, "max_position_embeddings": 0}))
    with held_port() as port:
        command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--model", str(yarn),
                   "--max-model-len", "4097"]
        code, output, connected = run_watching_port(command, port)
    assert code == 2 and not connected, f"exit status {code} (want 2), port bound: {connected}:\n{output}"
    assert "--max-model-len 4097 exceeds the model's 4096 positions" in output, output


def test_a_port_in_use_exits_3_at_once_though_the_load_still_runs(checkpoint_dir):
    """uvicorn binds after the lifespan began the load in a thread: a bind that fails ends the
    process with the documented 3, not with the interpreter finalised under that thread's torch
    work (std::terminate, status -6) or the thread's traceback on a closed event loop. One error line
    says why; the line about the load left running says it is abandoned because of that."""
    abandoned = []
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        command = [sys.executable, "-m", "service.cli", "serve", "--model", str(checkpoint_dir("qwen3_5")),
                   "--port", str(port)]
        for attempt in range(3):  # where the load stands at the exit varies: each run must end the same
            code, output, _ = run_watching_port(command, None)
            assert code == 3, f"attempt {attempt}: exit status {code}, expected 3:\n{output[-3000:]}"
            errors = [line for line in output.splitlines() if " ERROR " in line] + _errors(output)
            assert len(errors) == 1 and "address already in use" in errors[0], output[-3000:]
            assert "Traceback" not in output and "terminate called" not in output, output[-3000:]
            left = [line for line in output.splitlines() if "another thread" in line]
            assert all(line.endswith("exiting with status 3: the port could not be bound, so the model's start "
                                      "(loading), still running in another thread, is abandoned") for line in left), left
            abandoned += left
    assert abandoned, "the load never ran past the failed bind: nothing checked its line"


# The real CLI with a first readiness pass whose forward (4,000 tokens) outlasts its bound.
_SLOW_FIRST_PASS = ("import sys; import service.readiness as r; r._PROBE_TIMEOUT_S = 0.3; r._PROBE_LENGTH = 4000; "
                    "from service.cli import main; sys.exit(main(sys.argv[1:]))")


def test_a_first_readiness_pass_that_times_out_exits_1_though_its_forward_still_runs(checkpoint_dir):
    """The start fails while the pass's forward runs on its thread: the exit is the documented 1,
    naming the timeout, not the interpreter finalised under that forward (std::terminate, status -6)."""
    command = [sys.executable, "-c", _SLOW_FIRST_PASS, "serve", "--model", str(checkpoint_dir("qwen3_5")), "--port", "0"]
    for attempt in range(3):  # where the forward stands at the exit varies: each run must end the same
        code, output, _ = run_watching_port(command, None)
        assert code == 1, f"attempt {attempt}: exit status {code}, expected 1:\n{output[-3000:]}"
        error = [line for line in _errors(output) if "could not start: the first readiness pass failed:" in line]
        assert error and error[0].endswith("failed: no result within 0.3s"), output[-3000:]
        assert "Traceback" not in output and "terminate called" not in output, output[-3000:]
