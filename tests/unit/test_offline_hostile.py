"""``packscore score``: lines a trainer's script may hand it by mistake (bytes that are not UTF-8, an OUT
line that is not a result, CR-only endings, a line of hundreds of megabytes) are named with their line and what is
wrong there, before the model loads; an IN with no sequences is said to have none."""

import gzip
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import orjson
import pytest

from service import cli

_GOOD = orjson.dumps({"id": "a", "input_ids": [1, 2]}) + b"\n"


@pytest.fixture
def no_model(monkeypatch):
    def refuse(settings):
        raise AssertionError("the model was loaded, though the run is refused before")

    monkeypatch.setattr("service.backends.load_backend", refuse)


@pytest.mark.parametrize("line, byte", [
    (b'{"id":"a\xff\xfeb","input_ids":[1,2]}\n', 9),
    (msgpack.packb({"id": "a", "input_ids": [1, 2]}) + b"\n", 1),
    (gzip.compress(_GOOD), 2),
], ids=["latin-byte-in-id", "msgpack", "gzip"])
def test_bytes_that_are_not_utf8_are_named_by_their_byte_not_as_surrogates_at_column_1(no_model, tmp_path, capsys,
                                                                                      line, byte):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(_GOOD.replace(b'"a"', b'"z"') + line)
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"in.jsonl:2: not UTF-8 at byte {byte} of the line: JSON lines are UTF-8" in err, err
    assert "surrogates" not in err and "Traceback" not in err, err
    assert not out.exists()


def _refused_with_out(tmp_path, capsys, kept: bytes) -> str:
    """``score``'s stderr for a good IN and an OUT holding ``kept``, once it refused that OUT (exit 2) and left it
    byte for byte as it was."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(_GOOD)
    out.write_bytes(kept)
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    assert out.read_bytes() == kept
    return capsys.readouterr().err


@pytest.mark.parametrize("bad, said", [
    (b"hello\n", "out.jsonl:3: not a result line (not JSON: unexpected character"),
    (b"\n", "out.jsonl:3: not a result line (a blank line)"),
], ids=["text", "blank"])
def test_an_out_line_that_is_not_json_is_named_by_out_s_line_alone(no_model, tmp_path, capsys, bad, said):
    """orjson's own "line 1 column 1" counts within the line: beside OUT's line 3 it named a wrong line."""
    err = _refused_with_out(tmp_path, capsys, b'{"id":"x","logprobs":[]}\n{"id":"y","logprobs":[]}\n' + bad
                            + b'{"id":"z","logprobs":[]}\n')
    assert said in err and "line 1 column" not in err, err


@pytest.mark.parametrize("bad, said", [
    (b'{"id":"y","logprobs":[],"top_k_ids":[5]}\n', "out.jsonl:2: not a result line (object of type 'int' has no len())"),
    (b'{"id":"y","logprobs":[],"top_k_ids":5}\n', "out.jsonl:2: not a result line ('int' object is not subscriptable)"),
    (b'{"id":"y","logprobs":[],"temperature":[1.0]}\n',
     "out.jsonl:2: not a result line (temperature must be a string or a number, got [1.0])"),
    (b'{"id":"y","logprobs":[],"weights_version":{"v":1}}\n',
     "out.jsonl:2: not a result line (weights_version must be a string or a number, got {'v': 1})"),
    (b'{"id":"y","logprobs":"ab"}\n', "out.jsonl:2: not a result line (logprobs must be a list, got 'ab')"),
], ids=["top-k-row-not-a-list", "top-k-not-a-list", "temperature-a-list", "weights-version-an-object", "logprobs-text"])
def test_an_out_line_whose_fields_are_of_the_wrong_kind_is_named_not_a_traceback(no_model, tmp_path, capsys, bad,
                                                                                  said):
    """A result line edited by hand or by a script: named as OUT's line that is not a result (exit 2), as one that
    is not JSON is, not a TypeError's traceback (exit 1, read as a bug) nor, for a string's length, a result."""
    err = _refused_with_out(tmp_path, capsys, b'{"id":"x","logprobs":[]}\n' + bad + b'{"id":"z","logprobs":[]}\n')
    assert said in err and "Traceback" not in err, err


def test_a_refused_first_run_into_a_dangling_symlink_keeps_the_link_and_leaves_no_empty_target(no_model, tmp_path,
                                                                                              capsys):
    """-o a symlink to a results file not made yet (a link into shared storage): the first run creates the target
    and, refused, removed the link and left the empty target behind; it removes what it made, the target."""
    source, link, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "shared" / "results.jsonl"
    target.parent.mkdir()
    link.symlink_to(target)
    source.write_bytes(_GOOD + b"{not json\n")
    assert cli.main(["score", str(source), "-o", str(link)]) == 2
    assert "in.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert link.is_symlink() and not target.exists(), sorted(p.name for p in tmp_path.rglob("*"))

@pytest.mark.parametrize("lines, said", [
    ([{"id": "a", "input_ids": [1]}, {"id": "b", "input_ids": [2]}, {"id": "a", "input_ids": [3]}],
     "in.jsonl:3: id 'a' appears twice in the input (first on line 1)"),
    ([{"id": "line-2", "input_ids": [1]}, {"input_ids": [2]}],
     "in.jsonl:2: id 'line-2' appears twice in the input (first on line 1; a line without an id is named "
     "line-<number>)"),
], ids=["both-given", "one-named-for-its-line"])
def test_a_repeated_id_names_both_its_lines(no_model, tmp_path, capsys, lines, said):
    """A trainer searching a million lines for the other copy, or for an id line 2 never wrote, is told where."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert not out.exists()


