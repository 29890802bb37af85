"""Command line: options and their environment variables, help, offline scoring (resumable)."""

import argparse
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from pydantic import ValidationError

from model_runtime.types import SequenceInput
from service import cli
from service.settings import Settings
from service.testing import FakeBackend, expected_scores
from tests.signals import default_sigint

SERVE_OPTIONS = (
    "--model", "--host", "--port", "--max-batch-tokens", "--max-wait-ms", "--max-queued-tokens",
    "--max-request-bytes", "--max-model-len", "--max-sequences-per-request", "--drain-timeout-s", "--api-key",
    "--api-key-file", "--dtype", "--device", "--served-model-name", "--world-size", "--sp", "--fsdp",
    "--allow-slow-kernels", "--triton-cache-dir", "--log-level",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # recorded, so main() setting it is undone after the test
    for name in list(os.environ):
        if name.startswith("PACKSCORE_") or name == "TRITON_CACHE_DIR":
            monkeypatch.delenv(name)


def test_defaults_serve_the_tiny_model_on_loopback():
    _, settings = cli.parse_settings(["serve"])
    assert (settings.model, settings.host, settings.port) == ("tiny", "127.0.0.1", 8000)
    assert settings.world_size == 1 and settings.sp == 1 and not settings.fsdp
    assert settings.resolved_api_key() is None


def test_admission_hard_cap_and_body_limit_defaults_follow_the_pool():
    """Unset, --max-queued-tokens caps admission at 1M tokens or four rows per GPU, whichever is
    more (the time bound, --queue-seconds, decides below it); the body limit follows the cap."""
    one = cli.parse_settings(["serve"])[1]
    assert one.queued_tokens == 1 << 20 and one.queue_seconds == 4.0 and one.max_admission_wait_s == 30.0
    assert one.request_bytes == 34 * (1 << 20) + 256 * one.max_sequences_per_request + (1 << 20)
    eight = cli.parse_settings(["serve", "--world-size", "8", "--max-batch-tokens", "65536"])[1]
    assert eight.queued_tokens == 4 * 8 * 65536
    given = cli.parse_settings(["serve", "--world-size", "4", "--max-queued-tokens", "1000",
                                "--max-request-bytes", "5000"])[1]
    assert given.queued_tokens == 1000 and given.request_bytes == 5000



def test_hostile_client_options_parse():
    s = cli.parse_settings(["serve", "--request-read-timeout-s", "2.5", "--max-connections", "100",
                            "--queue-seconds", "2", "--max-admission-wait-s", "0", "--send-timeout-s", "7.5"])[1]
    assert (s.request_read_timeout_s, s.max_connections, s.queue_seconds, s.max_admission_wait_s) == (2.5, 100, 2.0, 0.0)
    assert s.send_timeout_s == 7.5 and cli.parse_settings(["serve"])[1].send_timeout_s == 60.0


def test_kernels_option_pins_backends(monkeypatch, capsys):
    """``--kernels`` (or PACKSCORE_KERNELS, the same text) is parsed once, into the family ->
    backend mapping the loader and the pool take; a mapping given in Python is checked alike."""
    settings = cli.parse_settings(["serve", "--kernels", "attention=sdpa, head=torch"])[1]
    assert settings.kernels == {"attention": "sdpa", "head": "torch"}
    assert cli.parse_settings(["serve"])[1].kernels == {}
    monkeypatch.setenv("PACKSCORE_KERNELS", "attention=varlen,moe_router=select")
    assert cli.parse_settings(["serve"])[1].kernels == {"attention": "varlen", "moe_router": "select"}
    assert cli.parse_settings(["serve", "--kernels", "head=triton"])[1].kernels == {"head": "triton"}  # the option wins
    assert Settings(kernels={"head": "torch"}).kernels == {"head": "torch"}
    with pytest.raises(ValidationError, match="unknown head backend 'fast'"):
        Settings(kernels={"head": "fast"})
    monkeypatch.setenv("PACKSCORE_KERNELS", "attention")
    with pytest.raises(SystemExit):
        cli.parse_settings(["serve"])
    err = capsys.readouterr().err
    assert "--kernels (from PACKSCORE_KERNELS)" in err and "expected FAMILY=BACKEND" in err, err


def test_command_line_wins_over_environment_which_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("PACKSCORE_MAX_BATCH_TOKENS", "50")
    monkeypatch.setenv("PACKSCORE_MAX_WAIT_MS", "7.5")
    monkeypatch.setenv("PACKSCORE_FSDP", "true")
    monkeypatch.setenv("PACKSCORE_API_KEY", "from-env")
    _, settings = cli.parse_settings(["serve", "--max-batch-tokens", "100", "--no-fsdp"])
    assert settings.max_batch_tokens == 100
    assert settings.max_wait_ms == 7.5
    assert settings.fsdp is False
    assert settings.resolved_api_key() == "from-env"
    assert "from-env" not in repr(settings)  # the key is a secret


def test_every_option_has_help_naming_its_environment_variable(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in SERVE_OPTIONS:
        assert option in text, option
        assert "PACKSCORE_" + option[2:].upper().replace("-", "_") in text


def test_score_help_describes_its_options_without_a_server(capsys):
    # the model options are shared with serve: their help must be true of offline scoring too
    with pytest.raises(SystemExit):
        cli.main(["score", "--help"])
    options = capsys.readouterr().out.split("options:", 1)[1]
    assert "server" not in options and "clients" not in options and "/v1/" not in options, options


def _documented_options() -> dict[str, str]:
    """docs/cli.md's option tables: each option (positive form) -> its default cell, split where a row
    names several options with as many defaults (`--host`, `--port` | `127.0.0.1`, `8000`)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    documented = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`-"):
            continue
        names = [n for n in re.findall(r"`(-[-a-z]+)`", cells[0]) if not n.startswith("--no-")]
        defaults = [d.strip().strip("`") for d in cells[1].split(",")]
        for i, name in enumerate(names):
            documented[name] = defaults[i] if len(defaults) == len(names) else cells[1].strip("`")
    return documented


def _parser_options(command: str) -> dict[str, object]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    strings = {s for action in sub._actions for s in action.option_strings if s not in ("-h", "--help")}
    positive = [s for s in strings if not (s.startswith("--no-") and "--" + s[5:] in strings)]
    fields = Settings.model_fields
    return {s: fields[s[2:].replace("-", "_")].default if s[2:].replace("-", "_") in fields else None for s in positive}


def test_every_option_is_in_the_docs_tables_with_its_default():
    documented = _documented_options()
    options = _parser_options("serve") | _parser_options("score")
    wrong = [f"{option}: in docs/cli.md, not an option" for option in documented if option not in options]
    for option, default in options.items():
        if option not in documented:
            wrong.append(f"{option}: not in docs/cli.md's tables")
        elif isinstance(default, bool):
            if documented[option] != ("on" if default else "off"):
                wrong.append(f"{option}: docs say {documented[option]!r}, default {default}")
        elif isinstance(default, (int, float)):
            if float(documented[option].replace(",", "")) != default:
                wrong.append(f"{option}: docs say {documented[option]!r}, default {default}")
        elif isinstance(default, str) and documented[option] != default:
            wrong.append(f"{option}: docs say {documented[option]!r}, default {default!r}")
    assert not wrong, wrong


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--port", "http"], "--port"),
        (["serve", "--max-batch-tokens", "0"], "--max-batch-tokens"),
        (["serve", "--send-timeout-s", "0"], "--send-timeout-s"),
        (["serve", "--dtype", "int8"], "--dtype"),
        (["serve", "--kernels", "attention"], "--kernels"),
        (["serve", "--kernels", "head=torch,head=triton"], "--kernels"),
        (["serve", "--kernels", "atention=sdpa"], "unknown kernel family 'atention'"),
        (["serve", "--kernels", "attention=magic"], "unknown attention backend 'magic'"),
        (["serve", "--api-key", "a", "--api-key-file", "/k"], "not both"),
        (["serve", "--sp", "2"], "--world-size 1 is not divisible by --sp 2"),
        (["serve", "--world-size", "2", "--sp", "3"], "--world-size 2 is not divisible by --sp 3"),
        (["score", "in.jsonl", "-o", "out.jsonl", "--top-k", "21"], "--top-k"),
    ],
)
def test_bad_options_are_refused_with_the_option_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_settings(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Value error" not in err, err


def test_a_bad_value_from_the_environment_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("PACKSCORE_MAX_BATCH_TOKENS", "abc")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_settings(["serve"])
    assert exit_.value.code == 2
    assert "--max-batch-tokens (from PACKSCORE_MAX_BATCH_TOKENS): " in capsys.readouterr().err
    with pytest.raises(SystemExit):  # given on the command line too: the command line's value is named
        cli.parse_settings(["serve", "--max-batch-tokens", "0"])
    assert "PACKSCORE_MAX_BATCH_TOKENS" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "env, argv, message",
    [
        ({"PACKSCORE_MODEL": "a=,"}, [], "--model 'a=': expected PATH_OR_PRESET or NAME=PATH_OR_PRESET (--model from PACKSCORE_MODEL)"),
        ({"PACKSCORE_MODEL": "a=tiny,a=tiny"}, [], "the name 'a' is given twice (--model from PACKSCORE_MODEL)"),
        ({"PACKSCORE_SP": "2"}, ["--world-size", "3"], "not divisible by --sp 2: a sequence-parallel group needs sp of the world's GPUs (--sp from PACKSCORE_SP)"),
        ({"PACKSCORE_API_KEY": "k", "PACKSCORE_API_KEY_FILE": "/k"}, [], "not both (--api-key from PACKSCORE_API_KEY, --api-key-file from PACKSCORE_API_KEY_FILE)"),
    ],
    ids=["model", "model-twice", "sp", "both-keys"],
)
def test_a_rule_across_options_broken_from_the_environment_names_the_variables(monkeypatch, capsys, env, argv, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.parse_settings(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "packscore: error: " in err and message in err and "settings:" not in err, err


def test_an_empty_api_key_is_an_error_not_an_open_server(monkeypatch, capsys):
    monkeypatch.setenv("PACKSCORE_API_KEY", "")
    assert cli.main(["serve"]) == 2
    assert "API key" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["option", "environment"])
def test_an_empty_host_is_an_error_not_every_interface(monkeypatch, capsys, where):
    """An empty address (a templated variable left empty) would bind 0.0.0.0 and [::]."""
    argv = ["serve", "--host", " "] if where == "option" else ["serve"]
    monkeypatch.setenv("PACKSCORE_HOST", "")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_settings(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--host" in err and "every interface" in err and "Value error" not in err, err


@pytest.mark.parametrize("name", ["model", "revision", "served_model_name", "triton_cache_dir", "expert_gemm",
                                  "api_key_file", "weights_root", "weights_record", "admin_key_file"])
@pytest.mark.parametrize("where", ["option", "environment"])
def test_an_empty_path_is_an_error_not_the_working_directory(monkeypatch, capsys, name, where):
    """Path("") is "." (an empty --model read ". has no config.json"; an empty --revision, as no revision of the cache,
    failed naming main; an empty --served-model-name was the model's own name, yet refused beside several models as a
    name); none of these means off when empty."""
    option, env = "--" + name.replace("_", "-"), "PACKSCORE_" + name.upper()
    monkeypatch.delenv(env, raising=False)
    if where == "option":
        argv = ["score", "in.jsonl", "-o", "out.jsonl", option, ""] if name == "triton_cache_dir" else ["serve", option, ""]
    else:
        argv = ["serve"]
        monkeypatch.setenv(env, "")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_settings(argv)
    assert exit_.value.code == 2
    named = f"{option} (from {env}): is empty; give " if where == "environment" else f"{option}: is empty; give "
    assert named in capsys.readouterr().err


def test_the_expert_gemm_library_is_checked_and_left_out_of_the_environment(monkeypatch, tmp_path, capsys):
    """A missing file is refused before anything loads; a present one travels in the settings
    (tests/unit/test_expert_gemm.py follows it to the backend choice), not through os.environ."""
    monkeypatch.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    assert cli.main(["serve", "--expert-gemm", str(tmp_path / "absent.so")]) == 2
    assert "--expert-gemm" in capsys.readouterr().err
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    assert cli.main(["serve", "--expert-gemm", str(lib), "--model", str(tmp_path / "nope")]) == 2
    assert "PACKSCORE_EXPERT_GEMM" not in os.environ


def test_the_early_kernel_check_probes_the_named_expert_gemm_library(monkeypatch, tmp_path, capsys):
    """``--kernels moe_experts=expert_tiles`` is checked before loading against ``--expert-gemm``'s file."""
    import model_runtime.kernels.registry as registry

    monkeypatch.delenv("PACKSCORE_EXPERT_GEMM", raising=False)
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")

    def check(device, overrides, expert_gemm=None):
        raise ValueError(f"checked {overrides} with {expert_gemm}")

    monkeypatch.setattr(registry, "check_overrides", check)
    assert cli.main(["serve", "--kernels", "moe_experts=expert_tiles", "--expert-gemm", str(lib)]) == 2
    assert f"checked {{'moe_experts': 'expert_tiles'}} with {lib}" in capsys.readouterr().err


def test_a_kernel_pin_this_device_cannot_run_stops_both_commands_before_loading(monkeypatch, tmp_path, capsys):
    def no_loading(settings):
        raise AssertionError("the model was loaded before the --kernels pin was checked")

    monkeypatch.setattr("service.backends.load_backend", no_loading)
    monkeypatch.setattr(cli, "serve", lambda settings: no_loading(settings))  # nor the port bound
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b'{"id": "a", "input_ids": [1, 2, 3]}\n')
    for argv in (["score", str(source), "-o", str(out)], ["serve"]):
        assert cli.main([*argv, "--device", "cpu", "--kernels", "attention=varlen"]) == 2
        err = capsys.readouterr().err
        assert "the attention backend 'varlen' needs CUDA" in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed here")
def test_no_fla_on_cuda_is_refused_by_the_checks_before_the_port_is_bound():
    """Found when the model loaded, after the port was bound. The pre-bind check needs only the
    device's type and the imports: "cuda" stands in for a GPU this machine lacks (main() would stop
    at --device first), through the function _run calls before serve()."""
    with pytest.raises(ValueError) as refused:
        cli._check_kernels(Settings(device="cuda"))
    message = str(refused.value)
    assert message.startswith("no fast linear_attention kernel is usable on CUDA (wanted fla; fla: fla is not "
                              "installed)") and "--allow-slow-kernels" in message, message
    cli._check_kernels(Settings(device="cuda", allow_slow_kernels=True))  # asked for: the load falls back, visibly
    cli._check_kernels(Settings(device="cpu"))


def test_a_device_this_machine_lacks_or_no_device_at_all_stops_before_the_port_is_bound(monkeypatch, capsys):
    """Found when the model loaded, after the port was bound, with a traceback and status 1."""
    import torch

    monkeypatch.setattr(cli, "serve", lambda *a: pytest.fail("the server started"))
    beyond = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    assert cli.main(["serve", "--device", beyond]) == 2
    err = capsys.readouterr().err
    assert f"packscore: error: --device {beyond}: this machine has " in err and "Traceback" not in err, err
    monkeypatch.setenv("PACKSCORE_DEVICE", "tpu:0")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--device (from PACKSCORE_DEVICE): 'tpu:0' is not a device packscore runs on" in err, err


def test_a_missing_model_or_worker_pool_fails_fast_with_a_clear_error(monkeypatch, tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path / "nope"), "--triton-cache-dir", str(tmp_path)]) == 2
    assert "neither a checkpoint directory, a preset" in capsys.readouterr().err
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path)  # set before anything imports a kernel
    monkeypatch.setitem(sys.modules, "model_runtime.pool.pool", None)  # as if not written yet
    assert cli.main(["serve", "--world-size", "2"]) == 2
    assert "worker pool" in capsys.readouterr().err


