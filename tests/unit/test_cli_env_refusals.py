"""A value refused once the command line is read (against the model, the machine or the disk, not its own
type) names the variable it came from, as one refused while it is read does: an image's or a job's
environment is not on the command line the user looks at."""

import pytest

from service import cli


@pytest.mark.parametrize("command, name, value, said", [
    ("score", "MAX_MODEL_LEN", "99999999", "--max-model-len 99999999 exceeds the model's 32768 positions"),
    ("serve", "MAX_MODEL_LEN", "99999999", "--max-model-len 99999999 exceeds the model's 32768 positions"),
    ("score", "DEVICE", "cuda:99", "--device cuda:99: this machine has"),
    ("score", "EXPERT_GEMM", "/nonexistent/libexperts.so", "--expert-gemm /nonexistent/libexperts.so: no such file"),
], ids=["score-max-model-len", "serve-max-model-len", "device", "expert-gemm"])
def test_a_value_refused_after_parsing_names_its_variable(monkeypatch, tmp_path, capsys, command, name, value, said):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    argv = [command] + ([str(source), "-o", str(out)] if command == "score" else [])
    option = "--" + name.lower().replace("_", "-")
    monkeypatch.setenv(f"PACKSCORE_{name}", value)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.rstrip().endswith(f"({option} from PACKSCORE_{name})"), err
    monkeypatch.delenv(f"PACKSCORE_{name}")
    assert cli.main(argv + [option, value]) == 2  # given on the command line: no variable is named
    err = capsys.readouterr().err
    assert said in err and "PACKSCORE_" not in err, err
    assert not out.exists()
