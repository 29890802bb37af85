"""The deployment docs say what the files do: documented commands and values exist and work."""

from __future__ import annotations

import re

import yaml

from deploy_helpers import CHART, CLI_OPTIONS, REPO, arg_value, container, manifests
from service.cli import parse_settings
from service.http.server import _EXIT_GRACE_S
from service.settings import Settings

DEPLOY_README = (REPO / "deploy" / "README.md").read_text()
CHART_README = (CHART / "README.md").read_text()
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def code_blocks(markdown: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", markdown, re.DOTALL)


def test_deployment_section_documents_both_docker_runs():
    assert DEPLOY_README.startswith("## Deployment\n")
    commands = [line.strip() for block in code_blocks(DEPLOY_README, "bash") for line in block.splitlines()]
    assert "docker run --gpus all --shm-size 16g --stop-timeout 40 -p 8000:8000 IMAGE" in commands
    assert ("docker run --gpus all --shm-size 16g --stop-timeout 40 -p 8000:8000 -v /models:/models:ro IMAGE "
            "--model /models/Qwen3.5-9B") in commands


def test_docker_run_options_are_packscore_serve_options():
    for block in code_blocks(DEPLOY_README, "bash"):
        command = block.replace("\\\n", " ")
        for line in command.splitlines():
            if "docker run" in line and " IMAGE " in f"{line} " and "--entrypoint" not in line:  # tini's: test_deploy_dockerfile
                after_image = line.split(" IMAGE", 1)[1].split()
                flags = {a for a in after_image if a.startswith("--")}
                assert flags <= CLI_OPTIONS, flags - CLI_OPTIONS


def test_docker_stop_gets_the_time_a_drain_takes():
    # docker stop sends SIGKILL 10 s after SIGTERM unless told otherwise: that cuts the default drain short.
    drain_ends = Settings.model_fields["drain_timeout_s"].default + _EXIT_GRACE_S
    assert drain_ends > 10
    text = DEPLOY_README.replace("\\\n", " ")
    timeouts = [int(t) for t in re.findall(r"--stop-timeout (\d+)", text) + re.findall(r"docker stop -t (\d+)", text)]
    assert len(timeouts) >= 2, "the README tells how to give docker stop the drain's time"
    assert all(t > drain_ends for t in timeouts), (timeouts, drain_ends)
    full = [line for line in text.splitlines() if "docker run" in line and "--read-only" in line]
    assert full and all("--stop-timeout" in line for line in full), full


# Sections whose keys are the chart's own (the others pass Kubernetes fields through).
OWN_SECTIONS = {"image", "model", "parallel", "server", "apiKey", "shm", "tmp", "cache", "serviceAccount",
                "probes", "service", "podDisruptionBudget", "serviceMonitor", "prometheusRule", "autoscaling",
                "networkPolicy", "weights"}


def test_chart_readme_mentions_every_value():
    for key, value in VALUES.items():
        assert f"`{key}" in CHART_README, key
        if key in OWN_SECTIONS:
            for sub in value:
                assert f"`{key}.{sub}`" in CHART_README, f"{key}.{sub}"


def test_chart_readme_value_examples_render():
    examples = [yaml.safe_load(b) for b in code_blocks(CHART_README, "yaml")]
    values_examples = [e for e in examples if set(e) <= set(VALUES)]
    assert len(values_examples) >= 2
    for example in values_examples:
        assert manifests(example)
    first = values_examples[0]
    c = container(first)
    assert arg_value(c["args"], "--model") == "/models/Qwen3.5-9B"
    assert any(e["name"] == "PACKSCORE_API_KEY" for e in c["env"])


def test_install_command_in_the_deploy_readme_uses_real_values():
    (install,) = [b for b in code_blocks(DEPLOY_README, "bash") if "helm install" in b]
    settings = dict(m.split("=", 1) for m in re.findall(r"--set (\S+)", install))
    values: dict = {}
    for dotted, value in settings.items():
        node = values
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    c = container(values)
    assert c["image"] == "registry.example.com/ml/packscore:0.1.0"
    assert arg_value(c["args"], "--model") == "/models/Qwen3.5-9B"


def test_hub_id_docs_mount_a_cache_because_the_image_is_offline():
    # The image sets HF_HUB_OFFLINE=1 and starts with an empty cache: a hub id works only from a mounted one.
    assert "HF_HUB_OFFLINE=1" in (REPO / "Dockerfile").read_text()
    for readme in [DEPLOY_README, CHART_README]:
        assert "HF_HUB_OFFLINE=1" in readme
    (run,) = [line for line in DEPLOY_README.splitlines() if line.startswith("docker run") and "--model Qwen/" in line]
    docker_opts, image_args = run.split(" IMAGE ", 1)
    _, s = parse_settings(["serve", *image_args.split()])
    assert s.model == "Qwen/Qwen3.5-9B"
    (hf_home,) = re.findall(r"-e HF_HOME=(\S+)", docker_opts)
    assert any(m.split(":")[1] == hf_home for m in re.findall(r"-v (\S+)", docker_opts)), docker_opts
    (values,) = [e for e in (yaml.safe_load(b) for b in code_blocks(CHART_README, "yaml"))
                 if e.get("model", {}).get("path") == "Qwen/Qwen3.5-9B"]
    c = container(values)
    _, s = parse_settings(["serve", *c["args"]])
    assert s.model == "Qwen/Qwen3.5-9B"
    (cache,) = [e["value"] for e in c["env"] if e["name"] in ("HF_HUB_CACHE", "HF_HOME")]
    assert any(cache.startswith(m["mountPath"] + "/") for m in c["volumeMounts"] if m["name"] == "model"), cache


def test_several_models_example_serves_each_by_name():
    (values,) = [e for e in (yaml.safe_load(b) for b in code_blocks(CHART_README, "yaml"))
                 if "=" in e.get("model", {}).get("path", "")]
    _, s = parse_settings(["serve", *container(values)["args"]])
    specs = s.model_specs()
    assert len(specs) == 2 and None not in specs, specs
    assert all(path.startswith(VALUES["model"]["mountPath"] + "/") for path in specs.values()), specs


def test_weight_updates_example_serves_post_v1_weights_from_the_mounted_root():
    (values,) = [e for e in (yaml.safe_load(b) for b in code_blocks(CHART_README, "yaml")) if "weights" in e]
    c = container(values)
    _, s = parse_settings(["serve", *c["args"]])
    assert s.weights_root is not None and s.admin_key_file is not None
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "weights"]
    assert mount["mountPath"] == str(s.weights_root) and mount["readOnly"] is True
    assert any(str(s.admin_key_file).startswith(m["mountPath"] + "/") for m in c["volumeMounts"]
               if m["name"] == "admin-key")


