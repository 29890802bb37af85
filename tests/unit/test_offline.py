"""``packscore score``: what a batch job meets besides a clean run (test_cli.py has the clean runs):
signals with the real model, reruns into an OUT of another input, paths that cannot work, and
checks that come before the model loads."""

import dataclasses
import logging
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest

from service import cli
import service.offline
import service.offline_progress
from service.testing import FAKE_VERSION, FakeBackend
from tests.signals import default_sigint


def _write_jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _read_jsonl(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _no_model(monkeypatch):
    """Fails the test if the model is loaded."""

    def refuse(settings):
        raise AssertionError("the model was loaded, though nothing needed it")

    monkeypatch.setattr("service.backends.load_backend", refuse)


def _fake_model(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr("service.backends.load_backend", lambda settings: backend)
    return backend


def _run_until(argv, out, lines, sig):
    """Starts ``argv``, sends ``sig`` once OUT holds ``lines`` lines; its exit status and stderr."""
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= lines:
            break
        time.sleep(0.02)
    run.send_signal(sig)
    _, err = run.communicate(timeout=120)
    return run.returncode, err


def test_killed_and_interrupted_runs_of_the_real_model_resume_to_the_uninterrupted_result(tmp_path):
    """SIGKILL and then SIGINT part way through, with the tiny model's torch forwards (not a fake's
    sleep): Ctrl-C exits 130 (it aborted in torch's teardown, -6, while a forward still ran on its
    thread), and the reruns give what one uninterrupted run gives, no id lost or written twice."""
    rng = np.random.default_rng(5)
    rows = [{"id": f"r{i}", "input_ids": rng.integers(0, 4096, int(rng.integers(20, 200))).tolist(), "score_from": 2}
            for i in range(80)]
    source, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    _write_jsonl(source, rows)
    argv = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--max-batch-tokens", "512",
            "--log-level", "warning"]
    assert cli.main(["score", str(source), "-o", str(ref), "--max-batch-tokens", "4096", "--log-level", "warning"]) == 0

    code, err = _run_until(argv, out, 1, signal.SIGKILL)
    assert code == -signal.SIGKILL, err[-2000:]
    code, err = _run_until(argv, out, out.read_bytes().count(b"\n") + 1, signal.SIGINT)
    assert code == 130, f"exit {code} after Ctrl-C, not 130: {err[-2000:]}"
    assert "interrupted" in err and "Traceback" not in err, err[-2000:]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    got, want = _read_jsonl(out), _read_jsonl(ref)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    for g, w in zip(got, want):
        diff = np.abs(np.float32(g["logprobs"]) - np.float32(w["logprobs"])).max(initial=0)
        assert diff <= 1e-4, f"{g['id']}: resumed vs uninterrupted max diff {diff} > 1e-4 (float32 CPU packing bound: 1e-6, README.md)"


def test_ctrl_c_while_the_model_loads_is_130_with_a_line_not_a_traceback(monkeypatch, tmp_path, capsys):
    def interrupted(settings):
        raise KeyboardInterrupt

    monkeypatch.setattr("service.backends.load_backend", interrupted)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    try:
        code = cli.main(["score", str(source), "-o", str(out)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while the model loaded escaped as a traceback")
    assert code == 130
    assert "interrupted before scoring began" in capsys.readouterr().err


def test_a_rerun_refuses_a_duplicated_id_as_the_first_run_does(monkeypatch, tmp_path, capsys):
    """The duplicate's first line already scored must not let the second pass unscored."""
    _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4, 5]},
                          {"id": "a", "input_ids": [7, 8, 9, 10]}])
    before = out.read_bytes()
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    assert f"{source}:3: id 'a' appears twice" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.parametrize("change,named", [
    ({"rows": [{"id": "a", "input_ids": [1, 2, 3, 4, 5]}]}, "scored positions 2 (this run: 4)"),
    ({"argv": ["--top-k", "2"]}, "top_k 0 (this run: 2)"),
    ({"first_argv": ["--top-k", "2"], "argv": ["--top-k", "3"]}, "top_k 2 (this run: 3)"),
    ({"argv": ["--no-return-entropy"]}, "entropy True (this run: False)"),
    ({"rows": [{"id": "a", "input_ids": [1, 9, 3]}]}, "input_hash "),  # as long, other ids: line-N ids moved
    ({"rows": [{"id": "a", "input_ids": [1, 2, 3], "rollout_logprobs": [-1.0, -2.0]}]}, "input_hash "),
], ids=["other-input", "top-k", "other-k", "no-entropy", "same-length-other-ids", "rollout-sent"])
def test_a_rerun_into_an_out_of_another_input_or_options_is_refused(monkeypatch, tmp_path, capsys, change, named):
    """Skipping such an id would leave OUT a mix of two runs, with exit 0."""
    _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out), *change.get("first_argv", [])]) == 0
    before = out.read_bytes()
    _write_jsonl(source, change.get("rows", [{"id": "a", "input_ids": [1, 2, 3]}]) + [{"id": "b", "input_ids": [1, 2]}])
    assert cli.main(["score", str(source), "-o", str(out), *change.get("argv", [])]) == 2
    err = capsys.readouterr().err
    assert f"{source}:1: id 'a' already has a result in OUT line 1" in err and named in err, err
    assert out.read_bytes() == before


