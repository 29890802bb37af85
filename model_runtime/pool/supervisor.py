"""The pool's worker worlds over time: starting one, watching its replies, failing and restarting it.

A world (``procs.WorkerWorld``) is one generation of worker processes. ``_start_world`` launches
one and waits for every rank's ``Hello`` (``_start_first_world``: the start's, formed again after a
worker lost meanwhile); a reader thread per world delivers the leaders' replies
to the rows waiting for them and turns a closed pipe, an exited process, a row past its time
bound or a weights load a rank stopped answering (``updates.WeightUpdates._stuck_load``) into a
failure of the whole world: its rows fail with ``BackendUnavailableError`` and a restart loop
starts worlds (after checking the loaded checkpoint is unchanged) until one has scored a warm-up
pass; a restart loop whose thread the process's thread limit refused is started again by a later
use of the pool (a submit, a readiness check), after a pause. ``Supervisor`` is a
part of ``pool.WorkerPool``: it uses the pool's ``dims``, ``_start_fields``, ``_generation``,
``_world``, ``_starting``, ``_pending``, ``_loaded``, ``_alive``, ``_closed``, ``_readers``,
``_restarting``, ``_restart_thread``, ``_restart_refused``, ``_restart_next``, ``_restarts``, ``restart_error``,
``prefix_rounding``, ``_seconds_per_cost``, ``start_timeout_s``, ``join_timeout_s``, ``_lock``,
``warm_up`` and ``_stuck_load``.
"""

from __future__ import annotations

import logging
import math
import signal
import subprocess
import threading
import time
from multiprocessing.connection import wait

from model_runtime.pool import messages as msg
from model_runtime.pool.procs import WorkerWorld
from model_runtime.pool.replies import agreed_rounding, reply_error
from model_runtime.scoring.backend import STALL_FACTOR, BackendUnavailableError
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.still_lines import saying_still

log = logging.getLogger(__name__)


# A world formed again after a worker was lost while the start's world formed; lost every time fails the start.
FIRST_WORLD_ATTEMPTS = 3
# Pause before forming it again, doubled each time: a checkpoint that kills every worker (the
# host's memory) is not loaded back to back while what the lost one held is still being freed.
FIRST_WORLD_PAUSE_S = 2.0
CLOSED_WHILE_STARTING = "the worker pool was closed while starting"  # close() ended the start's wait
# Pause between restart attempts (a failed world, a refused restart thread), doubled each time up to the most.
RESTART_PAUSE_S = 1.0
RESTART_PAUSE_MAX_S = 30.0


class WorkerLost(BackendUnavailableError):
    """A worker exited while its world formed without reporting an error (a signal, the OOM killer)."""


class NotJoined(WorkerLost):
    """A worker still running did not join its world's process group in time (stopped, or stuck in
    its imports or in the rendezvous): no checkpoint was loaded yet, the next world may form."""


def _ended(world: WorkerWorld, rank: int) -> str:
    """How rank ``rank``'s process ended, for a log line: its exit status or the signal that killed it."""
    proc = world.procs[rank]
    try:
        code = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return f"worker rank {rank} (pid {proc.pid}) closed its reply pipe while starting, still running"
    return f"worker rank {rank} (pid {proc.pid}) {_how(code)} while starting"


