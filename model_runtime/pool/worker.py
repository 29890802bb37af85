"""One rank of the worker pool, run in its own process by ``model_runtime.pool.worker_main``.

Started by ``model_runtime.pool.pool.WorkerPool`` with two inherited pipe descriptors (commands
in, replies out). It reads a ``Start`` message, joins the process group on 127.0.0.1 (saying
``Joining`` and ``Joined`` around the rendezvous), loads and parallelizes the model, says ``Hello``,
then runs the ``ScoreRow`` / ``Idle`` steps it is sent, in order, until ``Shutdown`` or until its
command pipe closes. Only msgpack frames of ``model_runtime.pool.messages`` are read from the pipe.

A weight update reads the new checkpoint in a background thread while steps go on
(``LoadWeights``) and swaps it in when told (``SwapWeights``), between two steps. With FSDP a
checkpoint is read shard by shard, at start as for updates: each rank reads only the bytes of its
own shards, so a host holds one copy of the weights, not one per rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from model_runtime.pool import messages as msg

log = logging.getLogger("packscore.worker")


class _Replies:
    """The reply pipe; sends are serialised (the main loop and the failure path share it)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message) -> None:
        with self.lock:
            self.conn.send_bytes(msg.encode(message))


def _reads_shards(start: msg.Start) -> bool:
    """FSDP over a checkpoint: every rank builds the model empty and reads only its own shards."""
    from model_runtime.scoring.presets import PRESETS

    return start.fsdp and start.model not in PRESETS


def _load(start: msg.Start, device: torch.device):
    from model_runtime.scoring.loading import load_model

    options = dict(
        dtype=start.dtype,
        allow_slow_kernels=start.allow_slow_kernels,
        kernel_overrides=start.kernels,  # checked where --kernels was parsed; select_backends checks it can run here
        expert_gemm=start.expert_gemm or None,
        served_name=start.served_model_name or None,
        worker_pool=True,
        weights_version=start.weights_version or None,
    )
    if _reads_shards(start):
        return load_model(start.model, device=device, weights_later=True, **options)
    # A preset (random weights drawn whole) that does not fit one GPU must not be built whole onto
    # one: with FSDP it is built on the CPU with the GPU's kernels, and fully_shard moves each
    # rank's shards.
    on_host = device.type == "cuda" and start.fsdp and not _fits_on_gpu(start, device)
    return load_model(start.model, device="cpu" if on_host else device, kernel_device=device, **options)


# Share of the free GPU memory that whole weights may take before sharding: the rest is left
# for the all-gather buffers and the activations of the warm-up.
GPU_LOAD_FRACTION = 0.7


def _fits_on_gpu(start: msg.Start, device: torch.device) -> bool:
    from model_runtime.scoring.loading import estimated_weight_bytes, resolve_dtype

    free, _ = torch.cuda.mem_get_info(device)
    need = estimated_weight_bytes(start.model, resolve_dtype(start.dtype, device))
    fits = need <= GPU_LOAD_FRACTION * free
    log.info("weights %.1f GiB, GPU free %.1f GiB: loading %s before sharding", need / 2**30, free / 2**30,
             "on the GPU" if fits else "on the CPU")
    return fits


def _setup(start: msg.Start, replies: _Replies):
    from model_runtime.parallel.dims import ParallelDims
    from model_runtime.parallel.parallelize import parallelize
    from model_runtime.parallel.runner import ParallelScorer, cost_coefficients
    from model_runtime.scoring.backend import ModelInfo

    dims = ParallelDims.from_world(start.world_size, start.sp, start.fsdp)
    if start.device == "cuda":
        torch.cuda.set_device(start.rank)
        device, backend = torch.device("cuda", start.rank), "nccl"
    else:
        # One intra-op thread per rank: the ranks share the machine's cores.
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    # Where a start that hangs waits (a peer that never joined), and when a rank's loading began.
    log.info("pid %d joining generation %d's process group on 127.0.0.1:%d", os.getpid(), start.generation, start.master_port)
    # The pool bounds the rendezvous by these two, apart from the loading that follows.
    replies.send(msg.Joining(rank=start.rank))
    timeout = timedelta(seconds=start.timeout_s)
    # Rank 0 serves the store on the socket the pool bound: the port cannot be taken before it listens.
    store = dist.TCPStore("127.0.0.1", start.master_port, start.world_size, is_master=start.rank == 0, timeout=timeout,
                          master_listen_fd=start.master_listen_fd if start.rank == 0 else None)
    dist.init_process_group(backend, store=store, rank=start.rank, world_size=start.world_size, timeout=timeout)
    replies.send(msg.Joined(rank=start.rank))
    mesh = dims.build_mesh(device.type)
    loaded = _load(start, device)
    costs = cost_coefficients(loaded)  # before sharding: it counts whole parameters
    rounding = _prefix_rounding(start, dims, loaded, device)
    _narrow_runs(start, loaded, device)  # from the weights' shapes, before sharding
    parallelize(loaded.model, dims=dims, mesh=mesh)
    if _reads_shards(start):
        _read_shards(loaded, Path(start.model), device)
    if start.updates and device.type == "cuda":  # made now, not in the first update beside the forwards
        from model_runtime.scoring.tensor_file import staging_for

        staging_for(device)
    runner = ParallelScorer(
        loaded, dims=dims, mesh=mesh, rank=start.rank, max_batch_tokens=start.max_batch_tokens,
        prefix_min_tokens=start.prefix_min_tokens, prefix_rounding=rounding,
    )
    info = replace(ModelInfo.of(loaded), device=device.type, weights_version=start.weights_version or loaded.weights_version,
                   kernels=loaded.kernel_names, slow_kernels=list(loaded.slow_kernels))
    hello = msg.Hello(
        rank=start.rank,
        generation=start.generation,
        pid=os.getpid(),
        **{k: v for k, v in asdict(info).items() if k != "parallel"},
        cost_per_token=costs[0],
        cost_per_token_squared=costs[1],
        prefix_max_rows=rounding.max_rows if rounding is not None else 0,
        prefix_runs=rounding.runs if rounding is not None else [],
    )
    return dims, runner, hello


