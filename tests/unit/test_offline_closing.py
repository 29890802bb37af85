"""``packscore score`` interrupted (SIGINT) once every line is scored, while it closes OUT (its
flush and fsync) or the model: exit 130 with a line saying what is in OUT, never "interrupted
before scoring began", and the model's close not cut short (a worker pool's workers would be
left to their own watch of the process)."""

import signal
import subprocess
import sys
import time

import orjson
import pytest

from tests.signals import default_sigint

# A fake model, with OUT's fsync or the model's close taking seconds (``slow`` names which); each
# writes ``OUT.<slow>`` as it begins, the close ``OUT.closed`` once it has ended.
_SLOW_END_RUN = """
import os, pathlib, sys, time
from service import cli
from service.testing import FakeBackend
import service.backends

slow, out = sys.argv[1], sys.argv[-1]
real_fsync = os.fsync

def fsync(fd):
    if slow == "fsync":
        pathlib.Path(out + ".fsync").touch()
        time.sleep(3)
    return real_fsync(fd)

class SlowClose(FakeBackend):
    def close(self):
        if slow == "close":
            pathlib.Path(out + ".close").touch()
            time.sleep(3)
        pathlib.Path(out + ".closed").touch()

os.fsync = fsync
service.backends.load_backend = lambda settings: SlowClose()
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("slow", ["fsync", "close"])
def test_ctrl_c_while_the_run_closes_says_what_out_holds_and_exits_130(tmp_path, slow):
    rows = [{"id": f"r{i}", "input_ids": [1 + i] * 5} for i in range(4)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    argv = [sys.executable, "-c", _SLOW_END_RUN, slow, "score", str(source), "--log-level", "warning", "-o", str(out)]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 60
    while not (tmp_path / f"out.jsonl.{slow}").exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130 and "Traceback" not in err, f"exit {run.returncode}:\n{err[-2000:]}"
    assert "before scoring began" not in err, err[-2000:]
    said = {"fsync": f"the results written to {out} are kept",
            "close": f"interrupted while closing the model; every line of {source} is in {out}"}[slow]
    assert said in err, err[-2000:]
    assert (tmp_path / "out.jsonl.closed").exists(), "the model's close was cut short"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in rows]


_POOL_NOT_STARTED_RUN = """
import sys
from service import cli
import service.backends
from model_runtime.scoring.backend import BackendUnavailableError

def load_backend(settings):
    raise BackendUnavailableError("worker rank 1 (pid 7) did not reach the process group's rendezvous within 300s "
                                  "of the launch (still running); rank 0 waited there")

service.backends.load_backend = load_backend
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_worker_pool_that_does_not_start_is_one_line_naming_the_rank_and_exit_1(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(orjson.dumps({"id": "r0", "input_ids": [1, 2, 3]}) + b"\n")
    run = subprocess.run([sys.executable, "-c", _POOL_NOT_STARTED_RUN, "score", str(source), "--log-level", "warning",
                          "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
    assert f"packscore: error: could not start: worker rank 1 (pid 7) did not reach" in run.stderr, run.stderr[-2000:]
    assert not out.exists()
