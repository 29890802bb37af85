"""Children forked from the tests' zygote (tests/warm_start.py) start as cold ones do: the same
view of their process, the same exit statuses, descriptors passed at their numbers; and a pool
worker watches its pool's process, which need not be its parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest

from tests import warm_start
from tests.signals import process_state

PROGRAM = [sys.executable, "-m", "tests.child_report"]
REPO = Path(__file__).resolve().parents[2]
FORKS = pytest.mark.skipif(warm_start.cold_only(), reason="everything starts cold here (TESTS_COLD_START=1 or CUDA)")
SPAWNS = pytest.mark.parametrize("spawn", [pytest.param(warm_start.popen, id="warm", marks=FORKS),
                                           pytest.param(subprocess.Popen, id="cold")])


def _start(spawn, tmp_path: Path, name: str, *args: str, env: dict | None = None, **kw):
    with (tmp_path / name).open("wb") as out:
        proc = spawn([*PROGRAM, *args], cwd=REPO, env={**os.environ, **(env or {})}, stdout=out,
                     stderr=subprocess.STDOUT, **kw)
    if spawn is warm_start.popen:
        assert isinstance(proc, warm_start.WarmProcess), "the zygote refused; the test would compare cold with cold"
    return proc


def _report(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / name).read_text().splitlines()[0])


@FORKS
def test_a_forked_child_sees_what_a_cold_one_sees(tmp_path):
    for name, spawn in (("warm", warm_start.popen), ("cold", subprocess.Popen)):
        proc = _start(spawn, tmp_path, name, "two words", "--flag", env={"TESTS_REPORT_MARK": "x"})
        assert proc.wait(timeout=180) == 0, (tmp_path / name).read_text()
    warm, cold = _report(tmp_path, "warm"), _report(tmp_path, "cold")
    assert warm["argv"] == ["two words", "--flag"] and warm["main"] == "tests.child_report"
    assert ["TESTS_REPORT_MARK", "x"] in warm["env"] and warm["descriptors"] == [0, 1, 2]
    assert warm == cold


@SPAWNS
def test_exit_statuses_read_as_popen_reads_them(tmp_path, spawn):
    assert _start(spawn, tmp_path, "exit", env={"TESTS_REPORT_EXIT": "3"}).wait(timeout=180) == 3
    sleeper = _start(spawn, tmp_path, "sleep", env={"TESTS_REPORT_SLEEP_S": "120"})
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.5)
    assert sleeper.poll() is None and sleeper.returncode is None
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL and sleeper.poll() == -signal.SIGKILL
    sleeper.kill()  # a no-op once it has ended, as with Popen


@FORKS
def test_passed_descriptors_arrive_at_their_numbers_and_nothing_else_does(tmp_path):
    read_end, write_end = os.pipe()
    try:
        proc = _start(warm_start.popen, tmp_path, "fds", env={"TESTS_REPORT_WRITE_FDS": str(write_end)},
                      pass_fds=(write_end,))
        os.close(write_end)
        assert proc.wait(timeout=180) == 0, (tmp_path / "fds").read_text()
        assert os.read(read_end, 100) == b"passed"
    finally:
        os.close(read_end)
    assert _report(tmp_path, "fds")["descriptors"] == [0, 1, 2, write_end]


@pytest.mark.parametrize("options", [{"stdout": subprocess.DEVNULL, "start_new_session": True},
                                     {"stdout": subprocess.DEVNULL}, {"stdout": subprocess.PIPE}],
                         ids=["start_new_session", "devnull", "pipe"])
def test_options_a_fork_cannot_honour_start_cold(options):
    proc = warm_start.popen([*PROGRAM], cwd=REPO, **options)
    assert isinstance(proc, subprocess.Popen)
    proc.communicate(timeout=180)
    assert proc.returncode == 0


def _wait_for_its_first_command(worker, limit_s: float = 120.0) -> None:
    """Until the worker, past its imports, blocks reading its command pipe (the kernel's wait channel)."""
    deadline = time.monotonic() + limit_s
    while "pipe" not in Path(f"/proc/{worker.pid}/wchan").read_text():
        assert worker.poll() is None, f"the worker ended with {worker.returncode} before its first command"
        assert time.monotonic() < deadline, "the worker never waited for a command"
        time.sleep(0.1)


@SPAWNS
def test_a_worker_exits_when_its_pool_process_ends_though_that_is_not_its_parent(spawn):
    pool_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    cmd_recv, cmd_send = Pipe(duplex=False)
    rep_recv, rep_send = Pipe(duplex=False)
    fds = (cmd_recv.fileno(), rep_send.fileno())
    worker = spawn([sys.executable, "-m", "model_runtime.pool.worker_main", "--recv-fd", str(fds[0]), "--send-fd",
                    str(fds[1]), "--parent-pid", str(pool_process.pid)], cwd=REPO, pass_fds=fds)
    cmd_recv.close()
    rep_send.close()
    try:
        _wait_for_its_first_command(worker)
        time.sleep(2)  # a watch that misread its parent would have ended it by now
        assert worker.poll() is None, "the worker left while the pool's process still ran"
        pool_process.kill()
        pool_process.wait()
        worker.wait(timeout=30)
        assert worker.returncode == 0
    finally:
        for proc in (worker, pool_process):
            if proc.poll() is None:
                proc.kill()
        cmd_send.close()
        rep_recv.close()


@SPAWNS
def test_poll_answers_at_once_while_another_thread_waits(tmp_path, spawn):
    sleeper = _start(spawn, tmp_path, "sleep", env={"TESTS_REPORT_SLEEP_S": "120"})
    waiter = threading.Thread(target=sleeper.wait)
    waiter.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        assert sleeper.poll() is None
        assert time.monotonic() - started < 1.0, "poll waited for the other thread's wait"
    finally:
        sleeper.kill()
        waiter.join(timeout=30)
    assert sleeper.wait(timeout=30) == -signal.SIGKILL


@FORKS
def test_a_signal_to_a_child_that_ended_unheard_is_a_no_op_as_with_popen(tmp_path):
    """The pool's failed start kills its world again after close() killed it: the zygote may have
    reaped the child while another thread, waiting for it, has not yet read its exit."""
    sleeper = _start(warm_start.popen, tmp_path, "sleep", env={"TESTS_REPORT_SLEEP_S": "120"})
    with sleeper._lock:  # as a thread in wait() holds it before the exit is read
        os.kill(sleeper.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{sleeper.pid}").exists():
            assert time.monotonic() < deadline, "the zygote never reaped its child"
            time.sleep(0.01)
        sleeper.kill()
    assert sleeper.wait(timeout=30) == -signal.SIGKILL


@FORKS
def test_a_zygote_whose_session_ended_during_its_imports_exits(tmp_path):
    """A session killed while its zygote still imports (seconds) leaves no zygote behind: the zygote
    compares its parent with the session's pid, not with whichever parent it has once imported."""
    path = str(tmp_path / "socket")
    session = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; from tests.warm_start import zygote_command; "
         "print(subprocess.Popen(zygote_command(sys.argv[1]), stdin=subprocess.DEVNULL,"
         " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)",
         path],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    zygote = int(session.stdout)
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(path) and process_state(zygote) not in ("gone", "Z"):
            assert time.monotonic() < deadline, "the zygote never got past its imports"
            time.sleep(0.05)
        assert os.path.exists(path), "the zygote ended before its imports did"
        deadline = time.monotonic() + 10
        while process_state(zygote) not in ("gone", "Z"):
            assert time.monotonic() < deadline, "the zygote outlived its session"
            time.sleep(0.05)
    finally:
        if process_state(zygote) not in ("gone", "Z"):
            os.kill(zygote, signal.SIGKILL)