def _read_shards(loaded, path: Path, device: torch.device) -> None:
    """FSDP over a checkpoint: this rank reads its own shards into the model built empty (the "loaded" line came
    before: minutes of a large checkpoint's reading), saying when it begins, still every 30 s, and when it ended."""
    from model_runtime.scoring.weights import held_parameters, local_tensor, materialize
    from model_runtime.still_lines import saying_still

    size = sum(local_tensor(p).nbytes for p in held_parameters(loaded.model).values())
    log.info("reading its shards of %s from %s: %.1f GiB, as %s on %s", loaded.name, path, size / 2**30,
             loaded.dtype_name, device)
    started = time.perf_counter()
    with saying_still(log, f"reading its shards of {loaded.name}"):
        materialize(loaded.model, path, device)
    log.info("read its shards of %s in %.1fs", loaded.name, time.perf_counter() - started)


def _prefix_rounding(start: msg.Start, dims, loaded, device: torch.device):
    """With prefix sharing on a GPU and whole sequences on each rank (sp = 1): where the narrow
    products round by row count, as one process measures it (``Scorer.measure_prefix_rounding``).
    Under sequence parallelism they run per local segment, which the table does not describe;
    groups then share among every member. Seconds on a real model: says when it begins, still every 30 s,
    and when it ended, as the shard read does."""
    if not start.prefix_min_tokens or device.type != "cuda" or dims.sp > 1:
        return None
    from model_runtime.scoring.rounding import MAX_PROBED_ROWS, measure
    from model_runtime.still_lines import saying_still

    log.info("measuring the prefix rounding of %s on %s: which lengths share a prompt bit for bit, up to %d rows",
             loaded.name, device, min(start.max_batch_tokens, MAX_PROBED_ROWS))
    started = time.perf_counter()
    with saying_still(log, f"measuring the prefix rounding of {loaded.name}"):
        rounding = measure(loaded.model, start.max_batch_tokens, device=device)
    log.info("measured the prefix rounding of %s in %.1fs: %d kinds of length", loaded.name,
             time.perf_counter() - started, rounding.kind_count)
    return rounding


def _narrow_runs(start: msg.Start, loaded, device: torch.device) -> None:
    """With the ``runs`` backend on a GPU (the default): how many rows one narrow product may span
    (``rounding.runs_in_use``), handed to the model's layers. Seconds on a real model where the prefix
    rounding did not measure the same tables just before (``--sp`` > 1, sharing off, a cold cache): says
    when it begins, still every 30 s, and when it ended, as the prefix rounding does."""
    from model_runtime.scoring.rounding import MAX_PROBED_ROWS, measures_runs, runs_in_use
    from model_runtime.still_lines import saying_still

    if not measures_runs(loaded, device):
        return
    log.info("measuring the narrow products' runs of %s on %s: how many rows one product may span, up to %d rows",
             loaded.name, device, min(start.max_batch_tokens, MAX_PROBED_ROWS))
    started = time.perf_counter()
    with saying_still(log, f"measuring the narrow products' runs of {loaded.name}"):
        runs = runs_in_use(loaded, start.max_batch_tokens, device=device)
    log.info("measured the narrow products' runs of %s in %.1fs: %d of %d products span several segments",
             loaded.name, time.perf_counter() - started, sum(rows >= 2 for rows in runs.values()), len(runs))