@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_an_out_ending_in_a_slash_is_refused_not_made_a_file_of_the_directory_s_name(no_model, tmp_path, capsys,
                                                                                     exists):
    """``-o results/`` was read as ``-o results``: a file named results, or an existing file of that name appended to."""
    source, meant = tmp_path / "in.jsonl", tmp_path / "results"
    source.write_bytes(_GOOD)
    if exists:
        meant.write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["score", str(source), "-o", f"{meant}/"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"-o/--output: {meant}/ ends in a slash, so names a directory: give a file, such as {meant}/out.jsonl" in err
    assert (meant.read_bytes() == b"") if exists else not meant.exists()  # nothing made, nothing appended


def test_an_in_that_is_a_directory_is_named_so_not_as_stdin_or_a_pipe(no_model, tmp_path, capsys):
    assert cli.main(["score", str(tmp_path), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"packscore: error: {tmp_path} is a directory; give IN as a file of JSON lines" in err, err
    assert "stdin" not in err and not (tmp_path / "out.jsonl").exists()


def _score(tmp_path, data: bytes, *options: str, peak: bool = False) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The real command on IN holding ``data``; with ``peak``, its peak RSS in KiB is stdout's last line."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(data)
    argv = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), *options]
    if peak:  # the wrapper's children are this run alone
        argv = [sys.executable, "-c", _PEAK, *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300), source, out


_PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


@pytest.mark.parametrize("data", [b"", b"\n  \n\t\r\n"], ids=["empty", "blank-lines"])
def test_an_in_with_no_sequences_exits_0_with_an_empty_out_but_warns_naming_it(tmp_path, data):
    """A script looping over shards meets empty ones (exit 0, as for nothing left to score), but a user who
    pointed it at the wrong file was told nothing at --log-level warning."""
    done, source, out = _score(tmp_path, data, "--log-level", "warning")
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes() == b""
    assert re.search(rf"WARNING .*{re.escape(str(source))} holds no sequences \(it is empty or its lines are blank\): "
                     "nothing to score", done.stderr), done.stderr


def test_cr_only_line_endings_are_named_with_how_to_convert_them(tmp_path):
    """Classic Mac OS endings (\\r alone) made the file one line, refused as "unexpected content after document"."""
    data = b"".join(orjson.dumps({"id": i, "input_ids": [1, 2]}) + b"\r" for i in "abc")
    done, source, out = _score(tmp_path, data)
    assert done.returncode == 2, done.stderr[-2000:]
    for said in (f"{source}:1: the line holds carriage returns (\\r) not followed by newlines: CR-only line endings",
                 f"convert them, as with tr '\\r' '\\n' < {source} > {tmp_path / 'in.lf.jsonl'}"):
        assert said in done.stderr, done.stderr
    assert "unexpected content" not in done.stderr and not out.exists()
    fixed = tmp_path / "in.lf.jsonl"  # the command it gives, then the run scores every line
    subprocess.run(f"tr '\\r' '\\n' < {source} > {fixed}", shell=True, check=True)
    done = subprocess.run([sys.executable, "-m", "service.cli", "score", str(fixed), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and out.read_bytes().count(b"\n") == 3, done.stderr[-2000:]


def test_a_cr_inside_a_string_is_not_named_as_a_line_ending(tmp_path):
    done, source, _ = _score(tmp_path, b'{"id":"a\rb","input_ids":[1,2]}\n')
    assert done.returncode == 2 and f"{source}:1: not valid JSON at column 9" in done.stderr, done.stderr
    assert "carriage" not in done.stderr


def test_a_line_longer_than_any_allowed_sequence_takes_is_refused_before_it_is_read_whole(tmp_path):
    """With --max-model-len 1000 a line of 200,000 ids is refused by its bytes, not parsed into ints first."""
    data = orjson.dumps({"id": "a", "input_ids": [1234567] * 200_000}) + b"\n"
    done, source, out = _score(tmp_path, data, "--max-model-len", "1000")
    assert done.returncode == 2, done.stderr[-2000:]
    limit = 64 * 1000 + (1 << 20)
    assert (f"{source}:1: the line is longer than {limit} bytes, more than any sequence of at most 1000 tokens "
            "(max_model_len) takes") in done.stderr, done.stderr
    assert not out.exists()


def test_a_line_of_many_short_ids_is_refused_before_it_is_parsed_into_python_ints(tmp_path):
    """A 40 MB line of one-digit ids fits the bytes of a sequence of 2**20 tokens (2 bytes an id) but holds 20M:
    parsed whole, its Python ints took hundreds of megabytes before its length was checked."""
    small, _, _ = _score(tmp_path, b'{"id":"a","input_ids":[1],"labels":[1]}\n', peak=True)
    data = b'{"id":"a","input_ids":[' + b"1," * 20_000_000 + b'1]}\n'
    done, source, out = _score(tmp_path, data, peak=True)
    assert small.returncode == done.returncode == 2, done.stderr[-2000:]
    assert f"{source}:1: the line holds 20000001 commas, more than any sequence of at most" in done.stderr, done.stderr
    grown = (int(done.stdout.split()[-1]) - int(small.stdout.split()[-1])) >> 10
    assert grown < 200, f"the refused line's run peaked {grown} MiB above a small line's"
