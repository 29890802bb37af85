"""``packscore score`` stopped by SIGTERM (a preempted batch job: Kubernetes and Slurm send SIGTERM,
then SIGKILL after a grace): the results finished in input order are written and flushed at once,
without the forward under way, exit 143, and the same command resumes to the uninterrupted result."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.signals import default_sigint, signalled_in_torch_import, signalled_on_import_run

# A fake model whose forward holding token 99 takes ``argv[1]`` seconds, writing OUT.slow as it begins;
# forwards run one at a time, so every line before it is scored by then.
_SLOW_LINE_RUN = """
import pathlib, sys, time
from service import cli
from service.testing import FakeBackend
import service.backends

class SlowLine(FakeBackend):
    def score_row(self, sequences, group=None):
        if any(99 in seq.input_ids for seq in sequences):
            pathlib.Path(sys.argv[-1] + ".slow").touch()
            time.sleep(float(sys.argv[1]))
        return super().score_row(sequences, group)

service.backends.load_backend = lambda settings: SlowLine()
sys.exit(cli.main(sys.argv[2:]))
"""

# r0-r5 finish first, r6 is slow, r7-r9 behind it: short lines, so the finished ones sit in the write buffer
_ROWS = [{"id": f"r{i}", "input_ids": [99 if i == 6 else 1 + i] * 6} for i in range(10)]


def _argv(slow_s, source, out):
    return [sys.executable, "-c", _SLOW_LINE_RUN, str(slow_s), "score", str(source), "--max-batch-tokens", "12",
            "--log-level", "warning", "-o", str(out)]


def _start_and_signal(tmp_path, slow_s, preexec_fn=None, rows=_ROWS):
    """Runs score into OUT, sends SIGTERM once the slow line's forward began; exit status, stderr, seconds to exit."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    run = subprocess.Popen(_argv(slow_s, source, out), stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + 60
    while not (tmp_path / "out.jsonl.slow").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the slow forward is under way on its thread, the loop has seen the results before it
    sent = time.monotonic()
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    return run.returncode, err, time.monotonic() - sent


