"""The multi-process worker pool: a ``ScoringBackend`` whose forwards run in ``world_size`` processes.

Layout: ``dp = world_size / sp`` data-parallel groups of ``sp`` ranks (see
``model_runtime.parallel``). One process per GPU on CUDA (NCCL), or CPU processes joined by gloo
with ``device="cpu"``. The HTTP process talks to each worker over two pipes carrying msgpack
frames with raw numpy buffers (``model_runtime.messages``); nothing is pickled.

Scheduling:
- without FSDP the groups are independent: ``score_row`` sends the row to the group with the
  least outstanding estimated cost (``per_token * T + per_token_squared * sum(L_i ** 2)``);
- with FSDP every rank takes part in every layer's all-gather, so a stepper thread sends steps:
  up to ``dp`` queued rows at a time, one per group, and a dummy ``Idle`` row to groups left
  without one.
A group's row may hold ``sp * max_batch_tokens`` tokens (``max_row_tokens``): a sequence too long
for one GPU's budget fits a group whose ``sp`` ranks each hold a shard of it.

Failure: a worker that exits (its reply pipe closes) or a row that outlives ``worker_timeout_s``
fails every in-flight row with ``BackendUnavailableError``; ``is_alive()`` turns False, the whole
world is killed and started again in the background, and ``is_alive()`` returns to True once a
scoring pass through the new world has succeeded.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from model_runtime import messages as msg
from model_runtime.backend import BackendUnavailableError, ModelInfo
from model_runtime.head import MAX_TOP_K, HeadOutput
from model_runtime.parallel.dims import ParallelDims
from model_runtime.scorer import InvalidSequenceError, SequenceInput, SequenceScores, split_results, validate_sequence

log = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_type(device) -> str:
    name = str(device or "auto")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(name).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"the worker pool runs on cpu or cuda, got device {name!r}")
    if name.startswith("cuda:"):
        log.warning("device %s: the worker pool places rank r on cuda:r; the index is ignored", name)
    return kind


@dataclass
class _Pending:
    """One row (or idle step) waiting for its group leader's reply."""

    request_id: int
    generation: int
    deadline: float  # time.monotonic() after which the world is considered hung
    done: threading.Event = field(default_factory=threading.Event)
    reply: msg.RowResult | None = None
    error: BaseException | None = None

    def settle(self, reply=None, error=None) -> None:
        if not self.done.is_set():
            self.reply, self.error = reply, error
            self.done.set()


class _World:
    """One generation of worker processes and their pipes."""

    def __init__(self, generation: int, dims: ParallelDims, start_fields: dict):
        self.generation = generation
        self.dims = dims
        self.failed = False
        self.procs: list[subprocess.Popen] = []
        self.commands: list[Connection] = []
        self.replies: list[Connection] = []
        self.send_locks = [threading.Lock() for _ in range(dims.world_size)]
        try:
            self._launch(start_fields)
        except BaseException:
            self.stop(graceful=False)
            raise

    def _launch(self, start_fields: dict) -> None:
        port = _free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
        for rank in range(self.dims.world_size):
            cmd_recv, cmd_send = Pipe(duplex=False)
            rep_recv, rep_send = Pipe(duplex=False)
            child_fds = (cmd_recv.fileno(), rep_send.fileno())
            proc = subprocess.Popen(
                [sys.executable, "-m", "model_runtime.worker_main", "--recv-fd", str(child_fds[0]), "--send-fd", str(child_fds[1])],
                pass_fds=child_fds,
                env=env,
            )
            # The child holds its own copies; closing ours lets a dead child's pipe read as EOF.
            cmd_recv.close()
            rep_send.close()
            self.procs.append(proc)
            self.commands.append(cmd_send)
            self.replies.append(rep_recv)
            start = msg.Start(rank=rank, generation=self.generation, master_port=port, **start_fields)
            cmd_send.send_bytes(msg.encode(start))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, rank: int, frame: bytes) -> None:
        with self.send_locks[rank]:
            self.commands[rank].send_bytes(frame)

    def send_group(self, group: int, frame: bytes) -> None:
        for rank in self.dims.ranks_of_group(group):
            self.send(rank, frame)

    def all_running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

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
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # our own child, by its Popen handle
        for p in self.procs:
            try:
                p.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not exit after SIGKILL", p.pid)
        for conn in self.commands + self.replies:
            conn.close()


