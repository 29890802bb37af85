"""A row sent while its worker world fails is answered at once, never left to wait out the timeout.

The race: ``_run_on_group`` reads ``world.failed`` without the lock, then registers the row. If
the world fails in between, ``_fail_pending`` has already collected that world's rows, its reader
has stopped, and a row registered afterwards would wait ``worker_timeout_s + 30`` s. These tests
land the failure exactly in that gap (no processes: the pool's bookkeeping only).
"""

import itertools
import threading
import time

import numpy as np
import pytest

from model_runtime.parallel.dims import ParallelDims
from model_runtime.pool.pool import WorkerPool
from model_runtime.scoring.backend import BackendUnavailableError
from model_runtime.types import SequenceInput


class RacingWorld:
    """A worker world that fails right after the caller's unlocked ``failed`` check."""

    generation = 1

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self._failed = False
        self.armed = True
        self.sent = []
        self.stopped = False

    @property
    def failed(self) -> bool:
        value = self._failed
        if self.armed:  # the caller has just passed its check: the world dies now
            self.armed = False
            self.pool._on_world_failure(self, "rank 0 exited (test)")
        return value

    @failed.setter
    def failed(self, value: bool) -> None:
        self._failed = value

    def send_group(self, group: int, frame: bytes) -> None:
        self.sent.append(group)

    def stop(self, graceful: bool) -> None:
        self.stopped = True


def bare_pool(timeout_s: float = 600.0) -> WorkerPool:
    """The pool's bookkeeping without processes (the constructor would start a world)."""
    pool = WorkerPool.__new__(WorkerPool)
    pool.dims = ParallelDims.from_world(1, 1, False)
    pool.request_timeout_s = timeout_s
    pool._lock = threading.Lock()
    pool._ids = itertools.count(1)
    pool._pending = {}
    pool._lane_cost = [0.0]
    pool._rows_done = [0]
    pool._costs = (1.0, 0.0)
    pool._alive = True
    pool._closed = threading.Event()
    pool._closed.set()  # no restart thread
    pool._restart_thread = None
    pool._restart_refused = None
    pool._readers = []
    pool._hashes = []
    pool._restarting = False
    pool._starting = None  # no world loading
    pool._seconds_per_cost = None  # no rate measured: rows are bounded by ``timeout_s``
    pool.stall_floor_s = 60.0
    return pool


def _within(fn, seconds: float):
    """Runs ``fn`` in a thread; returns what it raised (or None), failing if it takes longer."""
    outcome = {}

    def target():
        try:
            fn()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the row still waits after {seconds}s (it would wait the 630 s timeout)"
    return outcome.get("error"), time.monotonic() - started


def test_a_row_registered_as_its_world_fails_is_failed_at_once():
    pool = bare_pool()
    world = RacingWorld(pool)
    pool._world = world
    rows = [SequenceInput(np.array([1, 2, 3]))]
    error, took = _within(lambda: pool._run_on_group(rows, 0), 5.0)
    assert isinstance(error, BackendUnavailableError), error
    assert not world.armed and world.stopped, "the failure must have landed inside the call"
    assert world.sent == [], "a row for a failed world is not sent"
    assert pool._pending == {} and pool._lane_cost == [0.0]
    print(f"answered in {took * 1e3:.1f} ms")


def test_rows_registered_before_the_failure_are_failed_by_it():
    pool = bare_pool()
    world = RacingWorld(pool)
    world.armed = False
    pool._world = world
    pending = pool._new_pending(world)
    assert not pending.done.is_set()
    pool._on_world_failure(world, "rank 1 exited (test)")
    assert pending.done.is_set() and isinstance(pending.error, BackendUnavailableError)


@pytest.mark.parametrize("how", ["close", "failure"])
def test_no_row_can_be_registered_after_its_world_was_failed(how):
    """Many threads register rows while the world fails: every one of them is settled."""
    pool = bare_pool()
    world = RacingWorld(pool)
    world.armed = False
    pool._world = world
    pool._steps = None
    made, stop = [], threading.Event()

    def register():
        while not stop.is_set():
            made.append(pool._new_pending(world))

    threads = [threading.Thread(target=register) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    if how == "close":
        pool._steps = type("Q", (), {"put": lambda self, item: None})()
        pool.close()
    else:
        pool._on_world_failure(world, "rank 0 exited (test)")
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert made and all(p.done.is_set() for p in made), f"{sum(not p.done.is_set() for p in made)} rows left waiting"