def _write_jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _read_jsonl(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_offline_scoring_is_resumable_and_keeps_input_order(monkeypatch, tmp_path):
    backend = FakeBackend()
    monkeypatch.setattr("service.backends.load_backend", lambda settings: backend)
    rng = np.random.default_rng(0)
    rows = [{"id": f"r{i}", "input_ids": rng.integers(0, 1000, rng.integers(2, 30)).tolist(), "score_from": 2}
            for i in range(40)]
    rows[7].pop("id")  # gets line-8
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    argv = ["score", str(source), "-o", str(out), "--max-batch-tokens", "64", "--top-k", "2"]
    assert cli.main(argv) == 0
    first = _read_jsonl(out)
    assert [r["id"] for r in first] == [r.get("id", "line-8") for r in rows]
    for row, got in zip(rows, first):
        want = expected_scores(SequenceInput(np.array(row["input_ids"]), 2, top_k=2))
        np.testing.assert_array_equal(np.asarray(got["logprobs"], np.float32), want.logprobs)
        np.testing.assert_array_equal(np.asarray(got["top_k_ids"]).reshape(-1, 2), want.top_k_ids)

    # Interrupted run: 10 complete lines and a torn one. The rerun scores only what is missing.
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:10]) + lines[10][:15])
    scored_before = sum(len(row) for row in backend.rows)
    assert cli.main(argv) == 0
    assert [r["id"] for r in _read_jsonl(out)] == [r["id"] for r in first]
    assert sum(len(row) for row in backend.rows) - scored_before == 30


