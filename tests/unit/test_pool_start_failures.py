"""How a start's failure is read from a world's processes and pipes: a worker lost (its pipe closed
without a report) against an error a worker reported, real processes and pipes, no model."""

import errno
import signal
import socket
import subprocess
import sys
from multiprocessing import Pipe

import pytest

from model_runtime.parallel.dims import ParallelDims
from model_runtime.pool import messages as msg
from model_runtime.pool.pool import WorkerPool
from model_runtime.pool.procs import WorkerWorld
from model_runtime.pool.supervisor import WorkerLost, _not_joined, _start_failure
from model_runtime.scoring.backend import BackendUnavailableError
from model_runtime.scoring.checkpoint_error import CheckpointError

FAILED = msg.Failure(request_id=-1, kind="internal", message="RuntimeError: Connection closed by peer", fatal=True)


@pytest.fixture
def world():
    """Two ranks: rank 0 reported ``FAILED``; rank 1 runs (``sleep``), its reply pipe open."""
    world = WorkerWorld(1, ParallelDims.from_world(2, 1, False))
    for _ in range(2):
        rep_recv, rep_send = Pipe(duplex=False)
        world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        world.replies.append(rep_recv)
        world.commands.append(rep_send)  # kept open as a live worker's end would be
    world.commands[0].send_bytes(msg.encode(FAILED))
    yield world
    world.stop(graceful=False)


def test_a_failure_after_a_peer_was_lost_is_that_peer_lost(world):
    world.procs[1].send_signal(signal.SIGKILL)
    world.commands[1].close()  # the dead worker's end of its reply pipe
    error = _start_failure(world, 0, msg.decode(world.replies[0].recv_bytes()))
    assert isinstance(error, WorkerLost), repr(error)
    assert "worker rank 1" in str(error) and "killed by SIGKILL" in str(error) and "rank 0 then failed" in str(error), error


def test_a_failure_of_its_own_fails_the_start(world):
    error = _start_failure(world, 0, msg.decode(world.replies[0].recv_bytes()))
    assert type(error) is BackendUnavailableError and "worker rank 0 failed to start: RuntimeError" in str(error), repr(error)


def test_a_peer_that_reported_its_own_failure_is_not_lost(world):
    world.commands[1].send_bytes(msg.encode(FAILED))
    world.commands[1].close()
    error = _start_failure(world, 0, msg.decode(world.replies[0].recv_bytes()))
    assert type(error) is BackendUnavailableError, repr(error)


def test_a_refused_checkpoint_fails_the_start_whatever_the_peers_did(world):
    world.commands[1].close()
    refused = msg.Failure(request_id=-1, kind="checkpoint:non_finite", message="q_proj holds NaN", fatal=True)
    error = _start_failure(world, 0, refused)
    assert isinstance(error, CheckpointError) and error.kind == "non_finite", repr(error)


def test_a_join_timeout_names_the_ranks_that_never_reached_the_rendezvous_else_those_stuck_in_it(world):
    pids = world.pids
    assert _not_joined(world, {1}, set(), 5.0) == (f"worker rank 0 (pid {pids[0]}) did not reach the process group's "
                                                   "rendezvous within 5s of the launch (still running); rank 1 waited there")
    assert _not_joined(world, set(), set(), 0.5) == (f"worker ranks 0, 1 (pids {pids[0]}, {pids[1]}) did not reach the "
                                                     "process group's rendezvous within 0.5s of the launch (still running)")
    assert _not_joined(world, {0, 1}, {0}, 5.0) == (f"worker rank 1 (pid {pids[1]}) did not get through the process group's "
                                                    "rendezvous within 5s of the launch (still running)")


# A stand-in for a rank: echoes its Start onto its reply pipe, then holds what it inherited.
_ECHO_START = ("import sys, time; from multiprocessing.connection import Connection; "
               "Connection(int(sys.argv[2]), readable=False).send_bytes(Connection(int(sys.argv[1]), writable=False).recv_bytes()); "
               "time.sleep(60)")


def test_the_store_port_is_held_from_its_pick_by_a_socket_rank_0_inherits():
    """No other process can take the process group's port before rank 0 serves the store on it:
    the pool binds it and rank 0 inherits the listening socket, the only one left once launched."""
    pool = WorkerPool({"world_size": 2, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    # argv: python -m model_runtime.pool.worker_main --recv-fd R --send-fd S ...
    world.spawn = lambda argv, **kw: subprocess.Popen([sys.executable, "-c", _ECHO_START, argv[4], argv[6]], **kw)
    try:
        world.launch(pool._start_fields)
        starts = [msg.decode(conn.recv_bytes()) for conn in world.replies]
        port = starts[0].master_port
        assert starts[0].master_listen_fd >= 0 and starts[1].master_listen_fd == -1, starts
        assert starts[1].master_port == port
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE, taken.value
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening already: the other ranks wait in its backlog while rank 0 imports torch
        world.procs[0].kill()
        world.procs[0].wait(10)
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))  # only rank 0 held it
    finally:
        world.stop(graceful=False)


def test_a_rank_gone_before_its_start_is_sent_is_a_worker_lost(monkeypatch):
    """Killed between its launch and its ``Start`` (the OOM killer): the world is formed again
    like for any worker lost while starting, not failed by the broken pipe."""

    def gone(argv, **kw):
        proc = subprocess.Popen([sys.executable, "-c", "pass"], **kw)
        proc.wait(60)
        return proc

    monkeypatch.setattr(WorkerWorld, "spawn", staticmethod(gone))
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    with pytest.raises(WorkerLost) as caught:
        pool._start_world()
    assert "worker rank 0" in str(caught.value) and "exited with status 0 while starting" in str(caught.value), caught.value