class _WeightUpdates:
    """This rank's side of weight updates: a background load beside the served weights, the swap."""

    def __init__(self, loaded, rank: int, replies: _Replies, version: str):
        from model_runtime.scoring.weights import held_parameters

        self.loaded, self.model, self.rank, self.replies = loaded, loaded.model, rank, replies
        # Taken before any forward: the loading thread runs beside FSDP forwards, during which
        # the modules hold gathered whole parameters instead of this rank's shards.
        self.params = held_parameters(self.model)
        self.version = version  # what the rows scored here are scored by
        self._thread: threading.Thread | None = None
        self._staged: tuple[int, dict] | None = None  # (request id, new tensors)

    def _done(self, request_id: int, started: float, ok: bool = True, kind: str = "", message: str = "") -> None:
        seconds = time.perf_counter() - started
        self.replies.send(msg.WeightsDone(request_id, self.rank, ok, kind, message, seconds))

    def load(self, message: msg.LoadWeights) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._done(message.request_id, time.perf_counter(), False, "internal", "a weight load is already running")
            return
        self._staged = None
        self._thread = threading.Thread(target=self._load, args=(message,), name="weights-load", daemon=True)
        self._thread.start()

    def _load(self, message: msg.LoadWeights) -> None:
        """Reads the update beside the served weights, saying when this rank's read begins, still every 30 s, and
        when it ended; the server's lines name the update's version (a hash is known only once the read ends)."""
        from model_runtime.scoring.checkpoint_error import CheckpointError
        from model_runtime.scoring.weights import local_tensor, plan_reads, read_parameters
        from model_runtime.still_lines import saying_still

        name = self.loaded.name
        size = sum(local_tensor(p).nbytes for p in self.params.values())
        log.info("reading the update of %s from %s: %.1f GiB, as %s on %s", name, message.path, size / 2**30,
                 self.loaded.dtype_name, self.loaded.device)
        started = time.perf_counter()
        try:
            with saying_still(log, f"reading the update of {name}"), self._saying_progress(message.request_id) as count:
                plan = plan_reads(self.model, Path(message.path), self.params)
                tensors = read_parameters(self.model, plan, params=self.params, progress=count)
        except CheckpointError as error:  # the server's line says why
            log.info("stopped reading the update of %s after %.1fs: the checkpoint was refused (%s)", name,
                     time.perf_counter() - started, error.kind)
            self._done(message.request_id, started, False, error.kind, str(error))
            return
        except Exception as error:
            log.exception("reading the update of %s from %s failed", name, message.path)
            self._done(message.request_id, started, False, "internal", f"{type(error).__name__}: {error}")
            return
        self._staged = (message.request_id, tensors)
        log.info("read the update of %s in %.1fs", name, time.perf_counter() - started)
        self._done(message.request_id, started)

    @contextlib.contextmanager
    def _saying_progress(self, request_id: int) -> Iterator[Callable[[int], None]]:
        """Sends ``LoadProgress`` (this rank's bytes read so far) every ``LOAD_TICK_S`` while the block
        reads, none once it ended: the pool counts a rank that falls silent, or stops reading, as stuck."""
        read, counting, ended = [0], threading.Lock(), threading.Event()

        def count(nbytes: int) -> None:  # from the reading threads
            with counting:
                read[0] += nbytes

        def tick() -> None:
            while not ended.wait(msg.LOAD_TICK_S):
                try:
                    self.replies.send(msg.LoadProgress(request_id, self.rank, read[0]))
                except OSError:  # the pool is gone: the command loop exits on its closed pipe
                    return

        ticker = threading.Thread(target=tick, name="weights-progress", daemon=True)
        ticker.start()  # the thread limit's RuntimeError fails the load, as a read's error does
        try:
            yield count
        finally:
            ended.set()
            ticker.join()  # no LoadProgress after this rank's WeightsDone

    def swap(self, message: msg.SwapWeights) -> None:
        """Between two steps: serve the loaded weights (commit) or drop them."""
        from model_runtime.scoring.weights import swap_parameters

        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        staged, self._staged = self._staged, None
        if message.commit:
            if staged is None or staged[0] != message.load_id:
                self._done(message.request_id, started, False, "internal", f"no weights loaded for update {message.load_id}")
                return
            swap_parameters(self.model, staged[1])
            self.version = message.version
        del staged
        self._done(message.request_id, started)


