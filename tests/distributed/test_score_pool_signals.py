"""``packscore score --device cpu --world-size 2``: Ctrl-C twice during a forward of seconds stops
at once (exit 130, no traceback) with the worker pool closed before the process ends, not left to
the workers' own watch of their parent; SIGTERM while the pool starts stops it so too (exit 143); a Ctrl-C
or SIGTERM while the scheduler starts stops the run as while it scores, the scheduler closed."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import orjson
import pytest

from tests.distributed.test_serve_e2e import _worker_pids
from tests.e2e.helpers import TINY_VOCAB
from tests.signals import default_sigint, process_state


def _running(pid: int) -> bool:
    return process_state(pid) not in ("gone", "Z")


def test_a_second_ctrl_c_closes_the_pool_before_exiting(tmp_path):
    rng = np.random.default_rng(3)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # rows of two 6000-token sequences per rank: each forward takes seconds on a CPU
    source.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "input_ids": rng.integers(0, TINY_VOCAB, 6000).tolist()})
                                + b"\n" for i in range(8)))
    argv = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--device", "cpu",
            "--world-size", "2", "--max-batch-tokens", "12000"]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any("worker pool generation 1 up" in line for line in lines):
        assert run.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.05)
    workers = _worker_pids(run.pid)
    time.sleep(1.0)  # the first forward under way on both ranks (the second round's, were it done)
    run.send_signal(signal.SIGINT)
    time.sleep(0.3)
    sent = time.monotonic()
    run.send_signal(signal.SIGINT)
    code = run.wait(timeout=60)
    took = time.monotonic() - sent
    left = [pid for pid in workers if _running(pid)]  # at once: the workers' own watch would take a while yet
    reader.join(timeout=10)
    err = "".join(lines)
    assert len(workers) == 2, (workers, err[-3000:])
    assert code == 130 and "Traceback" not in err and "stopped at once" in err, f"exit {code}:\n{err[-3000:]}"
    assert not left, f"workers {left} outlived packscore score:\n{err[-3000:]}"
    assert took < 10, f"the second Ctrl-C took {took:.1f}s to stop"


def test_sigterm_while_the_pool_starts_stops_it_and_exits_143(tmp_path):
    """A preempted job before scoring began: one line, exit 143, the workers stopped before the exit
    (the default action ended the process with -15 and left them to their own watch of it)."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "input_ids": [1 + i] * 8}) + b"\n" for i in range(4)))
    argv = [sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--device", "cpu",
            "--world-size", "2"]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while len(workers := _worker_pids(run.pid)) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    left = [pid for pid in workers if _running(pid)]
    assert run.returncode == 143 and "Traceback" not in err, f"exit {run.returncode}:\n{err[-3000:]}"
    assert err.splitlines()[-1] == (f"packscore: terminated (SIGTERM) before scoring began; nothing was scored yet, "
                                    f"{out} is as it was: the same command starts again"), err[-3000:]
    assert not left, f"workers {left} outlived packscore score:\n{err[-3000:]}"
    assert not out.exists(), "a first run stopped before scoring left an OUT"


# The console script's run with the scheduler's start held a second once its forward threads and tasks are made
# (writing OUT.start), and OUT.scheduler-closed written once the scheduler's close has ended.
_HELD_START_RUN = """
import pathlib, sys, time
from service import entrypoint
from service.scheduling.scheduler import Scheduler

out = sys.argv[-1]
real_start, real_close = Scheduler.start, Scheduler.close

async def start(self):
    await real_start(self)
    pathlib.Path(out + ".start").touch()
    time.sleep(1)  # the signal comes meanwhile

async def close(self, *args, **kwargs):
    await real_close(self, *args, **kwargs)
    pathlib.Path(out + ".scheduler-closed").touch()

Scheduler.start, Scheduler.close = start, close
sys.argv = ["packscore", *sys.argv[1:]]
sys.exit(entrypoint.main())
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_the_scheduler_starts_closes_it_and_stops_as_while_scoring(tmp_path, signum):
    """A SIGTERM there left the scheduler unclosed (its forward threads running to the exit); a Ctrl-C there was
    noticed only once every line already taken was scored and written, the forwards not yet begun included."""
    rng = np.random.default_rng(5)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # rows of two 6000-token sequences per rank: each forward takes seconds on a CPU
    source.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "input_ids": rng.integers(0, TINY_VOCAB, 6000).tolist()})
                                + b"\n" for i in range(8)))
    argv = [sys.executable, "-c", _HELD_START_RUN, "score", str(source), "--device", "cpu", "--world-size", "2",
            "--max-batch-tokens", "12000", "-o", str(out)]
    run = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while not (tmp_path / "out.jsonl.start").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.01)
    workers = _worker_pids(run.pid)
    run.send_signal(signum)
    _, err = run.communicate(timeout=120)
    left = [pid for pid in workers if _running(pid)]
    kept = out.read_bytes().splitlines() if out.exists() else []
    assert len(workers) == 2, (workers, err[-3000:])
    assert run.returncode == 128 + signum and "Traceback" not in err, f"exit {run.returncode}:\n{err[-3000:]}"
    assert (tmp_path / "out.jsonl.scheduler-closed").exists(), f"the scheduler was not closed:\n{err[-3000:]}"
    assert not left, f"workers {left} outlived packscore score:\n{err[-3000:]}"
    # a Ctrl-C lets the forwards under way (a row on each rank at most) finish, a SIGTERM does not wait for them
    assert len(kept) <= (4 if signum == signal.SIGINT else 0), f"{len(kept)} of the 8 lines written after the signal"
    assert [orjson.loads(line)["id"] for line in kept] == [f"r{i}" for i in range(len(kept))]
    said = (f"interrupted; the results written to {out} are kept" if signum == signal.SIGINT else
            f"terminated (SIGTERM); {len(kept)} of the 8 lines of {source} are in {out}")
    assert said in err.splitlines()[-1], err[-3000:]
