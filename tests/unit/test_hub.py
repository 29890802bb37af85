"""``--model ORG/NAME`` resolved through an offline Hugging Face cache, in a fresh process (the hub
reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported), and the one-line error when it is not cached."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import as_hub_cache

REPO = "acme/tiny-qwen"
ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, cache, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PACKSCORE_", "HF_"))}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    if cwd is not None:  # this checkout still imported from elsewhere
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120,
                          cwd=cwd)


RESOLVE = "import sys; from service.hub import resolve_model_source as r; print(r(sys.argv[1], sys.argv[2] or None))"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, checkpoint_dir):
    cache = tmp_path_factory.mktemp("hub")
    return cache, as_hub_cache(checkpoint_dir("qwen3_5"), cache, REPO)


def test_a_cached_hub_id_resolves_to_its_snapshot_offline(hub_cache):
    cache, snapshot = hub_cache
    for revision in ("", "main", snapshot.name):  # the default branch, named, and the commit itself
        out = _run(RESOLVE, cache, REPO, revision)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(snapshot), (revision, out.stdout)
    # Presets and directories are not hub ids: unchanged, whatever the cache holds.
    out = _run(RESOLVE, cache, "tiny", "")
    assert out.stdout.strip() == "tiny", out.stderr


def test_an_uncached_hub_id_offline_is_one_clear_line_and_exit_2(hub_cache, tmp_path):
    cache, _ = hub_cache
    cli = "import sys; from service.cli import main; sys.exit(main(sys.argv[1:]))"
    for model, revision in (("acme/not-downloaded", []), (REPO, ["--revision", "v9"])):
        out = _run(cli, cache, "serve", "--model", model, *revision, "--port", "0")
        assert out.returncode == 2, (out.returncode, out.stderr)
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert str(cache) in errors[0] and model in errors[0] and "HF_HUB_OFFLINE" in errors[0], errors[0]
        assert f"`hf download {model}{' --revision v9' if revision else ''}`" in errors[0], errors[0]
    out = _run(cli, cache, "serve", "--model", "not a model")
    assert out.returncode == 2 and "hub id (ORG/NAME)" in out.stderr, out.stderr
    # ORG/NAME in form, but a name the hub never gives (a local path mistyped): not a directory either
    out = _run(cli, cache, "serve", "--model", "runs/qwen--sft")
    assert out.returncode == 2 and "neither a checkpoint directory" in out.stderr, out.stderr
    assert "valid Hugging Face hub id (Cannot have -- or .." in out.stderr, out.stderr


def test_the_served_name_of_a_hub_id_is_the_hub_id(hub_cache):
    cache, snapshot = hub_cache
    code = ("import json, sys; from service.cli import _resolve_hub_model; from service.settings import Settings; "
            "s = _resolve_hub_model(Settings(model=sys.argv[1])); print(json.dumps([s.model, s.served_model_name]))")
    out = _run(code, cache, REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [str(snapshot), REPO]


def test_a_hub_id_cached_without_its_safetensors_is_refused_naming_the_hub_id(hub_cache, tmp_path):
    """A partial download (or HF_HUB_OFFLINE with only config.json cached) is refused while resolving,
    naming the hub id and what to do, not later as a snapshot path that 'has no *.safetensors'."""
    cache, snapshot = hub_cache
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((snapshot / "config.json").read_bytes())
    as_hub_cache(config_only, cache, "acme/partial")
    cli = "import sys; from service.cli import main; sys.exit(main(sys.argv[1:]))"
    for revision, again in (([], "`hf download acme/partial`"), (["--revision", "main"], "`hf download acme/partial --revision main`")):
        out = _run(cli, cache, "serve", "--model", "acme/partial", *revision, "--port", "0")
        assert out.returncode == 2, (out.returncode, out.stderr)
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert "--model acme/partial (revision main)" in errors[0] and "no *.safetensors weights" in errors[0], errors[0]
        assert "incomplete download" in errors[0] and again in errors[0] and "checkpoint directory" in errors[0], errors[0]


def test_a_hub_id_cached_without_some_shards_of_its_index_is_refused_naming_them(hub_cache, tmp_path):
    """An interrupted download of a sharded checkpoint is refused while resolving, naming the hub id,
    the missing shards and the command that finishes the download, not later as a snapshot path whose
    'shards listed in model.safetensors.index.json are missing'. The complete snapshot resolves."""
    from tests.checkpoints import build_hf_model

    cache, _ = hub_cache
    sharded = tmp_path / "sharded"
    build_hf_model("qwen3_5").save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 8, shards
    snapshot = as_hub_cache(sharded, cache, "acme/sharded")
    out = _run(RESOLVE, cache, "acme/sharded", "")
    assert out.returncode == 0 and out.stdout.strip() == str(snapshot), out.stderr
    (snapshot / shards[2]).resolve().unlink()  # its link left dangling: no shard either
    for name in shards[3:]:
        (snapshot / name).unlink()
    absent = len(shards) - 2
    cli = "import sys; from service.cli import main; sys.exit(main(sys.argv[1:]))"
    for revision, again in (([], "`hf download acme/sharded`"), (["--revision", "main"], "`hf download acme/sharded --revision main`")):
        out = _run(cli, cache, "serve", "--model", "acme/sharded", *revision, "--port", "0")
        assert out.returncode == 2, (out.returncode, out.stderr)
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        line = errors[0]
        assert "--model acme/sharded (revision main)" in line and again in line and "incomplete download" in line, line
        assert f"lacks {absent} of the {len(shards)} shards its model.safetensors.index.json lists" in line, line
        assert f"({', '.join(shards[2:7])}, ... and {absent - 5} more)" in line, line
        assert shards[0] not in line and shards[7] not in line, line


def test_a_hub_id_cached_without_its_config_is_refused_as_an_incomplete_download(hub_cache, tmp_path):
    """A snapshot whose config.json link points at a blob that is gone, or that never got config.json
    (only the weights downloaded), is a partial download: the line says so and how to finish it,
    not that the repository is no transformers checkpoint."""
    cache, snapshot = hub_cache
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for file in snapshot.glob("*.safetensors"):
        (weights_only / file.name).write_bytes(file.read_bytes())
    as_hub_cache(weights_only, cache, "acme/no-config")
    dangling = as_hub_cache(snapshot, cache / "dangling", "acme/lost-config")
    (dangling / "config.json").resolve().unlink()
    cli = "import sys; from service.cli import main; sys.exit(main(sys.argv[1:]))"
    for where, model in ((cache, "acme/no-config"), (cache / "dangling", "acme/lost-config")):
        out = _run(cli, where, "serve", "--model", model, "--port", "0")
        assert out.returncode == 2, (out.returncode, out.stderr)
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"--model {model} (revision main)" in errors[0] and "has no config.json" in errors[0], errors[0]
        assert "incomplete download" in errors[0] and f"`hf download {model}`" in errors[0], errors[0]


def test_a_revision_with_no_hub_id_to_apply_it_to_is_refused_not_ignored(hub_cache, tmp_path, checkpoint_dir):
    """--revision beside a preset or a checkpoint directory (one named as a hub id wins over the hub)
    stops the start naming each --model, rather than serve something other than the revision asked for;
    beside a hub id among several models it applies to that one."""
    cache, snapshot = hub_cache
    (tmp_path / "acme").mkdir()
    (tmp_path / REPO).symlink_to(checkpoint_dir("qwen3_5"))
    cli = "import sys; from service.cli import main; sys.exit(main(sys.argv[1:]))"
    for models, said in ((["tiny"], "--model tiny is a preset"),
                         ([REPO], f"--model {REPO} is a checkpoint directory (it wins over the hub id of that name)"),
                         (["a=tiny", f"b={checkpoint_dir('qwen3_5')}"], "--model tiny is a preset; --model ")):
        argv = [arg for m in models for arg in ("--model", m)]
        out = _run(cli, cache, "serve", *argv, "--revision", "v2", "--port", "0", cwd=tmp_path)
        assert out.returncode == 2, (out.returncode, out.stderr)
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert "--revision v2 applies to a Hugging Face hub id --model" in errors[0] and said in errors[0], errors[0]
    code = ("import sys; from service.cli import parse_settings, _check_revision, _resolve_hub_model; "
            "s = parse_settings(sys.argv[1:])[1]; _check_revision(s); print(_resolve_hub_model(s).model)")
    out = _run(code, cache, "serve", "--model", f"a={REPO}", "--model", "b=tiny", "--revision", snapshot.name)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"a": str(snapshot), "b": "tiny"}
