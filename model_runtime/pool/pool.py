"""The multi-process worker pool: a ``ScoringBackend`` whose forwards run in ``world_size`` processes.

Layout: ``dp = world_size / sp`` data-parallel groups of ``sp`` ranks (see
``model_runtime.parallel``). One process per GPU on CUDA (NCCL), or CPU processes joined by gloo
with ``device="cpu"``. The HTTP process talks to each worker over two pipes carrying msgpack
frames with raw numpy buffers (``model_runtime.pool.messages``); nothing is pickled. The processes
themselves are launched and stopped by ``model_runtime.pool.procs``.

Scheduling:
- without FSDP the groups are independent: ``score_row`` sends the row to the group with the
  least outstanding estimated cost (``per_token * T + per_token_squared * sum(L_i ** 2)``), or to
  the group it is given (several served models: the GPUs no other model's forward holds);
- with FSDP every rank takes part in every layer's all-gather, so a stepper thread sends steps:
  up to ``dp`` queued rows at a time, one per group, and a dummy ``Idle`` row to groups left
  without one. While rows keep coming, a step waits up to ``STEP_GATHER_S`` for a row per group:
  the callers whose rows just finished resubmit a moment after the step ends, and a step that
  left without them would run one group while the others idle.
  The stepper is ``model_runtime.pool.lockstep``.
A group's row may hold ``sp * max_batch_tokens`` tokens (``max_row_tokens``): a sequence too long
for one GPU's budget fits a group whose ``sp`` ranks each hold a shard of it.

Weight updates (``update_weights``): every rank loads the new checkpoint beside the served weights
while rows keep running, then every rank swaps between the same two rows of its command stream
(with FSDP the stepper sends the swap between two steps, so every rank swaps at the same step and
each swaps its own shards). Each row's result names the version that scored it. A failure on any
rank drops what every rank loaded: nothing changes.

Failure: a worker that exits (its reply pipe closes) or a row that runs past its bound (ten times
what its group's measured rate says, at least 60 s; ``worker_timeout_s`` before any rate) fails
every in-flight row with ``BackendUnavailableError``; ``is_alive()`` turns False, the whole
world is killed and started again in the background, and ``is_alive()`` returns to True once a
scoring pass through the new world has succeeded.
"""

from __future__ import annotations

import itertools
import logging
import queue
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from model_runtime.parallel.dims import ParallelDims
from model_runtime.pool import messages as msg
from model_runtime.pool.loaded_files import LoadedFiles
from model_runtime.pool.lockstep import Lockstep
from model_runtime.pool.procs import WorkerWorld
from model_runtime.pool.replies import Pending, Swap, agreed_rounding, reply_error, split_reply
from model_runtime.scoring.backend import (STALL_FACTOR, STALL_FLOOR_S, STALL_UNMEASURED_S, BackendUnavailableError, ModelInfo,
                                          UpdateInProgressError, WeightsUpdate)
from model_runtime.scoring.checkpoint import CheckpointError
from model_runtime.scoring.rows import validate_sequence
from model_runtime.scoring.scorer import shared_prefix_row
from model_runtime.types import MAX_TOP_K
from model_runtime.types import InvalidSequenceError, SequenceInput, SequenceScores

log = logging.getLogger(__name__)


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


