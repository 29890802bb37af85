"""``packscore score`` stopped by SIGTERM (a preempted batch job: Kubernetes and Slurm send SIGTERM,
then SIGKILL after a grace): the results finished in input order are written and flushed at once,
without the forward under way, exit 143, and the same command resumes to the uninterrupted result."""

import signal
import subprocess
import sys
import time

import orjson

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


def _start_and_signal(tmp_path, slow_s, preexec_fn=None):
    """Runs score into OUT, sends SIGTERM once the slow line's forward began; exit status, stderr, seconds to exit."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
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
    """They were lost in the write buffer (killed by the default action), so the rerun scored them again."""
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


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    """As `nohup` or a supervisor that stops the job otherwise starts it: the run goes on to the end."""
    code, err, _ = _start_and_signal(tmp_path, 1, lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    assert code == 0, f"exit {code}:\n{err[-2000:]}"
    out = tmp_path / "out.jsonl"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in _ROWS]
