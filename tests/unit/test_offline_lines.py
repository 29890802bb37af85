"""``packscore score``: how a line the run cannot take is named before the model loads."""

import orjson

from service import cli


def test_a_line_longer_than_any_run_allows_is_named_as_a_sequence_not_a_request_to_split(monkeypatch, tmp_path,
                                                                                         capsys):
    def refuse(settings):
        raise AssertionError("the model was loaded, though the line is refused before")

    monkeypatch.setattr("service.backends.load_backend", refuse)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "huge", "input_ids": [1] * 1_100_000}]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl:2: input_ids: The sequence has 1100000 tokens; the longest accepted is 1048576" in err, err
    assert "split it" not in err and "request" not in err, err
    assert not out.exists()


def test_a_line_s_field_errors_name_the_field_once_and_the_line_not_a_request(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("service.backends.load_backend", lambda settings: None)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    for line, said in [({"id": "a", "input_ids": [1, 2], "score_from": 3}, "in.jsonl:1: score_from must be in [1, 2]"),
                       ({"id": "a", "input_ids": [1], "labels": [1]}, "in.jsonl:1: labels is not a field of a line"),
                       ({"id": "a", "input_ids": []}, "in.jsonl:1: input_ids must hold at least one token id")]:
        source.write_bytes(orjson.dumps(line) + b"\n")
        assert cli.main(["score", str(source), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and "request" not in err, err
        assert not out.exists()