def _result(request_id: int, head, top_k: int, version: str) -> msg.RowResult:
    to_np = lambda t: np.zeros(0) if t is None else t.numpy()  # noqa: E731
    return msg.RowResult(
        request_id=request_id,
        top_k=top_k,
        logprobs=to_np(head.logprobs_N).astype(msg.FLOAT).tobytes(),
        entropy=to_np(head.entropy_N).astype(msg.FLOAT).tobytes(),
        top_k_ids=to_np(head.top_k_ids_NK).astype(msg.IDS).tobytes(),
        top_k_logprobs=to_np(head.top_k_logprobs_NK).astype(msg.FLOAT).tobytes(),
        weights_version=version,
    )


def _empty_result(request_id: int, version: str) -> msg.RowResult:
    return msg.RowResult(
        request_id=request_id, top_k=0, logprobs=b"", entropy=b"", top_k_ids=b"", top_k_logprobs=b"", weights_version=version
    )


def _collective_broke(error: BaseException) -> bool:
    """Whether a collective failed in its transport, as a peer's death fails it: torch's ``DistError``
    (NCCL's ``DistBackendError``) or gloo's ``RuntimeError`` from its TCP pair ("Connection reset by peer")."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo/transport/" in str(error))


def _failure_kind(error: BaseException) -> str:
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return "oom"
    if isinstance(error, ValueError):
        return "invalid"
    return "internal"


def serve(commands: Connection, replies: _Replies) -> int:
    start = msg.decode(commands.recv_bytes())
    if not isinstance(start, msg.Start):
        raise ValueError(f"expected a Start message first, got {type(start).__name__}")
    logging.basicConfig(
        # the server's LOG_FORMAT, the rank where a request's line names its id: one format on the shared stream
        level=start.log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s: rank={start.rank} %(message)s", force=True
    )
    try:
        dims, runner, hello = _setup(start, replies)
    except Exception as error:
        from model_runtime.scoring.checkpoint_error import CheckpointError

        if isinstance(error, CheckpointError):  # the server refuses it as it would in one process
            log.error("refused the checkpoint: %s", error)  # the format names the rank
            kind, message = f"checkpoint:{error.kind}", str(error)
        else:
            log.exception("failed to start")
            kind, message = _failure_kind(error), f"{type(error).__name__}: {error}"
        replies.send(msg.Failure(request_id=-1, kind=kind, message=message, fatal=True))
        return 1
    replies.send(hello)
    updates = _WeightUpdates(runner.loaded, start.rank, replies, hello.weights_version)
    leader = dims.sp_rank(start.rank) == 0
    # With collectives in a step (Ulysses inside the group, FSDP across the world), a rank that
    # failed mid-forward leaves its peers waiting: the pool restarts the world instead.
    fatal_on_error = dims.sp > 1 or dims.lockstep
    while True:
        try:
            frame = commands.recv_bytes()
        except (EOFError, OSError):
            log.info("command pipe closed; exiting")
            return 0
        message = msg.decode(frame)
        if isinstance(message, msg.Shutdown):
            return 0
        if isinstance(message, msg.LoadWeights):
            updates.load(message)
            continue
        if isinstance(message, msg.SwapWeights):
            updates.swap(message)
            continue
        try:
            if isinstance(message, msg.ScoreRow):
                head, top_k = runner.score_row_flat(message.sequences())
                reply = _result(message.request_id, head, top_k, updates.version)
            elif isinstance(message, msg.Idle):
                runner.idle_step()
                reply = _empty_result(message.request_id, updates.version)
            else:
                raise ValueError(f"unexpected {type(message).__name__} message in the step loop")
        except Exception as error:
            if fatal_on_error and _collective_broke(error):
                # A peer lost mid-step (SIGKILL, the OOM killer): the server names that loss; no traceback of ours.
                log.warning("request %s stopped: a collective broke, a peer is lost (%s: %s)",
                            getattr(message, "request_id", "?"), type(error).__name__, error)
            else:
                log.exception("request %s failed", getattr(message, "request_id", "?"))
            replies.send(
                msg.Failure(
                    request_id=getattr(message, "request_id", -1),
                    kind=_failure_kind(error),
                    message=f"{type(error).__name__}: {error}",
                    fatal=fatal_on_error,
                )
            )
            if fatal_on_error:
                return 1
            continue
        if leader:
            replies.send(reply)


def run(recv_fd: int, send_fd: int) -> None:
    """Serves the pool over the inherited pipes, then ends the process with ``serve``'s code."""
    from model_runtime.scoring.backend import favour_forward_threads

    favour_forward_threads()  # a weight update reads beside the forwards
    commands = Connection(recv_fd, writable=False)
    replies = _Replies(Connection(send_fd, readable=False))
    code = serve(commands, replies)
    # Skip interpreter teardown: destroying a process group whose peers are gone can block.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
