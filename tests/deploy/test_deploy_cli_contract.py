"""The chart's and the image's command lines are accepted by the real `packscore serve` parser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deploy_helpers import CLI_OPTIONS, REPO, VALUE_SETS, container
from service.cli import build_parser, parse_settings
from service.settings import Settings


def test_cli_options_are_every_option_packscore_serve_documents(capsys, monkeypatch):
    # A hand-kept subset refused real options (--weights-root) in value sets; `serve --help` is the truth.
    monkeypatch.setenv("COLUMNS", "10000")  # no line wrapped inside an option name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    documented = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", capsys.readouterr().out)) - {"--help"}
    assert CLI_OPTIONS == documented, (CLI_OPTIONS ^ documented)
    assert {"--weights-root", "--admin-key-file", "--api-key-file"} <= CLI_OPTIONS


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_chart_args_parse_into_the_intended_settings(name):
    c = container(VALUE_SETS[name])
    args, settings = parse_settings(["serve", *c["args"]])
    assert args.command == "serve"
    assert settings.host == "0.0.0.0"
    assert settings.port == c["ports"][0]["containerPort"]
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert settings.world_size == (VALUE_SETS[name].get("parallel", {}).get("worldSize") or gpus)
    assert settings.triton_cache_dir == Path("/cache/triton")
    assert settings.model == c["args"][c["args"].index("--model") + 1]


def test_all_features_layout_reaches_the_settings():
    values = VALUE_SETS["qwen9b-pvc-all-features"]
    _, s = parse_settings(["serve", *container(values)["args"]])
    assert (s.world_size, s.sp, s.fsdp) == (8, 2, True)
    assert (s.max_batch_tokens, s.max_queued_tokens, s.max_model_len) == (65536, 4_000_000, 262_144)
    assert s.max_request_bytes == 268_435_456 and s.max_wait_ms == 5 and s.dtype == "bfloat16"
    assert s.drain_timeout_s == 120 and s.device == "cuda"


def test_environment_names_used_by_the_deployment_are_settings():
    dockerfile = (REPO / "Dockerfile").read_text()
    names = set(re.findall(r"\bPACKSCORE_([A-Z_]+)=", dockerfile)) | {"API_KEY"}  # API_KEY: the chart's secret env
    assert names, "the image sets PACKSCORE_ variables"
    for name in names:
        assert name.lower() in Settings.model_fields, f"PACKSCORE_{name} is no option of packscore serve"


def test_docker_run_examples_in_the_docs_parse():
    readme = (REPO / "deploy" / "README.md").read_text().replace("\\\n", " ")
    runs = [line.split(" IMAGE", 1)[1].split() for line in readme.splitlines()
            if line.strip().startswith("docker run") and " IMAGE" in line]
    assert len(runs) >= 3
    models = []
    for image_args in runs:
        _, s = parse_settings(["serve", *image_args])
        models.append(s.model)
    assert "tiny" in models and "/models/Qwen3.5-9B" in models
