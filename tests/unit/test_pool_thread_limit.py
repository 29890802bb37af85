"""The pool's own threads where the process's thread limit refuses one (``Thread.start`` raises
RuntimeError "can't start new thread"): nothing unstarted is left for ``close()`` to join (joining
it raises), and a world whose replies no reader would read never serves. No model, no workers."""

import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from model_runtime.pool import supervisor
from model_runtime.pool.pool import WorkerPool
from model_runtime.pool.procs import WorkerWorld
from model_runtime.scoring.backend import BackendUnavailableError
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.types import SequenceInput


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def refuse(monkeypatch):
    """``refuse(prefix)``: from now on a thread whose name starts with ``prefix`` cannot start."""
    real_start = threading.Thread.start

    def arm(prefix: str) -> None:
        def start(thread: threading.Thread) -> None:
            if thread.name.startswith(prefix):
                raise RuntimeError("can't start new thread")
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", start)

    return arm


@pytest.fixture
def died(refuse):
    """A pool whose world (one process that only sleeps) is about to be reported dead, with the restart
    loop's thread refused: ``(pool, world)``."""
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    pool._world, pool._alive = world, True
    refuse("pool-restart")
    return pool, world


def test_a_reader_that_cannot_start_is_not_left_for_close_to_join(refuse):
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    refuse("pool-reader")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool._watch(world)
    assert pool._readers == [], f"an unstarted reader was registered: {pool._readers!r}"
    pool.close()  # raised "cannot join thread before it is started"


def test_a_world_without_its_reader_never_serves(refuse, monkeypatch):
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    launched: list[WorkerWorld] = []

    def greeted(world: WorkerWorld) -> dict:
        world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        launched.append(world)
        return {}

    monkeypatch.setattr(pool, "_launch_and_greet", greeted)
    refuse("pool-reader")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool._start_world()
    (world,) = launched
    assert pool._world is None, "a world nobody reads the replies of was made the serving one"
    assert world.failed and not world.all_running(), "the unread world's workers were left running"
    pool.close()


def test_a_refused_restart_loop_is_started_again_by_a_use_of_the_pool_after_a_pause(died, caplog, monkeypatch):
    """A refused restart loop's thread does not leave the pool down until packscore is restarted: the
    pool stays down, saying why, until a use of it past the pause starts the loop (the real restart
    that follows is tests/distributed/test_pool.py's)."""
    pool, world = died
    try:
        with caplog.at_level(logging.ERROR, logger="model_runtime.pool.supervisor"):
            pool._on_world_failure(world, "worker rank 0 exited (status -9)")
        assert not pool._alive and pool._restart_thread is None and not pool._restarting
        assert "its restart could not start" in caplog.text and "its next use tries again" in caplog.text, caplog.text
        assert "thread limit" in pool.restart_error, pool.restart_error  # /readyz's restart_failed, /score's 503
        assert not pool.is_alive() and pool._restart_thread is None, "a use within the pause tried again"
        pool._restart_refused = (0.0, pool._restart_refused[1])  # the pause has passed
        pool._vocab_size = 16  # what start() reads from the workers
        with pytest.raises(BackendUnavailableError):
            pool.score_row([SequenceInput(np.arange(4))])  # refused again: the pause doubles
        assert pool._restart_refused[1] == 2.0 and pool._restart_thread is None and not pool._restarting
        monkeypatch.undo()  # threads start again
        ran = threading.Event()
        monkeypatch.setattr(pool, "_restart_until_up", ran.set)
        pool._restart_refused = (0.0, pool._restart_refused[1])
        assert not pool.is_alive()
        assert ran.wait(10.0), "the next use of the pool started no restart loop"
        assert pool._restart_thread is not None and pool._restart_refused is None and pool.restart_error is None
        pool.close()  # raised "cannot join thread before it is started"
    finally:
        world.stop(graceful=False)


def test_a_refused_restarts_retry_after_is_the_pause_left_before_a_use_tries_again(died):
    """/score's Retry-After while the restart is refused: the pool's pause left (1 s, then 2 s, ...),
    not its longest pause of 30 s, which kept a trainer waiting long after the pool tried again."""
    pool, world = died
    try:
        pool._on_world_failure(world, "worker rank 0 exited (status -9)")
        assert pool.restart_error is not None and pool.restart_retry_after_s == 1
        pool._restart_refused = (0.0, pool._restart_refused[1])  # the pause has passed: due, still 1
        assert pool.restart_retry_after_s == 1
        assert not pool.is_alive()  # refused again: the pause doubles
        assert pool._restart_refused[1] == 2.0 and pool.restart_retry_after_s == 2
        pool._restart_refused = (time.monotonic() + 11.5, 12.0)
        assert pool.restart_retry_after_s in (11, 12)  # rounded up
        pool._restart_refused = (time.monotonic() + 300.0, 300.0)
        assert pool.restart_retry_after_s == 30, "more than the longest pause: Retry-After is bounded by it"
        pool.close()
    finally:
        world.stop(graceful=False)


def test_a_failed_restart_attempts_retry_after_is_its_back_off_left(monkeypatch):
    """A restart attempt that fails (here a changed checkpoint) is tried again after the loop's
    back-off: /score's Retry-After is that back-off's seconds left, rounded up."""
    monkeypatch.setattr(supervisor, "RESTART_PAUSE_S", 8.0)
    pool = WorkerPool({"world_size": 1, "device": "cpu"})

    def changed() -> None:
        raise CheckpointError("unreadable", "the checkpoint changed since version 'v1' was loaded from it")

    monkeypatch.setattr(pool, "_check_checkpoint_unchanged", changed)
    pool._restarting = True
    pool._start_restart_loop(1)
    try:
        assert wait_for(lambda: pool.restart_error is not None), "the restart attempt did not fail"
        # the reason alone: when the pool next tries is read live, never frozen into the text (it would go stale)
        assert pool.restart_error == "the checkpoint changed since version 'v1' was loaded from it", pool.restart_error
        assert pool.restart_retry_after_s in (7, 8), pool.restart_retry_after_s
    finally:
        pool.close()  # ends the back-off's wait
