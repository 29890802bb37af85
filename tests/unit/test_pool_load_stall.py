"""A weight update's load that a rank stops answering counts as stuck (``WeightUpdates._stuck_load``): a
rank silent past the stall floor, or one whose bytes read stop growing past ``worker_timeout_s``. A slow
read that keeps saying how far it got is never cut, however long it has run. The reader's delivery and
check run for real, with the check's time given (no processes; tests/distributed/test_weights_pool.py
stops a real rank)."""

import logging
import time
from types import SimpleNamespace

from model_runtime.pool import messages as msg
from tests.unit.test_pool_failure_race import bare_pool

FLOOR_S, UNMEASURED_S = 60.0, 600.0


def _loading(since_s: float):
    """A pool whose 2 ranks were sent a load ``since_s`` ago and have said nothing since."""
    pool = bare_pool(UNMEASURED_S)
    pool.stall_floor_s = FLOOR_S
    world = SimpleNamespace(generation=1, failed=False, procs=[SimpleNamespace(pid=100 + r) for r in range(2)])
    load = pool._new_pending(world, ranks=2, timeout_s=1800.0)
    sent = time.monotonic() - since_s
    load.progress = {rank: (sent, sent, 0) for rank in range(2)}
    return pool, world, load


def test_a_slow_read_that_keeps_reading_is_never_cut():
    pool, world, load = _loading(since_s=3000.0)  # far past every bound: a 35B checkpoint on a slow disk
    for rank in range(2):
        pool._deliver(world, rank, msg.LoadProgress(load.request_id, rank, 2**30))
    assert pool._stuck_load(world, time.monotonic() + FLOOR_S - 1) is None


def test_a_rank_silent_past_the_floor_is_stuck_and_named():
    pool, world, load = _loading(since_s=FLOOR_S - 1)
    pool._deliver(world, 0, msg.LoadProgress(load.request_id, 0, 1))
    assert pool._stuck_load(world, time.monotonic()) is None  # within the floor
    why = pool._stuck_load(world, time.monotonic() + 2)
    assert why is not None and why.startswith("worker rank 1 (pid 101) said nothing for 61s"), why


def test_a_rank_done_reading_is_not_waited_for():
    pool, world, load = _loading(since_s=FLOOR_S + 10)
    load.add(msg.WeightsDone(load.request_id, 1, True, "", "", 1.0))  # rank 1 read all of it, then fell silent
    pool._deliver(world, 0, msg.LoadProgress(load.request_id, 0, 1))
    assert pool._stuck_load(world, time.monotonic()) is None


def test_a_rank_that_says_it_is_alive_but_reads_nothing_is_stuck_past_the_unmeasured_bound():
    pool, world, load = _loading(since_s=UNMEASURED_S + 5)  # a hung GPU: its ticker thread still runs
    pool._deliver(world, 0, msg.LoadProgress(load.request_id, 0, 2**20))
    pool._deliver(world, 1, msg.LoadProgress(load.request_id, 1, 0))
    why = pool._stuck_load(world, time.monotonic())
    assert why is not None and why.startswith("worker rank 1 (pid 101) read nothing of the update for 605s"), why


def test_progress_after_its_update_ended_is_dropped_quietly(caplog):
    pool, world, _ = _loading(since_s=0.0)
    with caplog.at_level(logging.DEBUG, logger="model_runtime.pool.supervisor"):
        pool._deliver(world, 1, msg.LoadProgress(12345, 1, 1))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