def test_sigterm_writes_the_finished_results_without_the_forward_under_way_then_resumes(tmp_path):
    """The finished results are flushed, not lost in the write buffer (as the default action would lose
    them), so the rerun does not score them again."""
    code, err, took = _start_and_signal(tmp_path, 30)
    assert code == 143 and "Traceback" not in err, f"exit {code}:\n{err[-2000:]}"
    assert took < 10, f"SIGTERM took {took:.1f}s to stop, the forward under way is 30s"
    source, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    kept = [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()]
    assert kept == [f"r{i}" for i in range(6)], f"written after SIGTERM: {kept}"
    assert f"terminated (SIGTERM); 6 of the 10 lines of {source} are in {out}" in err, err[-2000:]
    assert "the same command resumes" in err, err[-2000:]

    for target in (out, ref):  # the rerun, then one uninterrupted run
        done = subprocess.run(_argv(0, source, target), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes() == ref.read_bytes()


def test_one_line_in_out_is_said_in_the_singular(tmp_path):
    # r0 fills a forward of its own (--max-batch-tokens 12) and finishes, r1 is slow
    rows = [{"id": f"r{i}", "input_ids": [99 if i == 1 else 1 + i] * (12 if i == 0 else 6)} for i in range(10)]
    code, err, _ = _start_and_signal(tmp_path, 30, rows=rows)
    assert code == 143, f"exit {code}:\n{err[-2000:]}"
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    assert f"terminated (SIGTERM); 1 of the 10 lines of {source} is in {out}, in input order" in err, err[-2000:]


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    """As `nohup` or a supervisor that stops the job otherwise starts it: the run goes on to the end."""
    code, err, _ = _start_and_signal(tmp_path, 1, lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    assert code == 0, f"exit {code}:\n{err[-2000:]}"
    out = tmp_path / "out.jsonl"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in _ROWS]


# Through the console script's entry point, as a batch job starts it; ``argv[1]`` names the stage
# that takes ``argv[2]`` seconds, writing ``OUT.<stage>`` as it begins: the model's load, OUT's last
# fsync or the model's close (which writes ``OUT.closed`` once it has ended).
_STAGED_RUN = """
import os, pathlib, sys, time
from service import entrypoint
from service.testing import FakeBackend
import service.backends

stage, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[-1]

def slow(name):
    if stage == name:
        pathlib.Path(out + "." + name).touch()
        time.sleep(seconds)

class Closing(FakeBackend):
    def close(self):
        slow("close")
        pathlib.Path(out + ".closed").touch()

def load_backend(settings):
    slow("load")
    return Closing()

real_fsync = os.fsync
def fsync(fd):
    slow("fsync")
    return real_fsync(fd)

os.fsync = fsync
service.backends.load_backend = load_backend
sys.argv = ["packscore", *sys.argv[3:]]
sys.exit(entrypoint.main())
"""


def _staged(tmp_path, stage, seconds, preexec_fn=None):
    """Runs score through the entry point, SIGTERM once ``stage`` began; exit status, stderr, seconds to exit."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
    argv = [sys.executable, "-c", _STAGED_RUN, stage, str(seconds), "score", str(source), "--log-level", "warning",
            "-o", str(out)]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + 60
    while not (tmp_path / f"out.jsonl.{stage}").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = time.monotonic()
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    return run.returncode, err, time.monotonic() - sent


def test_sigterm_while_the_model_loads_says_nothing_was_scored_and_exits_143(tmp_path):
    """It kept its default action: the job died with -15 and no line, a first run's empty OUT left behind."""
    code, err, took = _staged(tmp_path, "load", 30)
    assert code == 143 and "Traceback" not in err, f"exit {code}:\n{err[-2000:]}"
    assert took < 10, f"SIGTERM took {took:.1f}s to stop, the load is 30s"
    out = tmp_path / "out.jsonl"
    assert err.splitlines()[-1] == (f"packscore: terminated (SIGTERM) before scoring began; nothing was scored yet, "
                                    f"{out} is as it was: the same command starts again"), err[-2000:]
    assert not out.exists(), "a first run stopped before scoring left an OUT"


def test_sigterm_while_the_imports_run_says_nothing_was_scored_and_exits_143(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
    run = subprocess.run([sys.executable, "-c", signalled_on_import_run(signal.SIGTERM), "score", str(source), "-o",
                          str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 143 and "Traceback" not in run.stderr, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
    assert run.stderr.splitlines()[-1] == ("packscore: terminated (SIGTERM) before scoring began; nothing was scored "
                                           "yet, OUT is as it was: the same command starts again"), run.stderr
    assert not out.exists()


@pytest.mark.parametrize("stage", ["fsync", "close"])
def test_sigterm_once_every_line_is_scored_lets_out_and_the_model_close_then_exits_143(tmp_path, stage):
    """Between the scoring loop's end and OUT's last flush SIGTERM had its default action (-15, no line)."""
    code, err, _ = _staged(tmp_path, stage, 3)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    assert code == 143 and "Traceback" not in err, f"exit {code}:\n{err[-2000:]}"
    assert err.splitlines()[-1] == (f"packscore: terminated (SIGTERM) once every line was scored; every line of "
                                    f"{source} is in {out} (the same command has nothing left to score)"), err[-2000:]
    assert (tmp_path / "out.jsonl.closed").exists(), "the model's close was cut short"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in _ROWS]


def test_an_ignored_sigterm_stays_ignored_before_scoring_began(tmp_path):
    code, err, _ = _staged(tmp_path, "load", 1, lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    assert code == 0, f"exit {code}:\n{err[-2000:]}"
    out = tmp_path / "out.jsonl"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in _ROWS]


# SIGTERM from the interpreter's own start (a sitecustomize on PYTHONPATH), so that the real command line runs:
# while service.cli imports pydantic, its first package beyond the standard library, or once it parses the command.
_SIGTERM_SITECUSTOMIZE = """
import os, signal, sys

def terminate():
    os.kill(os.getpid(), signal.SIGTERM)

class TerminatedOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "pydantic":
            sys.meta_path.remove(self)
            terminate()
        return None

def on_call(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "parse_settings" and frame.f_code.co_filename.endswith("cli.py"):
        sys.setprofile(None)
        terminate()

if os.environ["SIGTERM_DURING"] == "imports":
    sys.meta_path.insert(0, TerminatedOnImport())
else:
    sys.setprofile(on_call)
"""


@pytest.mark.parametrize("during", ["imports", "parsing"])
@pytest.mark.parametrize("entry", ["python -m service.cli", "packscore"])
def test_sigterm_before_scoring_is_one_line_and_143_from_either_entry(tmp_path, entry, during):
    """`python -m service.cli score` exits 143 with its line, as the console script does: in its imports not by
    SIGTERM's default action (-15, no line), in its parsing not by a KeyboardInterrupt traceback."""
    if entry == "packscore":
        command = [str(Path(sys.executable).with_name("packscore"))]
        if not Path(command[0]).exists():
            pytest.skip("the console script is not installed")
    else:
        command = [sys.executable, "-m", "service.cli"]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SIGTERM_SITECUSTOMIZE)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
    path = os.pathsep.join([str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    run = subprocess.run([*command, "score", str(source), "-o", str(out)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path, "SIGTERM_DURING": during})
    assert run.returncode == 143 and "Traceback" not in run.stderr, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
    assert run.stderr.splitlines()[-1] == ("packscore: terminated (SIGTERM) before scoring began; nothing was scored "
                                           "yet, OUT is as it was: the same command starts again"), run.stderr
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_sigterm_or_ctrl_c_while_torch_imports_is_held_until_its_import_ends(tmp_path, sig):
    """Raised inside torch's import, where its C++ init runs Python, Terminated (SIGTERM) or KeyboardInterrupt
    (Ctrl-C) aborted the process now and then (``terminate called after throwing an instance of
    'pybind11::error_already_set'``, exit 134, no line): the handler now holds it until torch is imported, then
    stops the run with its line and 143 or 130."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
    run = subprocess.run([sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out)],
                         capture_output=True, text=True, timeout=60, preexec_fn=default_sigint,
                         env=signalled_in_torch_import(tmp_path / "site", sig, os.environ))
    line = (f"packscore: terminated (SIGTERM) before scoring began; nothing was scored yet, {out} is as it was: the "
            "same command starts again" if sig == signal.SIGTERM else
            f"packscore: interrupted before scoring began; {out} is as it was")
    status = 143 if sig == signal.SIGTERM else 130
    assert run.returncode == status and "Traceback" not in run.stderr, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
    assert run.stderr.splitlines()[-2:] == [line, "torch imported: True"], run.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("made_by", ["checks", "lock"])
def test_a_stop_as_out_is_made_leaves_no_out_behind(tmp_path, monkeypatch, made_by):
    """A SIGTERM or Ctrl-C landing as the checks create OUT, or as its lock is taken, before the removal of an
    empty OUT a stopped first run leaves could run: the line says OUT is as it was, so no empty OUT is left."""
    from service import offline, offline_out
    from service.entrypoint import Terminated
    from service.settings import Settings

    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
    real = offline_out.path_problem if made_by == "checks" else offline_out.lock_output

    def stopped_after(*args):
        real(*args)  # OUT made (and, by lock_output, locked and closed again)
        raise Terminated

    monkeypatch.setattr(offline, "path_problem" if made_by == "checks" else "lock_output", stopped_after)
    with pytest.raises(Terminated):
        offline.score_file(Settings(), source, out)
    assert not out.exists()
    out.write_bytes(b"")  # an empty OUT that was there before the run is kept
    with pytest.raises(Terminated):
        offline.score_file(Settings(), source, out)
    assert out.exists()
