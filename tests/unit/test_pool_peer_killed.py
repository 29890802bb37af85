"""A rank's collective fails when a peer is killed: the row's answer is the pool's restart (503), not a bug (500).

With FSDP lockstep or Ulysses, a peer killed mid-forward (SIGKILL, the OOM killer) makes the other
ranks' collectives fail ("Connection reset by peer"); a survivor's ``Failure`` can reach the pool
before the dead rank's closed pipe does. Real processes stand in for the ranks; no model is loaded.
"""

import signal
import subprocess
import sys

import pytest

from model_runtime.pool import messages as msg
from model_runtime.scoring.backend import BackendUnavailableError
from tests.unit.test_pool_failure_race import RacingWorld, bare_pool


@pytest.fixture
def ranks():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def deliver_failure(ranks, message: str):
    pool = bare_pool()
    world = RacingWorld(pool)
    world.armed = False
    world.procs = ranks
    pool._world = world
    pending = pool._new_pending(world)
    failure = msg.Failure(request_id=pending.request_id, kind="internal", message=message, fatal=True)
    pool._deliver(world, 0, failure)
    assert pending.done.is_set() and world.stopped
    return pending.error


def test_a_survivors_failure_after_a_peer_was_killed_is_the_pools_restart(ranks):
    ranks[1].send_signal(signal.SIGKILL)
    ranks[1].wait()
    error = deliver_failure(ranks, "RuntimeError: gloo Read error: Connection reset by peer")
    assert isinstance(error, BackendUnavailableError), repr(error)
    assert "worker rank 1" in str(error) and "SIGKILL" in str(error), str(error)


def test_a_failure_whose_peer_still_runs_stays_the_rows(ranks):
    error = deliver_failure(ranks, "RuntimeError: a bug in the forward")
    assert type(error) is RuntimeError and "a bug in the forward" in str(error), repr(error)


def test_a_failure_whose_peer_ended_by_itself_stays_the_rows(ranks):
    """A peer that reported its own failure exits with status 1: that is no loss of a worker."""
    ranks[1].kill()
    ranks[1].wait()
    ranks[1] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    ranks[1].wait()
    error = deliver_failure(ranks, "RuntimeError: a bug in the forward")
    assert type(error) is RuntimeError, repr(error)
