"""``packscore score`` with an IN or OUT that exists but cannot be read (no permission, an I/O
error): one ``packscore: error:`` line and exit 2, not a traceback, and no empty OUT left behind."""

import errno
import os
from pathlib import Path

import orjson

from service import cli


def _refuse_reading(monkeypatch, refused: Path, error: int) -> None:
    """``Path.open`` of ``refused`` for reading fails with ``error`` (root reads every file, so
    chmod alone cannot show it)."""
    real_open = Path.open

    def open_(self, mode="r", *args, **kwargs):
        if self == refused and "r" in mode and "+" not in mode:
            raise OSError(error, os.strerror(error), str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)


def _no_model(monkeypatch):
    def refuse(settings):
        raise AssertionError("the model was loaded, though IN cannot be read")

    monkeypatch.setattr("service.backends.load_backend", refuse)


def test_an_unreadable_in_is_one_line_exit_2_and_leaves_no_out(monkeypatch, tmp_path, capsys):
    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(orjson.dumps({"id": "a", "input_ids": [1, 2, 3]}) + b"\n")
    for error in (errno.EACCES, errno.EIO):
        _refuse_reading(monkeypatch, source, error)
        assert cli.main(["score", str(source), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{source}: cannot read it:" in err, err
        assert not out.exists(), "a refused first run leaves no empty OUT"


def test_an_out_that_cannot_be_read_back_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(orjson.dumps({"id": "a", "input_ids": [1, 2, 3]}) + b"\n")
    out.write_bytes(b"")
    _refuse_reading(monkeypatch, out, errno.EACCES)
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "cannot read it back to resume: Permission denied" in err, err


def test_a_line_cut_short_is_named_by_its_file_line_and_column_alone(monkeypatch, tmp_path, capsys):
    """orjson counts the line's newline as a second line: "in.jsonl:5: ... line 2 column 1" misleads."""
    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b'{"id": "a", "input_ids": [1, 2, 3]}\n{"id": "b", "input_ids": [1, 2\n')
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: not valid JSON at column 31: unexpected end of data" in err, err
    assert "line 2" not in err, err