def _section(markdown: str, heading: str) -> str:
    return markdown.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def _lookup(dotted: str):
    node = VALUES
    for part in dotted.split("."):
        node = node[part]
    return node


def test_chart_readme_all_values_defaults_are_values_yaml():
    # Each row pairs its backticked values with its defaults in order; a backticked default is the literal.
    wrong, checked = [], 0
    for row in _section(CHART_README, "## All values").splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = re.findall(r"`([\w.]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(", ")] if cells[1] else []
        if len(names) != len(defaults):
            continue
        for name, default in zip(names, defaults):
            literal = re.fullmatch(r"`([^`]*)`", default)
            if literal is None:
                continue
            value, expected = _lookup(name), yaml.safe_load(literal.group(1))
            if isinstance(value, dict) and isinstance(expected, dict) and expected:  # `type: none`: one key of it
                value = {k: value[k] for k in expected}
            checked += 1
            if value != expected:
                wrong.append(f"{name}: README {default}, values.yaml {value!r}")
    assert checked >= 40, checked
    assert not wrong, wrong


def test_chart_readme_service_account_default_is_the_full_name():
    rendered = manifests()  # a release name that is not the full name
    (account,) = [d for d in rendered if d["kind"] == "ServiceAccount"]
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    assert account["metadata"]["name"] == deployment["metadata"]["name"]  # the full name, not the release's
    row = next(r for r in _section(CHART_README, "## All values").splitlines() if r.startswith("| `serviceAccount.create`"))
    assert "full name" in row, row


_COUNTS = {"ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15}


def test_chart_readme_alerts_table_matches_the_rendered_rules():
    rendered = manifests({"prometheusRule": {"enabled": True}})
    (rule,) = [d for d in rendered if d["kind"] == "PrometheusRule"]
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    source = (CHART / "templates" / "prometheusrule.yaml").read_text()
    keys = dict((alert, key) for key, alert in re.findall(r"\$a\.(\w+) \}\}\n\s*\{\{- if \.enabled \}\}\n\s*- alert: (\w+)", source))
    assert set(keys) == set(rules) and set(keys.values()) == set(VALUES["prometheusRule"]["alerts"]), (keys, rules)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(Packscore\w+)` \| ([^|]*) \|", CHART_README, re.M)}
    assert set(rows) == set(rules), set(rows) ^ set(rules)
    for alert, default in rows.items():
        settings = VALUES["prometheusRule"]["alerts"][keys[alert]]
        severity, duration = (p.strip() for p in default.split(";")[0].split(","))
        assert (severity, duration) == (settings["severity"], settings["for"]), (alert, default)
        for key, value in re.findall(r"`(\w+): ([^`]+)`", default):
            assert yaml.safe_load(value) == settings[key], (alert, key, value, settings)
    (count,) = re.findall(r"all (\w+) on", _section(CHART_README, "## All values"))
    assert _COUNTS.get(count, count) == len(rules), (count, len(rules))


def test_every_documented_docker_run_outlasts_the_drain():
    """Docker kills 10 s after SIGTERM by default, a third of the default 30 s drain."""
    pages = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    runs = [(page.name, line) for page in pages for line in page.read_text().splitlines()
            if line.lstrip().startswith("docker run ")]
    assert runs
    short = [(name, line) for name, line in runs if "--stop-timeout 40" not in line]
    assert not short, short


def test_every_documented_read_only_docker_run_gives_home_a_writable_place():
    """The image's HOME is on the root filesystem: with --read-only, torch, Triton, huggingface_hub and
    CUDA's JIT cache fall back to $HOME (~/.cache, ~/.nv) and fail to write there."""
    (image_home,) = re.findall(r"\bENV HOME=(\S+)", (REPO / "Dockerfile").read_text())
    pages = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    runs = [line.split(" IMAGE", 1)[0] for page in pages for line in page.read_text().replace("\\\n", " ").splitlines()
            if line.lstrip().startswith("docker run ") and "--read-only" in line]
    assert runs
    for run in runs:
        writable = [t.split(":")[0] for t in re.findall(r"--tmpfs (\S+)", run)]
        writable += [v.split(":")[1] for v in re.findall(r"-v (\S+)", run) if "ro" not in v.split(":")[2:]]
        (home,) = re.findall(r"-e HOME=(\S+)", run) or [image_home]
        assert any(home == m or home.startswith(m + "/") for m in writable), (home, writable, run)
