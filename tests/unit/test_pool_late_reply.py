"""A row (or weights command) that finishes while the pool stops is dropped quietly, not called unexpected.

The race: the reader has taken the leader's ``RowResult`` off its pipe (``wait`` returned) when
``close()`` (SIGINT, or a drain cut off) marks the world failed and ``_fail_pending`` settles the
row with the stop's error; the caller's ``_await`` then removes it from ``_pending``. The reader's
``_deliver`` finds no row for the reply. Here the close, the caller and the removal run for real;
the reader's step after its ``wait`` is the direct ``_deliver`` call (no processes).
"""

import logging
import threading

import pytest

from model_runtime.pool import messages as msg
from model_runtime.scoring.backend import BackendUnavailableError
from tests.unit.test_pool_failure_race import RacingWorld, bare_pool

SUPERVISOR = "model_runtime.pool.supervisor"


def _reply(kind: str, request_id: int):
    if kind == "RowResult":
        return msg.RowResult(request_id=request_id, top_k=0, logprobs=b"", entropy=b"", top_k_ids=b"",
                             top_k_logprobs=b"", weights_version="v1")
    return msg.WeightsDone(request_id, 1, True, "", "", 0.01)


def _pool_with_a_world():
    pool = bare_pool()
    pool._closed.clear()  # open until close(): the stray reply of a live world below must still warn
    pool._steps = type("Q", (), {"put": lambda self, item: None})()  # no stepper (no FSDP)
    world = RacingWorld(pool)
    world.armed = False
    pool._world = world
    return pool, world


@pytest.mark.parametrize("kind", ["RowResult", "WeightsDone"])
def test_a_reply_that_lands_after_close_failed_its_row_is_dropped_at_debug(kind, caplog):
    pool, world = _pool_with_a_world()
    pending = pool._new_pending(world)
    outcome = {}

    def caller():  # the request's thread, waiting in _await as _run_on_group does
        try:
            pool._await(pending)
        except BaseException as error:
            outcome["error"] = error

    waiting = threading.Thread(target=caller)
    waiting.start()
    pool.close()
    waiting.join(5.0)
    assert not waiting.is_alive() and isinstance(outcome.get("error"), BackendUnavailableError), outcome
    assert pending.request_id not in pool._pending and world.failed
    with caplog.at_level(logging.DEBUG, logger=SUPERVISOR):
        pool._deliver(world, 1, _reply(kind, pending.request_id))  # the reader, past its wait()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == SUPERVISOR]
    assert lines == [(logging.DEBUG, f"worker rank 1: {kind} of request {pending.request_id} came after "
                                     f"generation {world.generation} stopped; dropped")], lines
    assert isinstance(outcome["error"], BackendUnavailableError)  # the caller's answer stays the stop's


@pytest.mark.parametrize("kind", ["RowResult", "WeightsDone"])
def test_a_reply_for_no_row_of_a_live_world_is_still_a_warning(kind, caplog):
    pool, world = _pool_with_a_world()
    with caplog.at_level(logging.DEBUG, logger=SUPERVISOR):
        pool._deliver(world, 1, _reply(kind, 12345))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == SUPERVISOR]
    assert lines == [(logging.WARNING, f"worker rank 1 sent an unexpected {kind}")], lines


@pytest.mark.parametrize("fatal", [True, False], ids=["fatal", "not-fatal"])
def test_a_failure_that_lands_after_close_stopped_its_world_is_dropped_at_debug(fatal, caplog):
    """close() killed a busy world's ranks: a survivor's collectives then fail, and its Failure was logged
    at ERROR as if something had gone wrong while serving. The stop settled the row; the line is debug."""
    pool, world = _pool_with_a_world()
    world.procs = []  # no peer to find killed
    pending = pool._new_pending(world)
    pool.close()
    assert pending.done.is_set() and world.failed and world.stopped
    failure = msg.Failure(pending.request_id, "internal", "RuntimeError: gloo Connection reset by peer", fatal)
    with caplog.at_level(logging.DEBUG, logger=SUPERVISOR):
        pool._deliver(world, 1, failure)  # the reader, past its wait()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == SUPERVISOR]
    assert lines == [(logging.DEBUG, f"worker rank 1: failure of request {pending.request_id} came after generation "
                                     f"{world.generation} stopped; dropped (internal): {failure.message}")], lines
    assert isinstance(pending.error, BackendUnavailableError) and "shutting down" in str(pending.error), pending.error
    assert pool._restart_thread is None


def test_a_failure_of_a_live_world_is_still_an_error_and_fails_it(caplog, monkeypatch):
    pool, world = _pool_with_a_world()
    monkeypatch.setattr(pool, "_restart_loop", lambda: None)  # the restart it starts launches nothing
    world.procs = []  # no peer to find killed
    pending = pool._new_pending(world)
    with caplog.at_level(logging.DEBUG, logger=SUPERVISOR):
        pool._deliver(world, 0, msg.Failure(pending.request_id, "internal", "RuntimeError: a bug in the forward", True))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == SUPERVISOR]
    assert lines == [(logging.ERROR, f"worker rank 0: request {pending.request_id} failed (internal): "
                                     "RuntimeError: a bug in the forward"),
                     (logging.ERROR, "worker pool generation 1 failed: worker rank 0 failed: RuntimeError: a bug in "
                                     "the forward; restarting")], lines
    assert world.failed and world.stopped and "a bug in the forward" in str(pending.error), pending.error