def test_results_in_out_for_ids_not_in_in_are_named_in_a_warning(monkeypatch, tmp_path, caplog):
    _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "old", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    _write_jsonl(source, [{"id": "new", "input_ids": [1, 2, 3]}])
    with caplog.at_level(logging.WARNING, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert f"holds 1 result whose id is not in {source} (kept as it is)" in caplog.text, caplog.text
    assert [r["id"] for r in _read_jsonl(out)] == ["old", "new"]
    out.write_bytes(out.read_bytes() * 2)  # two OUTs joined with cat
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert "holds 2 ids more than once" in caplog.text, caplog.text
    out.write_bytes(out.read_bytes() + out.read_bytes().splitlines(keepends=True)[0])  # "old" three times
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert "holds 2 ids more than once" in caplog.text, caplog.text  # ids, not the lines that repeat one


def test_the_default_tiny_preset_is_named_in_a_warning(monkeypatch, tmp_path, caplog):
    """A forgotten --model scores with random weights: said, not silent."""
    _fake_model(monkeypatch)
    source = tmp_path / "in.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    for argv, warned in (([], True), (["--model", "qwen3.5-9b"], False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="service.offline"):
            assert cli.main(["score", str(source), "-o", str(tmp_path / f"out{len(argv)}.jsonl"), *argv]) == 0
        assert ("built-in tiny preset" in caplog.text) == warned, (argv, caplog.text)


def test_paths_that_cannot_work_are_refused_before_the_model_loads(monkeypatch, tmp_path, capsys):
    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [
        ([str(tmp_path), "-o", str(out)], "is a directory; give IN as a file of JSON lines"),
        (["-", "-o", str(out)], "stdin or a pipe cannot be IN"),
        ([str(fifo), "-o", str(out)], "stdin or a pipe cannot be IN"),
        ([str(source), "-o", str(tmp_path)], "is a directory"),
        ([str(source), "-o", str(tmp_path / "no" / "out.jsonl")], "cannot write it: No such file or directory"),
        ([str(source), "-o", str(source)], "is IN itself"),
        ([str(source), "-o", "-"], "-o -: stdout cannot be OUT (a rerun reads OUT back to resume"),
        ([str(source), "-o", str(fifo)], "not a regular file, cannot be OUT"),
    ]
    monkeypatch.chdir(tmp_path)  # where -o - would have made a file named "-"
    for argv, named in cases:
        assert cli.main(["score", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "-").exists()


def test_a_bad_line_is_refused_before_the_model_loads_and_names_its_field_once(monkeypatch, tmp_path, capsys):
    """A large model loads for minutes: a typo on line 2 is found first."""
    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [1, "x"]}, {"id": "c", "input_ids": [3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: input_ids[1]: Input should be a valid integer" in err and err.count("input_ids[1]") == 1, err
    assert not out.exists()  # a refused first run leaves no empty OUT behind
    out.write_bytes(b"")  # an OUT that was there stays
    assert cli.main(["score", str(source), "-o", str(out)]) == 2 and out.read_bytes() == b""


def test_nothing_left_to_score_loads_no_model(monkeypatch, tmp_path):
    backend = _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4, 5]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    scored = out.read_bytes()
    _no_model(monkeypatch)
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    assert cli.main(["score", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "none.jsonl")]) == 0
    assert out.read_bytes() == scored and len(backend.rows) > 0


def test_progress_off_a_terminal_is_log_lines_not_a_bar(monkeypatch, tmp_path, capsys, caplog):
    """A bar's redraws ('\\r' ten times a second) fill a job's log file with one endless line."""
    _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": f"r{i}", "input_ids": [1, 2, 3 + i]} for i in range(20)])
    with caplog.at_level(logging.INFO, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert "\r" not in capsys.readouterr().err
    assert "scored 20/20 sequences" in caplog.text
    progress = service.offline_progress._LoggedProgress(total=10, initial=4, tokens=60, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="service.offline"):
        progress.update(3, tokens=30)
    assert "scored 7/10 sequences" in caplog.text and "s left" in caplog.text


def test_each_result_line_records_the_model_weights_temperature_and_dtype_that_made_it(monkeypatch, tmp_path):
    _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out), "--temperature", "0.7"]) == 0
    (line,) = _read_jsonl(out)
    made = {k: line[k] for k in ("model", "weights_version", "temperature", "dtype")}
    assert made == {"model": "fake-model", "weights_version": FAKE_VERSION, "temperature": 0.7, "dtype": "float32"}
    # in the order docs/cli.md and the help give them
    assert list(line)[:7] == ["id", "model", "weights_version", "temperature", "dtype", "input_hash", "logprobs"], list(line)