_INTERRUPTED_RUN = """
import sys
from service import cli
from service.testing import FakeBackend
import service.backends
service.backends.load_backend = lambda settings: FakeBackend(seconds_per_token=0.001)
sys.exit(cli.main(sys.argv[1:]))
"""


def test_offline_scoring_interrupted_keeps_its_results_in_input_order_and_resumes(tmp_path):
    """Ctrl-C: what is written is a prefix of the input (a later line finished before an earlier
    one is not written ahead of it), the exit says how to resume, and the rerun completes it."""
    import signal
    import subprocess

    rng = np.random.default_rng(3)
    rows = [{"id": f"r{i}", "input_ids": rng.integers(0, 1000, rng.integers(2, 60)).tolist()} for i in range(200)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    argv = [sys.executable, "-c", _INTERRUPTED_RUN, "score", str(source), "-o", str(out), "--max-batch-tokens", "128"]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 60
    while (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]
    kept = [r["id"] for r in _read_jsonl(out)]
    assert 0 < len(kept) < len(rows) and kept == [r["id"] for r in rows[: len(kept)]], kept[:20]
    assert subprocess.run(argv, capture_output=True, timeout=120).returncode == 0
    assert [r["id"] for r in _read_jsonl(out)] == [r["id"] for r in rows]


def test_offline_scoring_checks_every_line_before_scoring_any(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("service.backends.load_backend", lambda settings: FakeBackend())
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [1, 5000]}, {"id": "c", "input_ids": [3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    assert f"{source}:2: input_ids[1]" in capsys.readouterr().err
    assert not out.exists()  # nothing half-written, and no empty OUT left by a refused first run
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3, 4]}, {"id": "a", "input_ids": [5]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    assert f"{source}:3: id 'a' appears twice" in capsys.readouterr().err
    assert not out.exists()


def test_offline_scoring_takes_a_null_id_and_answers_rollout_mismatch(monkeypatch, tmp_path):
    """API.md: id is "string or null"; rollout_logprobs "turns on mismatch in the result"."""
    from service.http.rollout import mismatch

    monkeypatch.setattr("service.backends.load_backend", lambda settings: FakeBackend())
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rollout = [-6.0, -6.5]
    _write_jsonl(source, [{"id": None, "input_ids": [1, 2, 3, 4], "score_from": 2, "rollout_logprobs": rollout},
                          {"input_ids": [5, 6, 7]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    first, second = _read_jsonl(out)
    assert (first["id"], second["id"]) == ("line-1", "line-2") and "mismatch" not in second
    want = mismatch(expected_scores(SequenceInput(np.array([1, 2, 3, 4]), 2)).logprobs, np.float32(rollout))
    assert first["mismatch"] == pytest.approx(want), (first["mismatch"], want)
    line = out.read_text().splitlines()[0]  # float32's shortest form, as the server's JSON prints it
    assert all(f'"{key}":{str(np.float32(value))}' in line for key, value in want.items()), (line, want)


def test_offline_scoring_holds_the_servers_sequence_limit(monkeypatch, tmp_path, capsys):
    """--max-model-len past the model's limit is refused, as the server refuses it at start-up;
    within it, a longer line is refused with its line number, as a request would be."""
    monkeypatch.setattr("service.backends.load_backend", lambda settings: FakeBackend(max_model_len=4096))
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": list(range(9))}])
    assert cli.main(["score", str(source), "-o", str(out), "--max-model-len", "8192"]) == 2
    assert "--max-model-len 8192 exceeds the model's 4096 positions" in capsys.readouterr().err
    assert cli.main(["score", str(source), "-o", str(out), "--max-model-len", "8"]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2:" in err and "(max_model_len)" in err, err
    assert not out.exists()  # refused once the model loaded: still nothing written


@pytest.mark.parametrize("requested,model_limit,queued,want", [
    (None, 4096, 10**6, 4096), (1024, 4096, 10**6, 1024), (None, None, 5000, 5000), (None, 4096, 1000, 1000),
    (2048, None, 10**6, 2048),
])
def test_model_len_resolution(requested, model_limit, queued, want):
    from service.http.validation import resolve_model_len

    assert resolve_model_len(requested, model_limit, queued) == want


def test_offline_scoring_with_the_tiny_model_equals_the_in_process_scorer(tmp_path):
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    rng = np.random.default_rng(1)
    rows = [{"id": str(i), "input_ids": rng.integers(0, 4096, n).tolist(), "score_from": 3}
            for i, n in enumerate((5, 40, 17, 3, 64))]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    assert cli.main(["score", str(source), "-o", str(out), "--max-batch-tokens", "80", "--temperature", "0.8"]) == 0
    scorer = Scorer(load_model("tiny"), max_batch_tokens=4096)
    want = scorer.score([SequenceInput(np.array(r["input_ids"]), 3, temperature=0.8) for r in rows])
    for got, ref in zip(_read_jsonl(out), want):
        diff = np.abs(np.asarray(got["logprobs"], np.float32) - ref.logprobs).max(initial=0)
        assert diff <= 1e-4, f"packed offline vs in-process: max diff {diff} > 1e-4 (float32 CPU packing bound: 1e-6, README.md)"
        np.testing.assert_allclose(np.asarray(got["entropy"], np.float32), ref.entropy, atol=1e-4)


def test_settings_dump_is_what_the_worker_pool_reads():
    dumped = Settings(world_size=2, sp=2, fsdp=True).model_dump()
    for key in ("model", "device", "dtype", "world_size", "sp", "fsdp", "max_batch_tokens", "allow_slow_kernels",
                "served_model_name"):
        assert key in dumped


@pytest.mark.parametrize("bad", [b"{not json\n", b'{"logprobs": []}\n', b"\n", b'{"id": 3}\n'], ids=["garbage", "no-id", "blank", "int-id"])
def test_resume_refuses_a_corrupt_middle_line_and_keeps_the_lines_after_it(monkeypatch, tmp_path, capsys, bad):
    """A bad line in the middle of OUT is not a torn write: the run stops naming it, and no good
    line after it is dropped (or scored again)."""
    backend = FakeBackend()
    monkeypatch.setattr("service.backends.load_backend", lambda settings: backend)
    rows = [{"id": f"r{i}", "input_ids": [1, 2, 3 + i]} for i in range(6)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    lines = out.read_bytes().splitlines(keepends=True)
    corrupt = b"".join(lines[:2]) + bad + b"".join(lines[2:])
    out.write_bytes(corrupt)
    scored_before = sum(len(row) for row in backend.rows)
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out}:3: not a result line" in err and "Traceback" not in err, err
    assert out.read_bytes() == corrupt, "OUT must be left as it was"
    assert sum(len(row) for row in backend.rows) == scored_before


def test_a_key_file_is_read_once_and_its_value_kept(tmp_path):
    """A secret injector may hand the key through a pipe that can be read once: the start-up
    check reads each key file and the rest of the run uses the value."""
    from service.cli import _check_model_and_key

    api, admin = tmp_path / "api", tmp_path / "admin"
    api.write_text("k1\n")
    admin.write_text("k2\n")
    checked = _check_model_and_key(Settings(api_key_file=api, admin_key_file=admin))
    api.unlink()
    admin.unlink()
    assert checked.api_key_file is None and checked.admin_key_file is None
    assert (checked.resolved_api_key(), checked.resolved_admin_key()) == ("k1", "k2")
    assert _check_model_and_key(Settings()).resolved_api_key() is None


def test_keys_no_header_can_carry_or_one_key_for_both_routes_are_refused_at_start(tmp_path, capsys):
    """A key file with a line break inside, or a key beyond ASCII (which HTTP clients send as Latin-1 or
    refuse), would leave every request 401; an admin key equal to the
    API key would let the scoring key update weights, which /v1/weights must refuse."""
    split = tmp_path / "split"
    split.write_text("first-half\nsecond-half\n")
    same = tmp_path / "same"
    same.write_text("one-key\n")
    accented = tmp_path / "accented"
    accented.write_text("cl\u00e9-half\n")
    for argv, message in [
        (["serve", "--api-key", "half-\u00e9t\u00e9"], "the API key (--api-key / PACKSCORE_API_KEY) holds a character "
                                                  "beyond ASCII"),
        (["serve", "--admin-key-file", str(accented)], f"the admin key file (--admin-key-file / "
                                                       f"PACKSCORE_ADMIN_KEY_FILE) {accented} holds a character beyond ASCII"),
        (["serve", "--api-key-file", str(split)], f"the API key file (--api-key-file / PACKSCORE_API_KEY_FILE) {split} "
                                                  "holds a control character"),
        (["serve", "--admin-key-file", str(split)], "the admin key file"),
        (["serve", "--api-key", "one-key", "--admin-key-file", str(same)], "the admin key (--admin-key / "
                                                                          "--admin-key-file) is the API key"),
    ]:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "half" not in err and "one-key" not in err, err


def test_a_served_model_name_beside_a_named_model_is_refused_not_dropped(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_settings(["serve", "--model", "policy=tiny", "--served-model-name", "other"])
    assert exit_.value.code == 2
    assert "--served-model-name 'other' and --model policy=... both name the model" in capsys.readouterr().err


def test_serve_exits_early_on_sigterm_and_gives_it_back_to_the_server_score_stops_by_its_paths():
    import signal

    from service.entrypoint import after_serving, exit_before_serving, handle_early_signals, terminate_before_scoring

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        handle_early_signals(["score", "in.jsonl", "-o", "out.jsonl"])  # a line and 143 (test_offline_sigterm.py)
        assert signal.getsignal(signal.SIGTERM) is terminate_before_scoring
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        handle_early_signals(["--version"])
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        handle_early_signals(["serve", "--port", "0"])
        assert signal.getsignal(signal.SIGTERM) is exit_before_serving
        assert after_serving(exit_before_serving) is signal.SIG_DFL
        mine = lambda signum, frame: None  # noqa: E731
        signal.signal(signal.SIGTERM, mine)  # a handler of someone else's is never replaced nor taken back
        handle_early_signals(["serve"])
        handle_early_signals(["score"])
        assert signal.getsignal(signal.SIGTERM) is mine and after_serving(mine) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_key_on_the_command_line_wins_over_the_other_form_in_the_environment(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PACKSCORE_API_KEY_FILE", str(tmp_path / "absent"))
    monkeypatch.setenv("PACKSCORE_ADMIN_KEY", "from-env")
    admin_file = tmp_path / "admin"
    admin_file.write_text("from-file\n")
    _, settings = cli.parse_settings(["serve", "--api-key", "given", "--admin-key-file", str(admin_file)])
    assert settings.resolved_api_key() == "given" and settings.resolved_admin_key() == "from-file"
    monkeypatch.delenv("PACKSCORE_ADMIN_KEY")
    _, settings = cli.parse_settings(["serve"])  # the environment's file alone: read, and named when it fails
    with pytest.raises(ValueError, match=r"API key file \(--api-key-file / PACKSCORE_API_KEY_FILE\) .*absent cannot be read"):
        settings.resolved_api_key()
    assert cli.main(["serve"]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00key")
    monkeypatch.setenv("PACKSCORE_API_KEY_FILE", str(binary))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        cli.parse_settings(["serve"])[1].resolved_api_key()
