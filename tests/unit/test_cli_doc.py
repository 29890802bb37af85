"""docs/cli.md against the parser `--help` prints (test_cli.py checks its tables' options and defaults):
the forms an option's help says it takes are in the option's row, and the model options the offline
section says `score` takes are score's own."""

import argparse
import re
from pathlib import Path

from service import cli

DOC = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()


def _help(command: str, option: str) -> str:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return next(action.help for action in sub._actions if option in action.option_strings)


def _row(option: str) -> str:
    return next(line for line in DOC.splitlines() if line.startswith(f"| `{option}`"))


def test_the_model_row_names_the_several_models_form_serves_help_gives():
    """serve's --model help gives NAME=PATH_OR_PRESET, repeated, and PACKSCORE_MODEL's two forms of it;
    a row giving one model only leaves a reader of the option table without the form."""
    help_text = _help("serve", "--model")
    forms = re.findall(r"\b[A-Z_]+=[A-Z_]+\b", help_text) + ["PACKSCORE_MODEL", "comma-separated", "JSON object"]
    assert "NAME=PATH_OR_PRESET" in forms and all(form in help_text for form in forms), help_text
    row = _row("--model")
    assert not [form for form in forms if form not in row], row


def test_the_model_options_the_offline_section_lists_are_scores():
    listed = re.search(r"It\s+takes\s+the\s+model\s+options\s+above\s+\((.*?)\)\s+plus\s+these", DOC, re.S)
    assert listed, "docs/cli.md: the offline section no longer lists the model options score takes"
    documented = {name.replace("[no-]", "") for name in re.findall(r"`(--[\[\]a-z-]+)`", listed.group(1))}
    assert documented == {"--" + name.replace("_", "-") for name in cli._MODEL_OPTIONS}


def test_score_documents_the_named_model_form_it_takes(tmp_path):
    """score parses --model as serve does: NAME=PATH_OR_PRESET names its one model, so NAME is each result
    line's model, as --served-model-name makes it; its help and the offline section say so."""
    import orjson

    help_text = _help("score", "--model")
    assert "NAME=PATH_OR_PRESET" in help_text and "model field" in help_text, help_text
    offline = DOC[DOC.index("## Offline scoring"):]
    assert "`NAME=PATH_OR_PRESET`" in offline and "`--model NAME=...`" in offline, offline[:2000]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b'{"id": "a", "input_ids": [1, 2, 3]}\n')
    assert cli.main(["score", str(source), "-o", str(out), "--model", "policy=tiny"]) == 0
    (line,) = out.read_bytes().splitlines()
    assert orjson.loads(line)["model"] == "policy", line


def test_the_hub_errors_the_doc_quotes_are_those_the_cli_prints(tmp_path):
    """The three `packscore: error: --model Qwen/...` blocks of "What `--model` takes", each made
    anew in an offline cache (HF_HOME=/data/hf there) and compared line for line."""
    import json
    import os
    import subprocess
    import sys

    quoted = re.findall(r"```\n(packscore: error: --model Qwen/Qwen3\.5-9B .*?)\n```", DOC)
    assert len(quoted) == 3, quoted
    repo, commit = tmp_path / "hub" / "models--Qwen--Qwen3.5-9B", "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACKSCORE_", "HF_"))}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}

    def printed() -> str:
        done = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model", "Qwen/Qwen3.5-9B"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        return done.stderr.splitlines()[-1]

    def shown(line: str) -> str:
        return line.replace("/data/hf/hub", str(tmp_path / "hub")).replace("<commit>", commit)

    assert printed() == shown(quoted[0])  # not cached at all
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text("{}")
    assert printed() == shown(quoted[1])  # config.json alone
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {s: s for s in shards}}))
    for shard in shards[:2]:
        (snapshot / shard).touch()
    assert printed() == shown(quoted[2])  # two of the index's four shards