@pytest.mark.parametrize("change,named", [
    ({"argv": ["--temperature", "0.5"]}, "temperature 1.0 (this run: 0.5)"),
    ({"info": {"weights_version": "xxh3-0123456789ab"}}, f"weights_version {FAKE_VERSION} (this run: xxh3-0123456789ab)"),
    ({"info": {"dtype": "bfloat16"}}, "dtype float32 (this run: bfloat16)"),
], ids=["temperature", "other-weights", "dtype"])
def test_a_rerun_with_another_temperature_model_or_dtype_is_refused(monkeypatch, tmp_path, capsys, change, named):
    """OUT would otherwise mix results of two temperatures or two models, with exit 0; the
    temperature is refused before the model loads (minutes for a large one)."""
    backend = _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    before = out.read_bytes()
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [1, 2]}])
    if "info" in change:
        backend.info = dataclasses.replace(backend.info, **change["info"])
    else:
        _no_model(monkeypatch)
    assert cli.main(["score", str(source), "-o", str(out), *change.get("argv", [])]) == 2
    err = capsys.readouterr().err
    assert f"{source}:1: id 'a' already has a result in OUT line 1" in err and named in err, err
    assert out.read_bytes() == before


def test_an_out_written_before_results_recorded_their_run_is_resumed_with_a_warning(monkeypatch, tmp_path, caplog):
    """Refusing it would throw away hours of scoring; its lines cannot be checked, and the warning says
    what the rerun must repeat. The lines added record their run, so the next rerun checks those."""
    _fake_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    old = {k: v for k, v in _read_jsonl(out)[0].items() if k not in ("model", "weights_version", "temperature", "dtype", "input_hash")}
    _write_jsonl(out, [old])
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [1, 2]}])
    with caplog.at_level(logging.WARNING, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out), "--temperature", "0.5"]) == 0
    assert "1 result does not record the temperature, weights_version and dtype that made it" in caplog.text
    first, second = _read_jsonl(out)
    assert first == old and second["temperature"] == 0.5