class WorkerPool:
    """``ScoringBackend`` over ``world_size`` worker processes. Build it with ``start_pool``."""

    def __init__(self, settings: dict):
        self.dims = ParallelDims.from_world(
            int(settings.get("world_size", 1) or 1), int(settings.get("sp", 1) or 1), bool(settings.get("fsdp", False))
        )
        self.max_batch_tokens = int(settings.get("max_batch_tokens", 16384))
        self.max_row_tokens = self.dims.row_token_budget(self.max_batch_tokens)
        self.concurrency = self.dims.dp
        self.request_timeout_s = float(settings.get("worker_timeout_s", 600.0))
        self.start_timeout_s = float(settings.get("worker_start_timeout_s", 1800.0))
        device = _device_type(settings.get("device"))
        if device == "cuda" and torch.cuda.device_count() < self.dims.world_size:
            raise ValueError(f"world_size({self.dims.world_size}) > visible GPUs({torch.cuda.device_count()})")
        self._start_fields = dict(
            world_size=self.dims.world_size,
            sp=self.dims.sp,
            fsdp=self.dims.fsdp,
            model=str(settings.get("model", "tiny")),
            device=device,
            dtype=str(settings.get("dtype") or "auto"),
            max_batch_tokens=self.max_batch_tokens,
            allow_slow_kernels=bool(settings.get("allow_slow_kernels", False)),
            served_model_name=str(settings.get("served_model_name") or ""),
            timeout_s=self.request_timeout_s,
        )
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lane_cost = [0.0] * self.dims.dp  # estimated cost of the rows each group has in flight
        self._rows_done = [0] * self.dims.dp  # rows sent to each group (balance, for tests and logs)
        self._steps: queue.Queue = queue.Queue()
        self._world: _World | None = None
        self._alive = False
        self._closing = False
        self._restarts = 0
        self._generation = 0
        hellos = self._start_world()
        first = hellos[0]
        self._vocab_size = first.vocab_size
        self._costs = (first.cost_per_token, first.cost_per_token_squared)
        self.info = ModelInfo(
            name=first.name,
            architecture=first.architecture,
            vocab_size=first.vocab_size,
            max_model_len=first.max_model_len,
            dtype=first.dtype,
            device=first.device,
            weights_version=first.weights_version,
            kernels=dict(first.kernels),
            parallel=self.dims.as_info(),
            slow_kernels=tuple(first.slow_kernels),
        )
        self._alive = True
        if self.dims.lockstep:
            threading.Thread(target=self._step_loop, name="pool-stepper", daemon=True).start()

    # ScoringBackend.

    def score_row(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        for i, seq in enumerate(sequences):
            validate_sequence(seq, self._vocab_size, i)
        if not sequences:
            raise InvalidSequenceError("a row needs at least one sequence", "sequences")
        if not self._alive:
            raise BackendUnavailableError("the worker pool is restarting after a worker failure")
        return self._run(sequences)

    def warm_up(self) -> None:
        """One warm-up pass per group: the budget's shapes on CUDA, one short row on CPU."""
        rng = np.random.default_rng(0)
        rows = [[SequenceInput(rng.integers(0, self._vocab_size, 16), top_k=1)]]
        if self.info.device == "cuda":
            budget = self.max_row_tokens
            rows = [
                [SequenceInput(rng.integers(0, self._vocab_size, budget))],
                [SequenceInput(rng.integers(0, self._vocab_size, 64), top_k=MAX_TOP_K) for _ in range(max(1, budget // 64))],
            ]
        for row in rows:
            # dp concurrent copies: the least-cost routing (or a lockstep step) gives each group one.
            errors: list[BaseException] = []

            def one(row=row):
                try:
                    self._run(row)
                except BaseException as error:
                    errors.append(error)

            threads = [threading.Thread(target=one, name="pool-warm-up") for _ in range(self.dims.dp)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]

    def is_alive(self) -> bool:
        world = self._world
        return self._alive and world is not None and not world.failed and world.all_running()

    def close(self) -> None:
        self._closing = True
        self._alive = False
        self._steps.put(None)
        with self._lock:
            world, self._world = self._world, None
        if world is not None:
            graceful = not world.failed
            world.failed = True  # the reader stops watching: exits from here on are not failures
            self._fail_pending(world.generation, "the worker pool is shutting down")
            world.stop(graceful=graceful)

    # Introspection (tests, logs).

    def worker_pids(self) -> list[int]:
        world = self._world
        return world.pids if world is not None else []

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def rows_per_group(self) -> list[int]:
        return list(self._rows_done)

    def workers_alive(self) -> int:
        """How many worker processes run (the service's packscore_workers_alive gauge)."""
        world = self._world
        if world is None or world.failed:
            return 0
        return sum(p.poll() is None for p in world.procs)

    def row_cost(self, lengths: Sequence[int]) -> float:
        lengths = np.asarray(lengths, dtype=np.float64)
        return float(self._costs[0] * lengths.sum() + self._costs[1] * (lengths**2).sum())

    # Starting and restarting.

    def _start_world(self) -> list[msg.Hello]:
        self._generation += 1
        world = _World(self._generation, self.dims, self._start_fields)
        hellos: dict[int, msg.Hello] = {}
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while len(hellos) < self.dims.world_size:
                ready = wait(world.replies, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                for conn in ready:
                    rank = world.replies.index(conn)
                    try:
                        reply = msg.decode(conn.recv_bytes())
                    except (EOFError, OSError):
                        raise BackendUnavailableError(f"worker rank {rank} exited while starting") from None
                    if isinstance(reply, msg.Failure):
                        raise BackendUnavailableError(f"worker rank {rank} failed to start: {reply.message}")
                    hellos[rank] = reply
                if time.monotonic() > deadline:
                    raise BackendUnavailableError(f"workers did not start within {self.start_timeout_s:.0f}s")
                if not world.all_running() and len(hellos) < self.dims.world_size and not ready:
                    raise BackendUnavailableError("a worker exited while starting")
            with self._lock:
                if self._closing:
                    raise BackendUnavailableError("the worker pool was closed while starting")
                self._world = world
        except BaseException:
            world.failed = True
            world.stop(graceful=False)
            raise
        threading.Thread(target=self._read_loop, args=(world,), name=f"pool-reader-{world.generation}", daemon=True).start()
        log.info("worker pool generation %d up: pids %s, layout %s", world.generation, world.pids, self.dims.as_info())
        return [hellos[r] for r in range(self.dims.world_size)]

    def _restart_loop(self) -> None:
        delay = 1.0
        while not self._closing:
            try:
                self._start_world()
                self.warm_up()
                self._alive = True
                self._restarts += 1
                log.info("worker pool restarted; a scoring pass succeeded")
                return
            except Exception:
                log.exception("worker pool restart failed; retrying in %.0fs", delay)
                with self._lock:
                    world, self._world = self._world, None
                if world is not None:
                    world.failed = True
                    world.stop(graceful=False)
                time.sleep(delay)
                delay = min(30.0, delay * 2)

    def _on_world_failure(self, world: _World, reason: str) -> None:
        with self._lock:
            if world.failed:
                return
            world.failed = True
            self._alive = False
        log.error("worker pool generation %d failed: %s; restarting", world.generation, reason)
        self._fail_pending(world.generation, f"a worker failed ({reason}); the pool is restarting")
        world.stop(graceful=False)
        if not self._closing:
            threading.Thread(target=self._restart_loop, name="pool-restart", daemon=True).start()

    def _fail_pending(self, generation: int, reason: str) -> None:
        with self._lock:
            doomed = [p for p in self._pending.values() if p.generation == generation]
        for p in doomed:
            p.settle(error=BackendUnavailableError(reason))

    # Replies.

    def _read_loop(self, world: _World) -> None:
        """Delivers leader replies; turns a closed pipe, an exited process or a stuck row into a failure."""
        while not world.failed and not self._closing:
            try:
                ready = wait(world.replies, timeout=0.2)
            except OSError:
                ready = []
                if world.failed or self._closing:
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
                self._on_world_failure(world, f"rows {late} took longer than {self.request_timeout_s:.0f}s")
                return

    def _deliver(self, world: _World, rank: int, reply) -> None:
        with self._lock:
            pending = self._pending.get(getattr(reply, "request_id", -1))
        if isinstance(reply, msg.RowResult) and pending is not None:
            pending.settle(reply=reply)
        elif isinstance(reply, msg.Failure):
            log.error("worker rank %d: request %d failed (%s): %s", rank, reply.request_id, reply.kind, reply.message)
            if pending is not None:
                pending.settle(error=_error_for(reply))
            if reply.fatal:
                self._on_world_failure(world, f"worker rank {rank} failed: {reply.message}")
        else:
            log.warning("worker rank %d sent an unexpected %s", rank, type(reply).__name__)

    # Dispatch.

    def _new_pending(self, world: _World) -> _Pending:
        with self._lock:
            p = _Pending(next(self._ids), world.generation, time.monotonic() + self.request_timeout_s)
            self._pending[p.request_id] = p
        return p

    def _await(self, pending: _Pending) -> msg.RowResult:
        try:
            # The reader settles every pending row on success, failure, a dead worker or the
            # deadline; the extra margin only guards against a reader that died itself.
            if not pending.done.wait(self.request_timeout_s + 30.0):
                raise BackendUnavailableError("no reply from the worker pool")
        finally:
            with self._lock:
                self._pending.pop(pending.request_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.reply

    def _run(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        if self.dims.lockstep:
            ticket: queue.Queue = queue.Queue(maxsize=1)
            self._steps.put((sequences, ticket))
            outcome = ticket.get()
            if isinstance(outcome, BaseException):
                raise outcome
            reply = outcome
        else:
            reply = self._run_on_free_group(sequences)
        return _split(sequences, reply)

    def _run_on_free_group(self, sequences: Sequence[SequenceInput]) -> msg.RowResult:
        world = self._world
        if world is None or world.failed:
            raise BackendUnavailableError("the worker pool is restarting after a worker failure")
        cost = self.row_cost([s.length for s in sequences])
        with self._lock:
            group = min(range(self.dims.dp), key=lambda g: self._lane_cost[g])
            self._lane_cost[group] += cost
            self._rows_done[group] += 1
        try:
            pending = self._new_pending(world)
            try:
                world.send_group(group, msg.encode(msg.ScoreRow.of(pending.request_id, sequences)))
            except OSError as error:
                pending.settle(error=BackendUnavailableError(f"cannot reach group {group}: {error}"))
            return self._await(pending)
        finally:
            with self._lock:
                self._lane_cost[group] -= cost

    def _step_loop(self) -> None:
        """FSDP lockstep: every step gives every group a row or a dummy, then waits for all replies."""
        while not self._closing:
            item = self._steps.get()
            if item is None:
                break
            batch = [item]
            while len(batch) < self.dims.dp:
                try:
                    extra = self._steps.get_nowait()
                except queue.Empty:
                    break
                if extra is None:
                    self._steps.put(None)  # seen by the outer loop after this step
                    break
                batch.append(extra)
            self._run_step(batch)
        while True:  # fail whatever is still queued at shutdown
            try:
                item = self._steps.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].put(BackendUnavailableError("the worker pool is shutting down"))

    def _run_step(self, batch: list) -> None:
        world = self._world
        if world is None or world.failed:
            for _, ticket in batch:
                ticket.put(BackendUnavailableError("the worker pool is restarting after a worker failure"))
            return
        pendings = [self._new_pending(world) for _ in range(self.dims.dp)]
        try:
            for group, pending in enumerate(pendings):
                if group < len(batch):
                    frame = msg.encode(msg.ScoreRow.of(pending.request_id, batch[group][0]))
                    self._rows_done[group] += 1
                else:
                    frame = msg.encode(msg.Idle(pending.request_id))
                world.send_group(group, frame)
        except OSError as error:
            for pending in pendings:
                pending.settle(error=BackendUnavailableError(f"cannot reach the workers: {error}"))
        for group, pending in enumerate(pendings):
            try:
                outcome = self._await(pending)
            except BaseException as error:  # delivered to the caller's thread
                outcome = error
            if group < len(batch):
                batch[group][1].put(outcome)


def _error_for(failure: msg.Failure) -> BaseException:
    if failure.kind == "oom":
        return torch.OutOfMemoryError(f"out of memory in a worker: {failure.message}")
    if failure.kind == "invalid":
        return InvalidSequenceError(failure.message, "sequences")
    return RuntimeError(f"worker failure: {failure.message}")


def _split(sequences: Sequence[SequenceInput], reply: msg.RowResult) -> list[SequenceScores]:
    k = reply.top_k
    head = HeadOutput(
        torch.from_numpy(msg._array(reply.logprobs, msg.FLOAT)),
        torch.from_numpy(msg._array(reply.entropy, msg.FLOAT)),
        torch.from_numpy(msg._array(reply.top_k_ids, msg.IDS).reshape(-1, k).astype(np.int64)) if k else None,
        torch.from_numpy(msg._array(reply.top_k_logprobs, msg.FLOAT).reshape(-1, k)) if k else None,
    )
    expected = sum(s.num_scored for s in sequences)
    if head.logprobs_N.shape[0] != expected:
        raise RuntimeError(f"worker returned {head.logprobs_N.shape[0]} positions for a row with {expected}")
    return split_results(sequences, head, k)


def start_pool(settings: dict) -> WorkerPool:
    """Starts ``settings["world_size"]`` workers and returns once every one has loaded the model.

    ``settings`` is the service's ``Settings.model_dump()``; the keys read are model, device, dtype,
    world_size, sp, fsdp, max_batch_tokens, allow_slow_kernels, served_model_name (and optionally
    worker_timeout_s, worker_start_timeout_s); other keys are ignored.
    """
    return WorkerPool(settings)
