"""One generation of the pool's worker processes: launching them, their pipes, stopping them.

Each rank is ``python -m model_runtime.pool.worker_main`` with two inherited pipe descriptors: the
pool writes commands into one and reads replies from the other (``model_runtime.pool.messages``
frames). The pool keeps no other handle on a worker than its ``Popen`` and these pipes.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

from model_runtime.parallel.dims import ParallelDims
from model_runtime.pool import messages as msg

log = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerWorld:
    """One generation of worker processes and their pipes."""

    # How a worker is started; the tests fork it from a pre-imported process (tests/warm_start.py).
    spawn = staticmethod(subprocess.Popen)

    def __init__(self, generation: int, dims: ParallelDims):
        self.generation = generation
        self.dims = dims
        self.failed = False  # set once: by a failure, or by close() before it stops the processes
        self.killed = False  # set by kill(): no process launches after it
        self.procs: list[subprocess.Popen] = []
        self.commands: list[Connection] = []
        self.replies: list[Connection] = []
        self.send_locks = [threading.Lock() for _ in range(dims.world_size)]
        # A group's ranks see its rows and any message to every rank in one order.
        self.group_locks = [threading.Lock() for _ in range(dims.dp)]
        # Held while a process is spawned: kill() from another thread then sees it, or stops the launch.
        self._spawning = threading.Lock()

    def launch(self, start_fields: dict) -> None:
        """Starts every rank's process and sends it its ``Start``; ranks not launched before a
        ``kill()`` never are. On an error the caller stops the world (the ranks launched so far)."""
        # The store's port is bound here and listened on by rank 0 through the inherited socket: no
        # other process of the host can take it between its pick and rank 0's start.
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            self._launch(start_fields, listener)
        finally:
            listener.close()  # rank 0 holds its own copy

    def _launch(self, start_fields: dict, listener: socket.socket) -> None:
        port = listener.getsockname()[1]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
        for rank in range(self.dims.world_size):
            with self._spawning:
                if self.killed:
                    return
                cmd_recv, cmd_send = Pipe(duplex=False)
                rep_recv, rep_send = Pipe(duplex=False)
                child_fds = (cmd_recv.fileno(), rep_send.fileno())
                listen_fd = listener.fileno() if rank == 0 else -1
                try:
                    proc = self.spawn(
                        [sys.executable, "-m", "model_runtime.pool.worker_main", "--recv-fd", str(child_fds[0]),
                         "--send-fd", str(child_fds[1]), "--parent-pid", str(os.getpid())],
                        pass_fds=child_fds + ((listen_fd,) if rank == 0 else ()),
                        env=env,
                    )
                finally:
                    # The child holds its own copies; closing ours lets a dead child's pipe read as EOF.
                    cmd_recv.close()
                    rep_send.close()
                self.procs.append(proc)
                self.commands.append(cmd_send)
                self.replies.append(rep_recv)
            start = msg.Start(rank=rank, generation=self.generation, master_port=port, master_listen_fd=listen_fd,
                              **start_fields)
            try:
                cmd_send.send_bytes(msg.encode(start))
            except BrokenPipeError:
                pass  # the rank is gone already (a signal, the OOM killer): its reply pipe reads EOF, a worker lost

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, rank: int, frame: bytes) -> None:
        with self.send_locks[rank]:
            self.commands[rank].send_bytes(frame)

    def send_group(self, group: int, frame: bytes) -> None:
        with self.group_locks[group]:
            for rank in self.dims.ranks_of_group(group):
                self.send(rank, frame)

    def send_every(self, frame: bytes) -> None:
        """Sends ``frame`` to every rank, at the same place in each group's stream of rows."""
        for lock in self.group_locks:
            lock.acquire()
        try:
            for rank in range(self.dims.world_size):
                self.send(rank, frame)
        finally:
            for lock in self.group_locks:
                lock.release()

    def all_running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL to every process still running, a launch under way included (their pipes stay
        open for whoever owns them)."""
        with self._spawning:
            self.killed = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # our own child, by its Popen handle

    def wait_exited(self, timeout_s: float) -> None:
        """Waits, ``timeout_s`` at most in all, for every launched process to end (after ``kill()``)."""
        deadline = time.monotonic() + timeout_s
        for p in list(self.procs):
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not exit %.0fs after SIGKILL", p.pid, timeout_s)
                return

    def stop(self, graceful: bool) -> None:
        """Shuts the processes down (politely first when ``graceful``) and closes the pipes."""
        if graceful:
            for rank in range(len(self.procs)):
                try:
                    self.send(rank, msg.encode(msg.Shutdown()))
                except OSError:
                    pass
            deadline = time.monotonic() + 10.0
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not exit after SIGKILL", p.pid)
        for conn in self.commands + self.replies:
            conn.close()
