"""The pool's own threads where the process's thread limit refuses one (``Thread.start`` raises
RuntimeError "can't start new thread"): nothing unstarted is left for ``close()`` to join (joining
it raises), and a world whose replies no reader would read never serves. No model, no workers."""

import logging
import subprocess
import sys
import threading

import numpy as np
import pytest

from model_runtime.pool.pool import WorkerPool
from model_runtime.pool.procs import WorkerWorld
from model_runtime.scoring.backend import BackendUnavailableError
from model_runtime.types import SequenceInput


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


def test_a_refused_restart_loop_is_started_again_by_a_use_of_the_pool_after_a_pause(refuse, caplog, monkeypatch):
    """Refused, the restart loop's thread left the pool down until packscore was restarted: now the
    pool stays down, saying why, until a use of it past the pause starts the loop (the real restart
    that follows is tests/distributed/test_pool.py's)."""
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    pool._world, pool._alive = world, True
    refuse("pool-restart")
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