def score_under_file_size_limit(source, out, limit: int) -> int:
    """``packscore score SOURCE -o OUT`` in this process with a file size limit of ``limit`` bytes:
    OUT's writes fail part way through a line with EFBIG, as a full disk's do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
    try:
        return cli.main(["score", str(source), "-o", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

def test_a_full_disk_stops_the_run_with_one_line_and_the_rerun_resumes(monkeypatch, tmp_path, capsys):
    """A file size limit fails OUT's writes part way through a line, as a full disk does: one error
    line, not a traceback (nor a hang while the scheduler closed), and the rerun completes OUT."""
    _fake_model(monkeypatch)
    rows = [{"id": f"r{i}", "input_ids": list(range(1, 200))} for i in range(60)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    code = score_under_file_size_limit(source, out, 20_000)
    err = capsys.readouterr().err
    assert code == 1 and f"cannot write {out}: File too large" in err and "Traceback" not in err, err
    assert 0 < out.stat().st_size <= 20_000
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert [r["id"] for r in _read_jsonl(out)] == [r["id"] for r in rows]


def test_a_file_saved_on_windows_scores_as_the_same_lines_do(monkeypatch, tmp_path):
    """A UTF-8 byte order mark (Notepad, PowerShell) and CRLF endings: orjson refuses the mark, so
    line 1 failed as 'not valid JSON'."""
    _fake_model(monkeypatch)
    rows = [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "input_ids": [4, 5]}]
    unix, windows = tmp_path / "unix.jsonl", tmp_path / "windows.jsonl"
    _write_jsonl(unix, rows)
    windows.write_bytes(b"\xef\xbb\xbf" + unix.read_bytes().replace(b"\n", b"\r\n") + b"\r\n")
    assert cli.main(["score", str(unix), "-o", str(tmp_path / "unix.out")]) == 0
    assert cli.main(["score", str(windows), "-o", str(tmp_path / "windows.out")]) == 0
    assert (tmp_path / "windows.out").read_bytes() == (tmp_path / "unix.out").read_bytes()


def test_a_utf16_file_is_named_as_one(monkeypatch, tmp_path, capsys):
    """PowerShell 5's > writes UTF-16: line 1 was refused as 'not valid JSON', with no hint why."""
    _no_model(monkeypatch)
    source = tmp_path / "in.jsonl"
    source.write_bytes('{"id": "a", "input_ids": [1, 2, 3]}\r\n'.encode("utf-16"))
    assert cli.main(["score", str(source), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "the file is UTF-16" in capsys.readouterr().err


def test_a_second_run_into_an_out_being_written_is_refused(monkeypatch, tmp_path, capsys):
    """A job retried while the first still runs: both appended to OUT, interleaving their results."""
    import fcntl

    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    with out.open("ab") as first_run:
        fcntl.flock(first_run, fcntl.LOCK_EX)
        assert cli.main(["score", str(source), "-o", str(out)]) == 2
    assert "another packscore score is writing it" in capsys.readouterr().err
    assert out.read_bytes() == b""


def test_an_out_that_cannot_be_locked_is_scored_with_a_warning(monkeypatch, tmp_path, caplog):
    """NFS without its lock daemon (ENOLCK), Lustre without -o flock: the run went down with a traceback."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    _fake_model(monkeypatch)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    with caplog.at_level(logging.WARNING, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert "cannot lock it (No locks available)" in caplog.text, caplog.text
    assert [r["id"] for r in _read_jsonl(out)] == ["a"]


def test_the_lock_is_on_the_out_that_is_written_when_a_refused_run_removed_it_meanwhile(monkeypatch, tmp_path):
    """A refused first run removes the OUT it created; a second run that had opened that file before
    locked the removed file, and wrote a new OUT that a third run could lock beside it."""
    import fcntl

    real_flock, removed, locked_while_scoring = fcntl.flock, [], []

    def removed_before_the_lock(fd, operation):
        if not removed:  # as the refused run's unlink lands between this run's open and flock
            removed.append(out)
            out.unlink()
        return real_flock(fd, operation)

    real_score_file = service.offline._score_file

    def score_file(settings, input_path, output_path):
        with output_path.open("ab") as third_run:
            try:
                real_flock(third_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked_while_scoring.append(False)
            except BlockingIOError:
                locked_while_scoring.append(True)
        return real_score_file(settings, input_path, output_path)

    _fake_model(monkeypatch)
    monkeypatch.setattr(fcntl, "flock", removed_before_the_lock)
    monkeypatch.setattr(service.offline, "_score_file", score_file)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 0
    assert removed and locked_while_scoring == [True], "OUT was not locked while the run wrote it"
    assert [r["id"] for r in _read_jsonl(out)] == ["a"]


def test_a_checkpoint_refused_once_loaded_stops_the_run_with_one_line_and_no_out(monkeypatch, tmp_path, capsys):
    from model_runtime.scoring.checkpoint_error import CheckpointError

    def refuse(settings):  # what loading.py raises for a weight holding NaN, after the pre-check passed
        raise CheckpointError("non_finite", "checkpoint /ckpt: 1 weight tensor holds NaN or infinite values (w)")

    monkeypatch.setattr("service.backends.load_backend", refuse)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2, 3]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "packscore: error: checkpoint /ckpt: 1 weight tensor holds NaN" in err and "Traceback" not in err, err
    assert not out.exists()  # a refused first run leaves no empty OUT


_SLOW_FORWARD_RUN = """
import pathlib, sys, time
from service import cli
from service.testing import FakeBackend
import service.backends

class Slow(FakeBackend):
    def score_row(self, sequences, group=None):
        marker = pathlib.Path(sys.argv[-1] + ".started")
        if not marker.exists():  # the first forward: says how many sequences it holds, then takes its time
            marker.write_text(str(len(sequences)))
        time.sleep(float(sys.argv[1]))
        return super().score_row(sequences, group)

service.backends.load_backend = lambda settings: Slow()
sys.exit(cli.main(sys.argv[2:]))
"""


def _interrupt_during_first_forward(tmp_path, forward_s, signals):
    """Runs score with forwards of ``forward_s`` seconds, sends SIGINT ``signals`` times once the
    first forward began; the exit status, stderr, seconds from the first signal to the exit, the
    ids written and how many sequences the first forward held."""
    rows = [{"id": f"r{i}", "input_ids": [1 + i % 50] * 30} for i in range(12)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    argv = [sys.executable, "-c", _SLOW_FORWARD_RUN, str(forward_s), "score", str(source), "--max-batch-tokens",
            "120", "--log-level", "warning", "-o", str(out)]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    marker = tmp_path / "out.jsonl.started"
    deadline = time.monotonic() + 60
    while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the forward is under way on its thread
    sent = time.monotonic()
    for i in range(signals):
        run.send_signal(signal.SIGINT)
        time.sleep(0.3)
    _, err = run.communicate(timeout=60)
    took = time.monotonic() - sent
    return run.returncode, err, took, [r["id"] for r in _read_jsonl(out)], int(marker.read_text()), argv


def test_ctrl_c_during_a_forward_writes_its_results_then_exits_130(tmp_path):
    """The forward under way finishes and its results are written (not thrown away after waiting for
    them), whole lines in input order; the rerun scores only the rest."""
    code, err, _, kept, first_row, argv = _interrupt_during_first_forward(tmp_path, 1.0, 1)
    assert code == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]
    assert kept == [f"r{i}" for i in range(first_row)], f"written {kept}, the first forward held {first_row}"
    assert subprocess.run(argv, capture_output=True, timeout=120).returncode == 0
    assert [r["id"] for r in _read_jsonl(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(12)]


def test_a_second_ctrl_c_stops_at_once_without_the_forward_under_way(tmp_path):
    """The forward (30 s here) is not waited for: exit 130 at once, OUT as it was (nothing torn)."""
    code, err, took, kept, _, _ = _interrupt_during_first_forward(tmp_path, 30, 2)
    assert code == 130 and "Traceback" not in err, err[-2000:]
    assert took < 10, f"the second Ctrl-C took {took:.1f}s to stop, the forward is 30s"
    assert kept == [] and "stopped at once" in err, err[-2000:]


@pytest.mark.parametrize("bad,said", [(-1, "Token id -1 is negative; token ids are >= 0"),
                                      (2**31, "Token id 2147483648 is outside any vocabulary; token ids are below 2**31")])
def test_an_id_refused_before_the_model_loads_is_not_said_to_be_outside_a_made_up_vocabulary(monkeypatch, tmp_path,
                                                                                              capsys, bad, said):
    """The vocabulary is not known yet: the message names no range such as [0, 2147483648), a placeholder."""
    _no_model(monkeypatch)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [1, bad]}])
    assert cli.main(["score", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: input_ids[1]: {said}." in err and "vocabulary [0," not in err, err


def test_an_ignored_sigint_stays_ignored(tmp_path):
    """As a script's `packscore score ... &` starts it: the run is not this terminal's Ctrl-C to stop."""
    rows = [{"id": f"r{i}", "input_ids": [1 + i % 50] * 30} for i in range(8)]  # two forwards
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, rows)
    argv = [sys.executable, "-c", _SLOW_FORWARD_RUN, "0.5", "score", str(source), "--max-batch-tokens", "120",
            "--log-level", "warning", "-o", str(out)]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while not (tmp_path / "out.jsonl.started").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 0 and [r["id"] for r in _read_jsonl(out)] == [r["id"] for r in rows], err[-2000:]


def _slow_first_result(monkeypatch):
    """A fake model whose forwards wait until its gate is set (or 5 s pass, so that a run without
    progress between results still ends); the ticker's interval is 10 ms, a log line's 50 ms."""
    import threading

    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    monkeypatch.setattr("service.backends.load_backend", lambda settings: backend)
    monkeypatch.setattr(service.offline_progress, "_REFRESH_S", 0.01)
    monkeypatch.setattr(service.offline_progress, "_LOG_EVERY_S", 0.05)
    timer = threading.Timer(5.0, gate.set)
    timer.start()
    return gate, timer


def test_a_log_line_comes_while_the_first_result_is_still_being_scored(monkeypatch, tmp_path, caplog):
    """With a large model and long rows the first result takes minutes: the once-a-minute line came
    only with a result, so a job's log showed nothing until then."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": f"r{i}", "input_ids": [1, 2, 3 + i]} for i in range(3)])
    lines = []

    class Seen(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("scored "):
                lines.append(record.getMessage())
                gate.set()  # the forwards go on once a line has shown

    gate, timer = _slow_first_result(monkeypatch)
    handler = Seen()
    logging.getLogger("service.offline").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="service.offline"):
            assert cli.main(["score", str(source), "-o", str(out)]) == 0
    finally:
        logging.getLogger("service.offline").removeHandler(handler)
        timer.cancel()
    assert lines and lines[0].startswith("scored 0/3 sequences"), lines
    assert "waiting for the first" in lines[0] and "left" not in lines[0], lines[0]
    assert lines[-1].startswith("scored 3/3 sequences"), lines  # the final line at close
    assert len(_read_jsonl(out)) == 3


def test_the_bar_on_a_terminal_is_redrawn_while_the_first_result_is_still_being_scored(monkeypatch, tmp_path):
    """tqdm redraws only in update(): its elapsed time stood still until the first result, as if hung."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(source, [{"id": f"r{i}", "input_ids": [1, 2, 3 + i]} for i in range(3)])
    events = []

    class Bar:
        def __init__(self, total, initial, unit, bar_format):
            self.n, self.closed = initial, False

        def set_postfix_str(self, s, refresh):
            pass

        def update(self, n=1):
            self.n += n
            events.append(("update", self.n))

        def refresh(self):
            assert not self.closed, "refreshed after close"
            events.append(("refresh", self.n))
            gate.set()

        def close(self):
            self.closed = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    gate, timer = _slow_first_result(monkeypatch)
    monkeypatch.setattr(service.offline_progress, "tqdm", Bar)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    try:
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    finally:
        timer.cancel()
    assert events and events[0] == ("refresh", 0), events
    assert ("update", 3) in events and len(_read_jsonl(out)) == 3