class WorkerPool(Lockstep):
    """``ScoringBackend`` over ``world_size`` worker processes. Build it with ``start_pool``."""

    def __init__(self, settings: dict):
        self.dims = ParallelDims.from_world(
            int(settings.get("world_size", 1) or 1), int(settings.get("sp", 1) or 1), bool(settings.get("fsdp", False))
        )
        self.max_batch_tokens = int(settings.get("max_batch_tokens", 16384))
        self.max_row_tokens = self.dims.row_token_budget(self.max_batch_tokens)
        self.concurrency = self.dims.dp
        self.request_timeout_s = float(settings.get("worker_timeout_s", STALL_UNMEASURED_S))
        self.stall_floor_s = float(settings.get("worker_stall_floor_s", STALL_FLOOR_S))
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
            kernels=dict(settings.get("kernels") or {}),  # family -> backend: Settings parsed --kernels
            served_model_name=str(settings.get("served_model_name") or ""),
            timeout_s=self.request_timeout_s,
            prefix_min_tokens=int(settings.get("prefix_min_tokens", 0)),  # 0: prefix sharing off
            weights_version="",
            updates=settings.get("weights_root") is not None,
            expert_gemm=str(settings.get("expert_gemm") or ""),
        )
        self._lock = threading.Lock()
        self._updating = threading.Lock()  # one weight update at a time
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._lane_cost = [0.0] * self.dims.dp  # estimated cost of the rows each group has in flight
        self._seconds_per_cost: float | None = None  # measured on rows sent to an idle group
        self._rows_done = [0] * self.dims.dp  # rows sent to each group (balance, for tests and logs)
        self._steps: queue.Queue = queue.Queue()
        self._last_step_end = float("-inf")
        self.step_counts = {"steps": 0, "rows": 0}  # lockstep occupancy (rows per step), for benchmarks
        self._world: WorkerWorld | None = None
        self._starting: WorkerWorld | None = None  # a world whose workers are loading (close() kills them)
        self._alive = False
        self._closing = False
        self._restarts = 0
        self._generation = 0
        self.restart_error: str | None = None  # why the last restart failed, while the pool is down
        self.prefix_rounding = None  # the workers' RowRounding (prefix sharing on a GPU, sp = 1)
        # What the workers loaded (its files' sizes and times, and its content hash): a restart
        # reloads from that directory and must not serve other files under the version naming these.
        self._loaded: LoadedFiles | None = None
        self._restarting = False  # one restart loop at a time
        if Path(self._start_fields["model"]).is_dir():  # its content hash, once here instead of once per rank
            from model_runtime.scoring.content_hash import START_HASH_THREADS, content_version
            from model_runtime.scoring.weights import files_snapshot

            path = Path(self._start_fields["model"])
            snapshot = files_snapshot(path)
            self._start_fields["weights_version"] = content_version(path, threads=START_HASH_THREADS)
            self._loaded = LoadedFiles(path, snapshot, self._start_fields["weights_version"])
        hellos = self._start_world()
        first = hellos[0]
        self._vocab_size = first.vocab_size
        self._costs = (first.cost_per_token, first.cost_per_token_squared)
        self.info = ModelInfo.from_fields(first, self.dims.as_info())
        self._alive = True
        if self.dims.lockstep:
            threading.Thread(target=self._step_loop, name="pool-stepper", daemon=True).start()

    # ScoringBackend.

    @property
    def pins_groups(self) -> bool:
        """Whether ``score_row`` runs a row on the group it names (not with FSDP: every rank takes every step)."""
        return not self.dims.lockstep

    def score_row(self, sequences: Sequence[SequenceInput], group: int | None = None) -> list[SequenceScores]:
        """``group``: the data-parallel group to run on (the GPUs another served model's forward
        leaves free), else the one with the least outstanding cost."""
        for i, seq in enumerate(sequences):
            validate_sequence(seq, self._vocab_size, i)
        if not sequences:
            raise InvalidSequenceError("a row needs at least one sequence", "sequences")
        if group is not None and not 0 <= group < self.dims.dp:  # -1 would count as the last and never be sent
            raise ValueError(f"group {group} is not one of this pool's {self.dims.dp} data-parallel groups")
        if not self._alive:
            raise BackendUnavailableError("the worker pool is restarting after a worker failure")
        return self._run(sequences, group)

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
            if self._start_fields["prefix_min_tokens"]:  # the kernels' variants with initial states
                rows.append(shared_prefix_row(rng, self._vocab_size, self._start_fields["prefix_min_tokens"]))
        for row in rows:
            self._run_on_every_group(row)

    def update_weights(self, path: Path, version: str | None = None) -> WeightsUpdate:
        """Every rank loads ``path`` beside its weights, then every rank swaps between the same two rows."""
        from model_runtime.scoring.content_hash import content_version
        from model_runtime.scoring.weights import checkpoint_changed, files_snapshot

        if not self._updating.acquire(blocking=False):
            raise UpdateInProgressError(f"an update of {self.info.name} is already running")
        try:
            started = time.perf_counter()
            world = self._world
            if world is None or world.failed or not self._alive:
                raise BackendUnavailableError("the worker pool is restarting after a worker failure")
            files = files_snapshot(Path(path))
            with ThreadPoolExecutor(1) as hasher:  # the content hash runs while the ranks read
                hashed = hasher.submit(content_version, Path(path)) if version is None else None
                load = self._new_pending(world, ranks=self.dims.world_size, timeout_s=self.start_timeout_s)
                self._send_all(world, load, msg.LoadWeights(load.request_id, str(path)))
                failed = [r for r in self._await(load) if not r.ok]
                try:
                    new_version, hash_error = version or hashed.result(), None
                except Exception as error:  # the ranks must still drop what they read
                    new_version, hash_error = "", error
            changed = checkpoint_changed(Path(path), files)  # then every rank drops what it read
            load_s = time.perf_counter() - started
            swap = self._new_pending(world, ranks=self.dims.world_size)
            commit = not failed and changed is None and hash_error is None
            frame = msg.encode(msg.SwapWeights(swap.request_id, load.request_id, commit, new_version))
            if self.dims.lockstep:
                self._steps.put(Swap(frame, swap))  # the stepper sends it between two steps
            else:
                self._send_all(world, swap, frame)
            swapped = self._await(swap)
            if failed:
                first = min(failed, key=lambda r: r.rank)
                if first.kind == "internal":
                    raise RuntimeError(f"worker rank {first.rank} could not load {path}: {first.message}")
                raise CheckpointError(first.kind, first.message)
            if hash_error is not None:
                raise hash_error
            if changed is not None:
                raise changed
            refused = [r for r in swapped if not r.ok]
            if refused:
                self._on_world_failure(world, f"worker rank {refused[0].rank} could not swap: {refused[0].message}")
                raise BackendUnavailableError(f"the weight swap failed on rank {refused[0].rank}; the pool is restarting")
            previous = self.info.weights_version
            self.info = replace(self.info, weights_version=new_version)
            # A restarted world loads what serves now; a named version's content is hashed after the
            # swap, for the restarts to check against.
            loaded = LoadedFiles(Path(path), files, None if version is not None else new_version)
            with self._lock:
                self._start_fields.update(model=str(path), weights_version=new_version, served_model_name=self.info.name)
                self._loaded = loaded
            if loaded.content is None:
                threading.Thread(target=loaded.hash, name="pool-content-hash", daemon=True).start()
            swap_ms = 1e3 * max(r.seconds for r in swapped)
            return WeightsUpdate(new_version, previous, load_s, swap_ms)
        finally:
            self._updating.release()

    def _send_all(self, world: WorkerWorld, pending: Pending, message) -> None:
        frame = message if isinstance(message, bytes) else msg.encode(message)
        try:
            world.send_every(frame)
        except OSError as error:
            pending.settle(error=BackendUnavailableError(f"cannot reach the workers: {error}"))

    def is_alive(self) -> bool:
        world = self._world
        return self._alive and world is not None and not world.failed and world.all_running()

    def close(self) -> None:
        self._closing = True
        self._alive = False
        self._steps.put(None)
        with self._lock:
            world, self._world = self._world, None
            # A worker mid-row (the drain timeout cut it off) reads Shutdown only once the row is
            # done: it is killed instead, so the exit keeps to the drain timeout.
            busy = world is not None and any(p.generation == world.generation for p in self._pending.values())
            graceful = world is not None and not world.failed and not busy
            if world is not None:
                world.failed = True  # the reader stops watching: exits from here on are not failures
            starting = self._starting
        if starting is not None:
            # A restart still loading (a worker failed during the drain): its workers must not outlive
            # the server; the starting thread sees them exit and cleans up.
            starting.kill()
        if world is not None:
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
        world = WorkerWorld(self._generation, self.dims, self._start_fields)
        with self._lock:
            self._starting = world
            closing = self._closing
        if closing:  # close() ran while the processes were launched: it did not see them
            world.kill()
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
                        if reply.kind.startswith("checkpoint:"):  # refused once its weights were read (NaN)
                            raise CheckpointError(reply.kind.removeprefix("checkpoint:"), reply.message)
                        # A layout the model cannot take (heads vs sp) is a configuration error.
                        kind = ValueError if reply.kind == "invalid" else BackendUnavailableError
                        raise kind(f"worker rank {rank} failed to start: {reply.message}")
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
        finally:
            with self._lock:
                self._starting = None
        threading.Thread(target=self._read_loop, args=(world,), name=f"pool-reader-{world.generation}", daemon=True).start()
        log.info("worker pool generation %d up: pids %s, layout %s", world.generation, world.pids, self.dims.as_info())
        ordered = [hellos[r] for r in range(self.dims.world_size)]
        self.prefix_rounding = agreed_rounding(ordered)
        return ordered

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
        delay = 1.0
        while not self._closing:
            try:
                self._check_checkpoint_unchanged()
                self._seconds_per_cost = None  # fresh processes: the warm-up compiles, and measures again
                self._start_world()
                self.warm_up()
                self._alive = True
                self._restarts += 1
                self.restart_error = None
                log.info("worker pool restarted; a scoring pass succeeded")
                return
            except Exception as error:
                self.restart_error = f"{error} (next attempt in {delay:.0f}s)"
                if isinstance(error, CheckpointError):
                    log.error("worker pool restart refused: %s; retrying in %.0fs", error, delay)
                else:
                    log.exception("worker pool restart failed; retrying in %.0fs", delay)
                with self._lock:
                    world, self._world = self._world, None
                    if world is not None:
                        world.failed = True
                if world is not None:
                    self._fail_pending(world.generation, "the worker pool failed to restart")
                    world.stop(graceful=False)
                time.sleep(delay)
                delay = min(30.0, delay * 2)

    def _on_world_failure(self, world: WorkerWorld, reason: str) -> None:
        with self._lock:
            if world.failed:
                return
            world.failed = True
            self._alive = False
            # A world failing while a restart loop warms it up: that loop starts another
            restart = not self._closing and not self._restarting
            self._restarting = self._restarting or restart
        log.error("worker pool generation %d failed: %s; restarting", world.generation, reason)
        self._fail_pending(world.generation, f"a worker failed ({reason}); the pool is restarting")
        world.stop(graceful=False)
        if restart:
            threading.Thread(target=self._restart_loop, name="pool-restart", daemon=True).start()

    def _fail_pending(self, generation: int, reason: str) -> None:
        with self._lock:
            doomed = [p for p in self._pending.values() if p.generation == generation]
        for p in doomed:
            p.settle(error=BackendUnavailableError(reason))

    # Replies.

    def _read_loop(self, world: WorkerWorld) -> None:
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
                self._on_world_failure(world, f"rows {late} ran past their time bound ({STALL_FACTOR:.0f}x what "
                                       "the measured rate says, at least the floor): a worker is stuck")
                return

    def _deliver(self, world: WorkerWorld, rank: int, reply) -> None:
        with self._lock:
            pending = self._pending.get(getattr(reply, "request_id", -1))
        if isinstance(reply, msg.RowResult) and pending is not None:
            pending.settle(reply=reply)
        elif isinstance(reply, msg.WeightsDone) and pending is not None:
            pending.add(reply)
        elif isinstance(reply, msg.Failure):
            log.error("worker rank %d: request %d failed (%s): %s", rank, reply.request_id, reply.kind, reply.message)
            if pending is not None:
                pending.settle(error=reply_error(reply))
            if reply.fatal:
                self._on_world_failure(world, f"worker rank {rank} failed: {reply.message}")
        else:
            log.warning("worker rank %d sent an unexpected %s", rank, type(reply).__name__)

    # Dispatch.

    def _new_pending(self, world: WorkerWorld, ranks: int = 1, timeout_s: float | None = None) -> Pending:
        """Registers a row for ``world``'s reply, or settles it at once when ``world`` has failed.

        ``world.failed`` is only set under ``_lock``, and ``_fail_pending`` collects the rows of
        that world under ``_lock`` after it was set: a row is either registered before (and failed
        by ``_fail_pending``) or sees the flag here. Registered later, no reader would ever
        settle it and its caller would wait out ``request_timeout_s``.
        """
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            p = Pending(next(self._ids), world.generation, time.monotonic() + timeout_s, ranks=ranks)
            if world.failed:
                p.settle(error=BackendUnavailableError("the worker pool is restarting after a worker failure"))
            else:
                self._pending[p.request_id] = p
        return p

    def _await(self, pending: Pending) -> msg.RowResult:
        try:
            # The reader settles every pending row on success, failure, a dead worker or the
            # deadline; the extra margin only guards against a reader that died itself.
            if not pending.done.wait(max(0.0, pending.deadline - time.monotonic()) + 30.0):
                raise BackendUnavailableError("no reply from the worker pool")
        finally:
            with self._lock:
                self._pending.pop(pending.request_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.reply

    def _run(self, sequences: Sequence[SequenceInput], group: int | None = None) -> list[SequenceScores]:
        if self.dims.lockstep:
            return self._run_in_steps([sequences])[0]
        return split_reply(sequences, self._run_on_group(sequences, group))

    def _run_on_every_group(self, sequences: Sequence[SequenceInput]) -> None:
        """Scores ``sequences`` once on each group (warm-up and the pass after a restart)."""
        if self.dims.lockstep:
            self._run_in_steps([sequences] * self.dims.dp)
            return
        errors: list[BaseException] = []

        def one(group: int) -> None:
            try:
                split_reply(sequences, self._run_on_group(sequences, group))
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=one, args=(g,), name=f"pool-warm-up-{g}") for g in range(self.dims.dp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _run_on_group(self, sequences: Sequence[SequenceInput], group: int | None) -> msg.RowResult:
        """Sends a row to ``group``, or (None) to the group with the least in-flight estimated cost."""
        world = self._world
        if world is None or world.failed:
            raise BackendUnavailableError("the worker pool is restarting after a worker failure")
        cost = self.row_cost([s.length for s in sequences])
        with self._lock:
            if group is None:
                group = min(range(self.dims.dp), key=lambda g: self._lane_cost[g])
            alone = self._lane_cost[group] == 0
            self._lane_cost[group] += cost
            self._rows_done[group] += 1
            timeout_s = self._row_timeout_s(self._lane_cost[group])
        try:
            started = time.monotonic()
            pending = self._new_pending(world, timeout_s=timeout_s)
            try:
                if not pending.done.is_set():
                    world.send_group(group, msg.encode(msg.ScoreRow.of(pending.request_id, sequences)))
            except OSError as error:
                pending.settle(error=BackendUnavailableError(f"cannot reach group {group}: {error}"))
            reply = self._await(pending)
            if alone:  # a row that waited behind none measures the group's rate
                self._measure_rate(cost, time.monotonic() - started)
            return reply
        finally:
            with self._lock:
                self._lane_cost[group] -= cost

    def _measure_rate(self, cost: float, seconds: float) -> None:
        """Folds a row's (or a step's) time into the seconds per unit of estimated cost."""
        if cost <= 0:
            return
        with self._lock:
            rate = seconds / cost
            self._seconds_per_cost = rate if self._seconds_per_cost is None else 0.7 * self._seconds_per_cost + 0.3 * rate

    def _row_timeout_s(self, cost_ahead: float) -> float:
        """How long a row may take before its world counts as stuck (a stopped worker, a hung GPU)
        and is restarted, failing its rows with 503: ``STALL_FACTOR`` times what the group's rows
        ahead of it and its own should take at the measured rate, at least ``stall_floor_s``;
        ``worker_timeout_s`` before any rate is measured. Call under ``_lock``."""
        if self._seconds_per_cost is None:
            return self.request_timeout_s
        return min(self.request_timeout_s, max(self.stall_floor_s, STALL_FACTOR * cost_ahead * self._seconds_per_cost))



def start_pool(settings: dict) -> WorkerPool:
    """Starts ``settings["world_size"]`` workers and returns once every one has loaded the model.

    ``settings`` is the service's ``Settings.model_dump()``; the keys read are model, device, dtype,
    world_size, sp, fsdp, max_batch_tokens, allow_slow_kernels, kernels (family -> backend), served_model_name (and optionally
    expert_gemm, worker_timeout_s, worker_stall_floor_s, worker_start_timeout_s, weights_root (set: updates may come, so the workers
    make their staging buffers at start), and prefix_min_tokens: the shortest shared prefix run once,
    0 or absent for none, i.e. ``Settings.prefix_min_tokens_in_use``); other keys are ignored.
    """
    return WorkerPool(settings)
