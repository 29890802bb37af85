"""The chart's and the image's command lines are accepted by the real `packscore serve` parser."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import pytest

from deploy_helpers import CLI_OPTIONS, REPO, VALUE_SETS, arg_value, container, render_chart
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
            if line.strip().startswith("docker run") and " IMAGE" in line and "--entrypoint" not in line]
    assert len(runs) >= 3
    models = []
    for image_args in runs:
        _, s = parse_settings(["serve", *image_args])
        models.append(s.model)
    assert "tiny" in models and "/models/Qwen3.5-9B" in models


def _chart_set_options() -> set[str]:
    """Every option the chart writes from a value, over value sets that turn each one on."""
    value_sets = [*VALUE_SETS.values(), {"server": {"allowSlowKernels": True, "kernels": "attention=varlen"}}]
    value_sets = [{**v, "server": {**v.get("server", {}), "extraArgs": []}} for v in value_sets]  # the chart's own
    flags = {a.split("=")[0] for values in value_sets for a in container(values)["args"] if a.startswith("--")}
    flags.add("--weights-record")  # set as PACKSCORE_WEIGHTS_RECORD, which the option would override
    flags.add("--api-key-file")  # would override PACKSCORE_API_KEY from apiKey.secretName, and the scrape's token
    flags |= {"--no-" + f[2:] for f in flags if "--no-" + f[2:] in CLI_OPTIONS}  # the negation of a switch
    return flags - {"--model"}  # repeated on purpose: more models beside model.path


def _shortest_abbreviation(flag: str) -> str:
    """The shortest prefix argparse resolves to ``flag`` alone."""
    for end in range(3, len(flag)):
        prefix = flag[:end]
        if prefix not in CLI_OPTIONS and [o for o in CLI_OPTIONS | {"--help"} if o.startswith(prefix)] == [flag]:
            return prefix
    return flag


def test_packscore_serve_takes_an_abbreviated_option():
    # so the chart must refuse abbreviations of its options too, not only their whole names
    assert parse_settings(["serve", "--drain=5"])[1].drain_timeout_s == 5


@pytest.mark.parametrize("flag", sorted(_chart_set_options()))
def test_extra_args_cannot_override_an_option_the_chart_sets(flag):
    # The last one given wins: --drain-timeout-s 300 would outlast the grace period, --port the probes.
    for extra in ([flag, "1"], [f"{flag}=1"], [_shortest_abbreviation(flag), "1"], [f"{flag} 1"]):
        with pytest.raises(helm.HelmError) as err:
            render_chart({"server": {"extraArgs": extra}})
        assert f"is (or abbreviates) {flag}, which the chart sets from" in str(err.value), (extra, str(err.value))


# Options whose value is a key itself: on the command line, `ps` and the pod spec would show it.
KEY_OPTIONS = {"--api-key": "apiKey.secretName", "--admin-key": "weights.adminKey.secretName"}


@pytest.mark.parametrize("flag", sorted(KEY_OPTIONS))
def test_extra_args_never_put_a_key_on_the_command_line(flag):
    assert flag in CLI_OPTIONS
    # --admin-key is also the start of --admin-key-file: the key's own message, not that option's
    for extra in ([flag, "s3cret"], [f"{flag}=s3cret"], [flag[:-1], "s3cret"], [f"{flag} s3cret"]):
        with pytest.raises(helm.HelmError) as err:
            render_chart({"server": {"extraArgs": extra}})
        message = str(err.value)
        assert f"is (or abbreviates) {flag}, which would put a key on the command line" in message, (extra, message)
        assert "s3cret" not in message, message  # the render's error lands in CI logs
        assert f"set {KEY_OPTIONS[flag]} (a Secret" in message, message


def _variable(flag: str) -> str:
    return "PACKSCORE_" + flag.removeprefix("--").replace("-", "_").upper()


# The variable of every option the chart sets or passes from a Secret; a --no- switch has none.
CHART_VARIABLES = sorted({_variable(f) for f in _chart_set_options() | set(KEY_OPTIONS) | {"--model"}
                          if not f.startswith("--no-")})


@pytest.mark.parametrize("name", CHART_VARIABLES)
def test_env_cannot_set_what_the_chart_sets(name):
    # The server reads PACKSCORE_<OPTION> where the command line leaves it (server.maxQueuedTokens null:
    # PACKSCORE_MAX_QUEUED_TOKENS would escape the autoscaling check), in any case (pydantic-settings).
    assert name.removeprefix("PACKSCORE_").lower() in Settings.model_fields
    for given in (name, name.lower()):
        with pytest.raises(helm.HelmError) as err:
            render_chart({"env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": given, "value": "1"}]})
        message = str(err.value)
        assert f"env({given}) sets --" in message and ", which the chart sets from " in message, message


@pytest.mark.parametrize("name", ["PACKSCORE_LOG_LEVEL", "PACKSCORE_QUEUE_SECONDS", "PACKSCORE_PREFIX_SHARING",
                                  "PACKSCORE_FLA_AUTOTUNE", "PACKSCORE_CACHE_DIR", "PACKSCORE_EXPERT_GEMM",
                                  "PACKSCORE_NO_FSDP", "HF_HUB_CACHE", "TRITON_PRINT_AUTOTUNING"])
def test_env_takes_what_the_chart_leaves_alone(name):
    assert {"name": name, "value": "1"} in container({"env": [{"name": name, "value": "1"}]})["env"]


def _chart_environment() -> dict[str, tuple[str | None, list[dict]]]:
    """Every variable the chart puts in the container (its value, None from a Secret) and the container's
    mounts, over value sets that turn each one on, the user's env left out."""
    found = {}
    for values in VALUE_SETS.values():
        c = container({**values, "env": []})
        found.update({e["name"]: (e.get("value"), c["volumeMounts"]) for e in c["env"]})
    return found


