"""``packscore score`` runs one model: several (serve's repeated ``--model NAME=...``) are refused while
the command line is read, before a hub id is resolved (downloaded) or a checkpoint is checked."""

import pytest

from service import cli


@pytest.mark.parametrize("env, argv, named", [
    ({}, ["--model", "policy=acme/policy", "--model", "ref=acme/ref"], "not 2 (policy, ref); give one --model"),
    ({"PACKSCORE_MODEL": "policy=tiny,ref=tiny"}, [], "give one --model (--model from PACKSCORE_MODEL)"),
], ids=["command-line", "environment"])
def test_several_models_are_refused_at_parse_naming_model(monkeypatch, tmp_path, capsys, env, argv, named):
    def resolve(spec, revision):
        raise AssertionError(f"{spec} was resolved, though score refuses several models")

    monkeypatch.setattr("service.hub.resolve_model_source", resolve)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["score", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "packscore: error: --model: packscore score scores with one model" in err and named in err, err
    assert "Traceback" not in err and not (tmp_path / "out.jsonl").exists(), err
