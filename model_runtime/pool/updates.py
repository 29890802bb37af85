"""Weight updates of the worker pool: every rank loads beside the served weights, then all swap.

``update_weights`` sends ``LoadWeights`` to every rank while rows keep running, hashes the new
checkpoint meanwhile (unless a version is named), and then has every rank swap (or drop what it
read) between the same two rows of its command stream; with FSDP the stepper sends the swap
between two steps (``replies.Swap``). ``WeightUpdates`` is a part of ``pool.WorkerPool``: it uses
the pool's ``info``, ``dims``, ``_world``, ``_alive``, ``_steps`` queue, ``_start_fields``,
``_loaded``, ``_updating``, ``_hashes``, ``_closed``, ``_lock``, ``start_timeout_s``, ``stall_floor_s``,
``request_timeout_s``, ``_send_all``, ``_new_pending``, ``_await`` and ``_on_world_failure``.

While the ranks read, each says how far it got every ``LOAD_TICK_S``; the reader counts a rank silent past
the stall floor, or one whose bytes stop growing past ``worker_timeout_s``, as stuck (``_stuck_load``):
the world restarts, as for a stalled row, with the weights before the update, which fails with 503.

``info`` (the version every answer names) and ``_start_fields`` (what a restart launches) change
together under ``_lock``, where ``world.failed`` is marked: a world lost after its ranks swapped but
before then restarts with the weights before the update, which fails with ``BackendUnavailableError``
(503) and leaves their version serving.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from model_runtime.pool import messages as msg
from model_runtime.pool.loaded_files import LoadedFiles
from model_runtime.pool.replies import Swap
from model_runtime.scoring.backend import BackendUnavailableError, UpdateInProgressError, WeightsUpdate
from model_runtime.scoring.checkpoint_error import CheckpointError

log = logging.getLogger(__name__)


class WeightUpdates:
    """The pool's weight updates (see the module docstring)."""

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
            halt = threading.Event()  # set when the world fails meanwhile: no one waits for the hash
            with ThreadPoolExecutor(1) as hasher:  # the content hash runs while the ranks read
                hashed = hasher.submit(content_version, Path(path), halt=halt) if version is None else None
                load = self._new_pending(world, ranks=self.dims.world_size, timeout_s=self.start_timeout_s)
                sent = time.monotonic()
                load.progress = {rank: (sent, sent, 0) for rank in range(self.dims.world_size)}
                self._send_all(world, load, msg.LoadWeights(load.request_id, str(path)))
                try:
                    failed = [r for r in self._await(load) if not r.ok]
                except BackendUnavailableError as error:  # the world failed as the ranks read: none swapped
                    halt.set()
                    if self._closed.is_set() or not world.failed:  # shutting down, or no restart to promise
                        raise
                    raise BackendUnavailableError(
                        f"{error}; the update changed nothing: the pool comes back with the weights of version "
                        f"{self.info.weights_version!r}, send the update again once it is ready") from None
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
            # A restarted world loads what serves now; a named version's content is hashed after the
            # swap, for the restarts to check against.
            loaded = LoadedFiles(Path(path), files, None if version is not None else new_version)
            with self._lock:  # one step with the failure marking: a restart launches what the version names
                lost = world.failed
                if not lost:
                    self.info = replace(self.info, weights_version=new_version)
                    self._start_fields.update(model=str(path), weights_version=new_version, served_model_name=self.info.name)
                    self._loaded = loaded
            if lost:  # its restart launches the weights before the update: they keep their version
                raise BackendUnavailableError(
                    "the worker pool is shutting down" if self._closed.is_set() else
                    f"a worker failed as the ranks swapped to {new_version!r}; the pool is restarting with the weights "
                    f"of version {previous!r}: send the update again")
            if loaded.content is None:
                self._hash_for_restarts(loaded)
            swap_ms = 1e3 * max(r.seconds for r in swapped)
            return WeightsUpdate(new_version, previous, load_s, swap_ms)
        finally:
            self._updating.release()

    def _stuck_load(self, world, now: float) -> str | None:
        """Why a weights load of ``world`` counts as stuck, naming the rank (None while none is): a rank not
        yet done that said nothing for the stall floor (it says ``LoadProgress`` every ``LOAD_TICK_S``: a
        stopped or frozen process), or whose bytes read did not grow for ``worker_timeout_s`` (the forward's
        bound before any rate: a hung GPU or disk). Progress, not the load's length: a slow read goes on."""
        with self._lock:
            loads = [p for p in self._pending.values() if p.generation == world.generation and p.progress is not None]
        for load in loads:
            done = {reply.rank for reply in load.replies}
            for rank, (heard, grew, bytes_read) in sorted(load.progress.items()):
                if rank in done:
                    continue
                who = f"worker rank {rank} (pid {world.procs[rank].pid})"
                if now - heard > self.stall_floor_s:
                    return (f"{who} said nothing for {now - heard:.0f}s while reading the update (it says how far it got "
                            f"every {msg.LOAD_TICK_S:g}s; the stall floor is {self.stall_floor_s:g}s): it is stuck")
                if now - grew > self.request_timeout_s:
                    return (f"{who} read nothing of the update for {now - grew:.0f}s ({bytes_read / 2**20:.1f} MiB read; "
                            f"the bound is {self.request_timeout_s:g}s): it is stuck")
        return None

    def _hash_for_restarts(self, loaded: LoadedFiles) -> None:
        """Hashes the checkpoint a restart would reload, in the background; ``close()`` stops it and waits.
        A thread the process's thread limit refuses leaves the hash untaken, as one that failed does: the
        update has landed, and a restart still reloads these files while their sizes and times are unchanged."""
        thread = threading.Thread(target=loaded.hash, args=(self._closed,), name="pool-content-hash", daemon=True)
        with self._lock:  # started before close() can see it: joining a thread not started raises
            try:
                thread.start()
            except RuntimeError as error:  # "can't start new thread": hashing here would need threads too
                log.warning("hashing %s for restarts was not started (%s): a restart refuses it once its files "
                            "change", loaded.path, error)
                return
            # An earlier update's hash may still run (it stops on ``_closed``): close() waits for it too.
            self._hashes = [t for t in self._hashes if t.is_alive()] + [thread]