def _how(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _killed_peer(world: WorkerWorld, reporter: int, grace_s: float = 0.1) -> str | None:
    """A rank other than ``reporter`` that a signal ended (SIGKILL, the OOM killer), described, if one
    is found within ``grace_s``: a peer's death fails the reporter's collectives, so the reporter's
    error is that loss, not its row's. A peer ending by itself (its own failure, status 1) is not one.
    Exit statuses, not pipes as the start's ``_lost_peer`` reads: while serving, the pipes' replies are the reader's."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, proc in enumerate(world.procs):
            if rank != reporter and (code := proc.poll()) is not None and code < 0:
                return f"worker rank {rank} (pid {proc.pid}) {_how(code)}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _not_joined(world: WorkerWorld, joining: set[int], joined: set[int], timeout_s: float) -> str:
    """Which ranks kept the process group from forming within ``timeout_s`` of the launch, for one
    line: those that never reached the rendezvous, else those that did not get through it."""
    ranks = range(world.dims.world_size)
    absent, waited = [r for r in ranks if r not in joining], sorted(joining)
    what = "did not reach the process group's rendezvous"
    if not absent:  # every rank reached it: name those still in it
        absent, waited, what = [r for r in ranks if r not in joined], [], "did not get through the process group's rendezvous"
    pids = [world.procs[r].pid for r in absent]
    running = "still running" if all(world.procs[r].poll() is None for r in absent) else "then exited"
    who = (f"worker rank {absent[0]} (pid {pids[0]})" if len(absent) == 1
           else f"worker ranks {', '.join(map(str, absent))} (pids {', '.join(map(str, pids))})")
    peers = f"; {'rank' if len(waited) == 1 else 'ranks'} {', '.join(map(str, waited))} waited there" if waited else ""
    return f"{who} {what} within {timeout_s:g}s of the launch ({running}){peers}"


def _start_failure(world: WorkerWorld, rank: int, reply: msg.Failure) -> Exception:
    """The error a start fails with when rank ``rank`` reported ``reply``."""
    if reply.kind.startswith("checkpoint:"):  # refused once its weights were read (NaN)
        return CheckpointError(reply.kind.removeprefix("checkpoint:"), reply.message)
    if reply.kind == "invalid":  # a layout the model cannot take (heads vs sp): a configuration error
        return ValueError(f"worker rank {rank} failed to start: {reply.message}")
    # A peer lost mid-start fails the others' collectives; its reply pipe closed before they noticed.
    lost = _lost_peer(world, rank)
    if lost is not None:
        return WorkerLost(f"{_ended(world, lost)} (rank {rank} then failed: {reply.message})")
    return BackendUnavailableError(f"worker rank {rank} failed to start: {reply.message}")


def _lost_peer(world: WorkerWorld, reporter: int) -> int | None:
    """A rank other than ``reporter`` whose reply pipe closed without a ``Failure``, if any."""
    for rank, conn in enumerate(world.replies):
        if rank == reporter:
            continue
        try:
            while conn.poll(0):
                if isinstance(msg.decode(conn.recv_bytes()), msg.Failure):
                    break  # it reported its own error: not lost
        except (EOFError, OSError):
            return rank
    return None


class Supervisor:
    """The pool's world lifecycle (see the module docstring)."""

    # Starting and restarting.

    def _start_first_world(self) -> list[msg.Hello]:
        """The start's world, formed again when a worker was lost while it formed (a signal, the OOM
        killer: nothing says the next one fails too) or did not join its process group in time
        (``NotJoined``), ``FIRST_WORLD_ATTEMPTS`` times at most, ``FIRST_WORLD_PAUSE_S`` apart (doubling), so that a
        checkpoint that kills every worker still fails the start; an error a worker reported (a
        checkpoint refused, a layout the model cannot take) fails it at once. ``close()`` during a
        pause ends the start at once."""
        for attempt in range(1, FIRST_WORLD_ATTEMPTS + 1):
            if attempt > 1:
                self._check_checkpoint_unchanged()  # the version hashed at start names what the new world loads
            try:
                return self._start_world()
            except WorkerLost as error:
                if self._closed.is_set():
                    raise BackendUnavailableError(CLOSED_WHILE_STARTING) from None
                if attempt == FIRST_WORLD_ATTEMPTS:
                    raise WorkerLost(f"the worker pool did not start: a worker was lost at each of {attempt} "
                                     f"attempts, the last: {error}") from None
                pause = FIRST_WORLD_PAUSE_S * 2 ** (attempt - 1)
                log.warning("worker pool generation %d not formed: %s; forming it again in %gs (attempt %d of %d)",
                            self._generation, error, pause, attempt + 1, FIRST_WORLD_ATTEMPTS)
                if self._closed.wait(pause):
                    raise BackendUnavailableError(CLOSED_WHILE_STARTING) from None
        raise AssertionError("FIRST_WORLD_ATTEMPTS must be at least 1")

    def _start_world(self) -> list[msg.Hello]:
        """Launches a world and waits for every rank's ``Hello``. Raises ``WorkerLost`` when a worker
        exited without reporting why (``NotJoined`` when one still running kept the process group
        from forming within ``join_timeout_s``), the reported error when one did."""
        self._generation += 1
        world = WorkerWorld(self._generation, self.dims)
        with self._lock:
            self._starting = world  # close() from here on kills it, its launch included
            closing = self._closed.is_set()
        if closing:
            world.kill()
        try:
            hellos = self._launch_and_greet(world)
            self._watch(world)  # before the world serves: one whose replies nobody reads would never answer
            with self._lock:
                if self._closed.is_set():
                    raise BackendUnavailableError(CLOSED_WHILE_STARTING)
                self._world = world
        except BaseException:
            world.failed = True
            world.stop(graceful=False)
            raise
        finally:
            with self._lock:
                self._starting = None
        log.info("worker pool generation %d up: pids %s, layout %s", world.generation, world.pids, self.dims.as_info())
        ordered = [hellos[r] for r in range(self.dims.world_size)]
        self.prefix_rounding = agreed_rounding(ordered)
        return ordered

    def _launch_and_greet(self, world: WorkerWorld) -> dict[int, msg.Hello]:
        """Launches ``world`` and returns every rank's ``Hello``, by rank; raises as ``_start_world`` says."""
        hellos: dict[int, msg.Hello] = {}
        joining: set[int] = set()
        joined: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        with self._lock:  # an update's commit is never half-seen
            fields = dict(self._start_fields)
        world.launch(fields)
        # The rendezvous has its own, shorter bound: the loading after it may take the start's.
        join_deadline = time.monotonic() + self.join_timeout_s
        while len(hellos) < self.dims.world_size:
            if world.killed:  # by close(), maybe before every rank launched
                raise BackendUnavailableError(CLOSED_WHILE_STARTING)
            until = deadline if len(joined) == self.dims.world_size else min(deadline, join_deadline)
            ready = wait(world.replies, timeout=min(1.0, max(0.0, until - time.monotonic())))
            for conn in ready:
                rank = world.replies.index(conn)
                try:
                    reply = msg.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    raise WorkerLost(_ended(world, rank)) from None
                if isinstance(reply, msg.Failure):
                    raise _start_failure(world, rank, reply)
                if isinstance(reply, msg.Joining):
                    joining.add(rank)
                elif isinstance(reply, msg.Joined):
                    joined.add(rank)
                else:
                    hellos[rank] = reply
            if len(joined) < self.dims.world_size and time.monotonic() > join_deadline:
                raise NotJoined(_not_joined(world, joining, joined, self.join_timeout_s))
            if time.monotonic() > deadline:
                raise BackendUnavailableError(f"workers did not start within {self.start_timeout_s:.0f}s")
            if not ready and not world.all_running():
                raise WorkerLost(_ended(world, next(r for r, p in enumerate(world.procs) if p.poll() is not None)))
        return hellos

    def _watch(self, world: WorkerWorld) -> None:
        """Starts ``world``'s reader, which ``close()`` waits for."""
        reader = threading.Thread(target=self._read_loop, args=(world,), name=f"pool-reader-{world.generation}", daemon=True)
        with self._lock:  # started before close() can see it: joining a thread not started raises
            reader.start()  # the thread limit's RuntimeError leaves nothing registered
            self._readers = [t for t in self._readers if t.is_alive()] + [reader]

    def _check_checkpoint_unchanged(self) -> None:
        """Refuses to restart from a checkpoint directory whose content is no longer what the
        version serving names (a trainer saved over it): those weights would serve under it.
        Files of the same sizes and times pass at once; others are hashed."""
        with self._lock:
            loaded, version = self._loaded, self._start_fields["weights_version"]
        if loaded is None:
            return
        problem = loaded.changed()
        if problem is not None:
            raise CheckpointError("unreadable", f"{loaded.path} {problem} since version {version!r} was loaded from it: "
                                  "restore its files, or restart packscore to serve what it holds now")

    def _restart_loop(self) -> None:
        try:
            self._restart_until_up()
        finally:
            with self._lock:
                self._restarting = False

    def _restart_until_up(self) -> None:
        delay = RESTART_PAUSE_S
        while not self._closed.is_set():
            try:
                self._check_checkpoint_unchanged()
                self._seconds_per_cost = None  # fresh processes: the warm-up compiles, and measures again
                self._start_world()
                # fresh processes compile their kernels again: seconds with a kept kernel cache, a minute without
                log.info("warming up the restarted worker pool: one pass of the served shapes per group")
                with saying_still(log, "warming up the restarted worker pool"):
                    self.warm_up()
                self._alive = True
                self._restarts += 1
                self.restart_error = None
                log.info("worker pool restarted; a scoring pass succeeded")
                return
            except Exception as error:
                if self._closed.is_set():  # close() killed the world this attempt started: no failure to report
                    break
                self._restart_next = time.monotonic() + delay
                self.restart_error = str(error)  # when it next tries is read live (restart_retry_after_s), never frozen here
                if isinstance(error, CheckpointError):
                    log.error("worker pool restart refused: %s; retrying in %.0fs", error, delay)
                elif isinstance(error, BackendUnavailableError):  # a worker exited or timed out: the message says which
                    log.error("worker pool restart failed: %s; retrying in %.0fs", error, delay)
                else:
                    log.exception("worker pool restart failed; retrying in %.0fs", delay)
                with self._lock:
                    world, self._world = self._world, None
                    if world is not None:
                        world.failed = True
                if world is not None:
                    self._fail_pending(world.generation, "the worker pool failed to restart")
                    world.stop(graceful=False)
                if self._closed.wait(delay):  # close() during the backoff: no line after it returns
                    break
                delay = min(RESTART_PAUSE_MAX_S, delay * 2)
        log.info("worker pool restart abandoned: the pool is shutting down")

    def _on_world_failure(self, world: WorkerWorld, reason: str) -> None:
        with self._lock:
            if world.failed:
                return
            world.failed = True
            self._alive = False
            # A world failing while a restart loop warms it up: that loop starts another
            restart = not self._closed.is_set() and not self._restarting
            self._restarting = self._restarting or restart
        log.error("worker pool generation %d failed: %s; restarting", world.generation, reason)
        self._fail_pending(world.generation, f"a worker failed ({reason}); the pool is restarting")
        world.stop(graceful=False)
        if restart:
            self._start_restart_loop(world.generation)

    def _start_restart_loop(self, generation: int) -> None:
        """Starts the restart loop the caller marked ``_restarting``. Where the process's thread limit
        refuses its thread, the pool stays down and its next use tries again (``_retry_refused_restart``)."""
        thread = threading.Thread(target=self._restart_loop, name="pool-restart", daemon=True)
        with self._lock:  # close() reads it under the lock: never one it could join before its start
            refused, why = self._restart_refused, None
            if self._closed.is_set():  # close() read no thread to join: none may start now
                self._restarting = False
                return
            self.restart_error = None  # before the start: the loop may set its own at once
            try:
                thread.start()
            except RuntimeError as error:  # the process's thread limit: no restart loop to wait for
                self._restarting, why = False, error
                pause = min(RESTART_PAUSE_MAX_S, 2 * refused[1]) if refused else RESTART_PAUSE_S
                self._restart_refused = (time.monotonic() + pause, pause)
                self.restart_error = (f"no thread could be started for the restart ({error}); the server is at "
                                      "its thread limit, and the pool's next use after a pause tries again")
            else:
                self._restart_thread, self._restart_refused = thread, None
        if why is not None:
            log.error("worker pool generation %d: its restart could not start (%s); the pool stays down and its "
                      "next use tries again, in %gs at the earliest", generation, why, pause)
        elif refused is not None:
            log.info("worker pool generation %d: its restart started, after its thread was refused", generation)

    @property
    def restart_retry_after_s(self) -> int:
        """Whole seconds until the pool next tries to restart (a failed attempt's back-off, or the
        pause before a use may start a refused loop again), rounded up, 1 to ``RESTART_PAUSE_MAX_S``:
        ``/score``'s and ``/readyz``'s Retry-After while ``restart_error`` is set. 1 once that attempt is due or running."""
        with self._lock:
            refused, at = self._restart_refused, self._restart_next
        at = refused[0] if refused is not None else at
        left = 0.0 if at is None else at - time.monotonic()
        return max(1, min(math.ceil(RESTART_PAUSE_MAX_S), math.ceil(left)))

    def _retry_refused_restart(self) -> None:
        """Starts the restart loop again where the thread limit refused it, the pool is not closed
        and the pause after that refusal has passed; a use of the pool (``is_alive``, ``score_row``)
        calls it while the pool is down."""
        if self._restart_refused is None:  # read unlocked: the pool's usual state, checked under the lock below
            return
        with self._lock:
            retry = (self._restart_refused is not None and time.monotonic() >= self._restart_refused[0]
                     and not self._restarting and not self._closed.is_set())
            self._restarting = self._restarting or retry
        if retry:
            self._start_restart_loop(self._generation)

    def _fail_pending(self, generation: int, reason: str) -> None:
        with self._lock:
            doomed = [p for p in self._pending.values() if p.generation == generation]
        for p in doomed:
            p.settle(error=BackendUnavailableError(reason))

    # Replies.

    def _read_loop(self, world: WorkerWorld) -> None:
        """Delivers leader replies; turns a closed pipe, an exited process or a stuck row into a failure."""
        while not world.failed and not self._closed.is_set():
            try:
                ready = wait(world.replies, timeout=0.2)
            except OSError:
                ready = []
                if world.failed or self._closed.is_set():
                    return
            for conn in ready:
                rank = world.replies.index(conn)
                try:
                    reply = msg.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    proc = world.procs[rank]
                    try:
                        code = proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        code = "unknown: still running with its reply pipe closed"
                    self._on_world_failure(world, f"worker rank {rank} (pid {proc.pid}) exited (status {code})")
                    return
                self._deliver(world, rank, reply)
            if not world.all_running():
                dead = [r for r, p in enumerate(world.procs) if p.poll() is not None]
                self._on_world_failure(world, f"worker ranks {dead} exited")
                return
            now = time.monotonic()
            with self._lock:
                late = [p.request_id for p in self._pending.values() if p.generation == world.generation and now > p.deadline]
            if late:
                self._on_world_failure(world, f"rows {late} ran past their time bound ({STALL_FACTOR:.0f}x what "
                                       "the measured rate says, at least the floor): a worker is stuck")
                return
            stuck = self._stuck_load(world, now)
            if stuck is not None:
                self._on_world_failure(world, stuck)
                return

    def _deliver(self, world: WorkerWorld, rank: int, reply) -> None:
        with self._lock:
            pending = self._pending.get(getattr(reply, "request_id", -1))
        if isinstance(reply, msg.RowResult) and pending is not None:
            pending.settle(reply=reply)
        elif isinstance(reply, msg.WeightsDone) and pending is not None:
            pending.add(reply)
        elif isinstance(reply, msg.LoadProgress):
            if pending is not None and pending.progress is not None:
                pending.progressed(rank, reply.bytes_read)  # else its update already ended: nothing waits for it
        elif isinstance(reply, msg.Failure) and world.failed:
            # A peer the stop killed broke this rank's collectives: the stop (close(), a logged failure) settles its rows.
            log.debug("worker rank %d: failure of request %d came after generation %d stopped; dropped (%s): %s",
                      rank, reply.request_id, world.generation, reply.kind, reply.message)
        elif isinstance(reply, msg.Failure):
            log.error("worker rank %d: request %d failed (%s): %s", rank, reply.request_id, reply.kind, reply.message)
            # A fatal failure comes from a world with collectives, where a killed peer fails the others' rows.
            killed = _killed_peer(world, rank) if reply.fatal and reply.kind == "internal" else None
            if pending is not None:
                lost = f"the worker pool is restarting after a worker failure: {killed}"
                pending.settle(error=BackendUnavailableError(lost) if killed else reply_error(reply))
            if reply.fatal:
                self._on_world_failure(world, f"{killed} (rank {rank} then failed: {reply.message})" if killed
                                       else f"worker rank {rank} failed: {reply.message}")
        elif isinstance(reply, (msg.RowResult, msg.WeightsDone)) and (world.failed or self._closed.is_set()):
            # Finished as its world was stopped or failed: that settled its caller with the stop's error first.
            log.debug("worker rank %d: %s of request %d came after generation %d stopped; dropped",
                      rank, type(reply).__name__, reply.request_id, world.generation)
        else:
            log.warning("worker rank %d sent an unexpected %s", rank, type(reply).__name__)
