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
rank drops what every rank loaded: nothing changes. The updates are ``model_runtime.pool.updates``.

Failure: a worker that exits (its reply pipe closes) or a row that runs past its bound (ten times
what its group's measured rate says, at least 60 s; ``worker_timeout_s`` before any rate) fails
every in-flight row with ``BackendUnavailableError``; ``is_alive()`` turns False, the whole
world is killed and started again in the background, and ``is_alive()`` returns to True once a
scoring pass through the new world has succeeded (a restart whose thread the process's thread limit
refused is tried again by the next ``is_alive()`` or ``score_row``, after a pause of 1 s doubling
to 30 s). A worker lost while the start's world forms has
that world formed again after a short pause, a few times at most; an error a worker reports while
loading fails the start. Starting, watching and restarting worlds is ``model_runtime.pool.supervisor``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from model_runtime.parallel.dims import ParallelDims
from model_runtime.pool import messages as msg
from model_runtime.pool.loaded_files import LoadedFiles
from model_runtime.pool.lockstep import Lockstep
from model_runtime.pool.procs import WorkerWorld
from model_runtime.pool.replies import Pending, split_reply
from model_runtime.pool.supervisor import Supervisor
from model_runtime.pool.updates import WeightUpdates
from model_runtime.scoring.backend import STALL_FACTOR, STALL_FLOOR_S, STALL_UNMEASURED_S, BackendUnavailableError, ModelInfo
from model_runtime.scoring.rows import validate_sequence
from model_runtime.scoring.scorer import shared_prefix_row
from model_runtime.types import MAX_TOP_K
from model_runtime.types import InvalidSequenceError, SequenceInput, SequenceScores

log = logging.getLogger(__name__)

# Past the join bound, torch's rendezvous bound: the launch's spread over the ranks and the pool's polling.
RENDEZVOUS_MARGIN_S = 30.0


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


class WorkerPool(Supervisor, WeightUpdates, Lockstep):
    """``ScoringBackend`` over ``world_size`` worker processes. Build it with ``start_pool`` (or build
    it, then ``start()`` it, where another thread may have to ``close()`` it while it starts)."""

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
        # Launch to process group formed, before any loading: imports and CUDA's start take seconds.
        self.join_timeout_s = float(settings.get("worker_join_timeout_s", 300.0))
        # torch's own bound on the rendezvous (the store's, the process group's) ends past the join
        # bound, whichever is set higher: the start then fails naming the rank that never came.
        group_timeout_s = max(self.request_timeout_s, self.join_timeout_s + RENDEZVOUS_MARGIN_S)
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
            timeout_s=group_timeout_s,
            prefix_min_tokens=int(settings.get("prefix_min_tokens", 0)),  # 0: prefix sharing off
            weights_version="",
            updates=settings.get("weights_root") is not None,
            expert_gemm=str(settings.get("expert_gemm") or ""),
            log_level=str(settings.get("log_level") or "info"),
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
        self._closed = threading.Event()  # set by close(): a wait on it (a pause, a backoff) ends at once
        self._restarts = 0
        self._generation = 0
        self.restart_error: str | None = None  # why the last restart failed, while the pool is down
        self.prefix_rounding = None  # the workers' RowRounding (prefix sharing on a GPU, sp = 1)
        # What the workers loaded (its files' sizes and times, and its content hash): a restart
        # reloads from that directory and must not serve other files under the version naming these.
        self._loaded: LoadedFiles | None = None
        self._restarting = False  # one restart loop at a time
        self._restart_thread: threading.Thread | None = None  # the last restart loop (close() waits for it)
        # (when a use of the pool may try again, the pause) after the thread limit refused the restart loop's thread
        self._restart_refused: tuple[float, float] | None = None
        self._restart_next: float | None = None  # when the restart loop tries again after its last failed attempt
        self._readers: list[threading.Thread] = []  # the worlds' reply readers still running (close() waits for them)
        self._hashes: list[threading.Thread] = []  # the updates' hashes for restarts still running (close() stops them)

    def start(self) -> None:
        """Launches the first world and returns once every rank loaded the model. ``close()`` from
        another thread meanwhile kills the loading workers, and this raises."""
        if Path(self._start_fields["model"]).is_dir():  # its content hash, once here instead of once per rank
            from model_runtime.scoring.content_hash import START_HASH_THREADS, content_version
            from model_runtime.scoring.weights import files_snapshot

            path = Path(self._start_fields["model"])
            snapshot = files_snapshot(path)
            self._start_fields["weights_version"] = content_version(path, threads=START_HASH_THREADS)
            self._loaded = LoadedFiles(path, snapshot, self._start_fields["weights_version"])
        hellos = self._start_first_world()
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
            self._retry_refused_restart()
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

    def _send_all(self, world: WorkerWorld, pending: Pending, message) -> None:
        frame = message if isinstance(message, bytes) else msg.encode(message)
        try:
            world.send_every(frame)
        except OSError as error:
            pending.settle(error=BackendUnavailableError(f"cannot reach the workers: {error}"))

    def is_alive(self) -> bool:
        world = self._world
        alive = self._alive and world is not None and not world.failed and world.all_running()
        if not alive:  # the service asks before each submit and each readiness check
            self._retry_refused_restart()
        return alive

    def close(self) -> None:
        self._closed.set()
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
            # A world still loading (the start's, or a restart's after a worker failed during the drain):
            # its workers must not outlive the server, which may exit right after this returns; the
            # starting thread sees them exit and cleans up.
            starting.kill()
            starting.wait_exited(5.0)
        if world is not None:
            self._fail_pending(world.generation, "the worker pool is shutting down")
            world.stop(graceful=graceful)
        self._join_threads(5.0)

    def _join_threads(self, timeout_s: float) -> None:
        """Waits, ``timeout_s`` in all, for the readers, the hashes for restarts and the restart loop:
        their worlds are killed and the hashes are stopped (``_closed``), so they end in a moment. A daemon
        thread still writing a log line (a worker's failure, a failed hash, the restart's end) while the
        server's interpreter finalises aborts it ("could not acquire lock for <stderr>")."""
        deadline = time.monotonic() + timeout_s

        def join(thread: threading.Thread | None) -> None:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

        with self._lock:
            first = [*self._readers, *self._hashes]
        for thread in first:
            join(thread)
        with self._lock:  # read after the readers are done: one may be starting it
            restart = self._restart_thread
        join(restart)

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



def start_pool(settings: dict, starting: Callable[[WorkerPool], None] | None = None) -> WorkerPool:
    """Starts ``settings["world_size"]`` workers and returns once every one has loaded the model.

    ``settings`` is the service's ``Settings.model_dump()``; the keys read are model, device, dtype,
    world_size, sp, fsdp, max_batch_tokens, allow_slow_kernels, kernels (family -> backend),
    served_model_name (and optionally expert_gemm, log_level, worker_timeout_s, worker_stall_floor_s,
    worker_start_timeout_s, worker_join_timeout_s, weights_root (set: updates may come, so the
    workers make their staging buffers at start), and prefix_min_tokens: the shortest shared prefix
    run once, 0 or absent for none, i.e. ``Settings.prefix_min_tokens_in_use``); other keys are ignored.
    ``starting(pool)`` is called before any worker launches: ``pool.close()`` from then on, from any
    thread, kills the workers still loading and this raises.
    """
    pool = WorkerPool(settings)
    if starting is not None:
        starting(pool)
    pool.start()
    return pool