CHART_ENVIRONMENT = _chart_environment()
# The value that sizes or replaces each writable volume a cache or scratch variable points into.
VOLUME_VALUES = {"cache": "cache.existingClaim or cache.sizeLimit (the /cache volume)",
                 "tmp": "tmp.sizeLimit (the /tmp volume)"}


@pytest.mark.parametrize("name", sorted(CHART_ENVIRONMENT))
def test_env_cannot_repeat_a_variable_the_chart_sets(name):
    # Kubernetes keeps the last of two names: after the chart's, TRITON_CACHE_DIR=/elsewhere would move the
    # kernel cache off the volume cache.existingClaim keeps (onto the read-only root filesystem), silently.
    with pytest.raises(helm.HelmError) as err:
        render_chart({"env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": name, "value": "/elsewhere"}]})
    message = str(err.value)
    if name.startswith("PACKSCORE_"):  # an option's variable: test_env_cannot_set_what_the_chart_sets
        assert f"env({name}) sets --" in message, message
        return
    value, mounts = CHART_ENVIRONMENT[name]
    (volume,) = [m["name"] for m in mounts if value == m["mountPath"] or value.startswith(m["mountPath"] + "/")]
    assert f"env({name}) repeats the chart's {name}={value}" in message, message
    assert message.endswith(f"set {VOLUME_VALUES[volume]} instead"), message


def test_env_cannot_set_the_inductor_cache_the_server_sets_from_the_chart(tmp_path, monkeypatch):
    # The server pops TORCHINDUCTOR_CACHE_DIR and sets it to DIR/inductor from --triton-cache-dir: a user's is dropped.
    from model_runtime.kernels.cache import configure_kernel_cache

    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(variable, "")  # restored after the test, as configure_kernel_cache sets both
        monkeypatch.delenv(variable)
    inductor = Path(configure_kernel_cache(tmp_path)["inductor"]).relative_to(tmp_path.resolve())
    expected = f"TORCHINDUCTOR_CACHE_DIR={arg_value(container()['args'], '--triton-cache-dir')}/{inductor}"
    with pytest.raises(helm.HelmError) as err:
        render_chart({"env": [{"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/elsewhere"}]})
    message = str(err.value)
    assert f"env(TORCHINDUCTOR_CACHE_DIR) repeats {expected}, which the server sets from the chart's" in message
    assert message.endswith(f"set {VOLUME_VALUES['cache']} instead"), message


@pytest.mark.parametrize("option", sorted(CLI_OPTIONS - _chart_set_options() - set(KEY_OPTIONS)))
def test_extra_args_take_every_option_the_chart_leaves_alone(option):
    assert container({"server": {"extraArgs": [option, "x"]}})["args"][-2:] == [option, "x"]


def test_extra_args_refuse_an_option_and_its_value_in_one_element():
    # One argv word: argparse takes a word with a space for a positional and the server exits 2 at start (CrashLoop).
    with pytest.raises(SystemExit):
        parse_settings(["serve", "--queue-seconds 8"])
    with pytest.raises(helm.HelmError) as err:
        render_chart({"server": {"extraArgs": ["--device", "cuda", "--queue-seconds 8"]}})
    assert str(err.value).endswith('server.extraArgs(--queue-seconds 8) holds an option and its value in one element, '
                                   'which the server refuses at start (unrecognized arguments): give them as two '
                                   'elements ("--queue-seconds", "8") or as --queue-seconds=8'), str(err.value)
    for extra in (["--queue-seconds", "8"], ["--queue-seconds=8"]):  # the two forms the message offers
        assert parse_settings(["serve", *container({"server": {"extraArgs": extra}})["args"]])[1].queue_seconds == 8
