"""What the HTTP service drives: something that scores one packed row at a time.

``LocalBackend`` runs the scorer in this process. The multi-process worker pool
(``model_runtime.pool.pool``) offers the same surface, with ``concurrency`` equal to its number of
data-parallel groups. The service never touches torch directly.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Protocol, Sequence

import torch

from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import LoadedModel
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput, SequenceScores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """The facts /v1/models and the metrics report about the served model."""

    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    weights_version: str
    kernels: dict[str, str]
    parallel: dict = field(default_factory=lambda: {"world_size": 1, "dp": 1, "sp": 1, "fsdp": False})
    slow_kernels: tuple[str, ...] = ()

    @staticmethod
    def of(loaded: LoadedModel, parallel: dict | None = None) -> "ModelInfo":
        return ModelInfo(
            name=loaded.name,
            architecture=loaded.architecture,
            vocab_size=loaded.vocab_size,
            max_model_len=loaded.max_model_len,
            dtype=loaded.dtype_name,
            device=loaded.device.type,
            weights_version=loaded.weights_version,
            kernels=loaded.kernel_names,
            parallel=parallel or {"world_size": 1, "dp": 1, "sp": 1, "fsdp": False},
            slow_kernels=loaded.slow_kernels,
        )

    @staticmethod
    def from_fields(source, parallel: dict) -> "ModelInfo":
        """A ModelInfo from any object carrying its fields by name (a worker's ``Hello``)."""
        names = [f.name for f in fields(ModelInfo) if f.name != "parallel"]
        info = ModelInfo(**{n: getattr(source, n) for n in names}, parallel=parallel)
        return replace(info, kernels=dict(info.kernels), slow_kernels=tuple(info.slow_kernels))


@dataclass(frozen=True)
class WeightsUpdate:
    """What ``update_weights`` reports once the new version serves."""

    weights_version: str  # the version now serving
    previous_version: str  # the version it replaced
    load_s: float  # from the call to the new weights ready beside the old (checks and reading)
    swap_ms: float  # the pause between two forwards while the weights are swapped


# A forward counts as stalled (a worker stopped, a GPU hung) once it has run this many times what
# its row should take at the measured rate, and at least the floor; before any rate, the bound.
# The scheduler reports it in /readyz; the worker pool restarts its world on it.
STALL_FACTOR = 10.0
STALL_FLOOR_S = 60.0
STALL_UNMEASURED_S = 600.0


class BackendUnavailableError(RuntimeError):
    """The backend cannot score right now (a worker died, or it is restarting)."""


class ScoringBackend(Protocol):
    """What the service drives. Optional attributes it reads where present: ``prefix_rounding``,
    ``restart_error``, ``restart_retry_after_s`` (whole seconds until the next restart attempt:
    ``/score``'s and ``/readyz``'s Retry-After while ``restart_error`` is set; 30 where absent), ``workers_alive``,
    ``copying_in_place`` (an update copies into the served weights: nothing scores meanwhile,
    /readyz says ``updating_weights``), ``pins_groups``
    (``score_row(sequences, group=g)`` runs on data-parallel group ``g``: several served models)."""

    info: ModelInfo
    concurrency: int  # how many score_row calls may run at the same time
    max_row_tokens: int  # token budget of one row (sp x the per-GPU budget in a sequence-parallel group)

    def score_row(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        """Scores ``sequences`` as one packed forward. Blocking; thread-safe up to ``concurrency``.

        Raises ``InvalidSequenceError`` for bad input, ``torch.OutOfMemoryError`` (or another
        ``RuntimeError`` naming memory) when the row does not fit, ``BackendUnavailableError``
        when no worker can take it.
        """

    def warm_up(self) -> None:
        """Compiles and autotunes kernels for the configured budget (before readiness)."""

    def update_weights(self, path: Path, version: str | None) -> WeightsUpdate:
        """Serves the safetensors checkpoint at ``path`` as ``version`` (None: its content hash).

        Blocking (the service calls it in a thread). Loads the checkpoint beside the old weights
        where memory allows (else in place between forwards), checks it, then swaps atomically
        between forwards: a row is scored entirely by one version, which its ``SequenceScores``
        name. ``info.weights_version`` changes at the swap. Raises ``CheckpointError`` (and
        changes nothing) for a checkpoint the model cannot take.
        """

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


# Every op of a forward gives the GIL up and must take it back. Beside a thread running Python
# (HTTP decoding, an update's readers), each take can wait out that thread's whole switch
# interval, and a forward of short rows launches thousands of ops.
FORWARD_SWITCH_INTERVAL_S = 0.0005


def favour_forward_threads() -> None:
    """Shortens the interpreter's GIL switch interval (never lengthens it) for the whole process:
    called where forwards will run beside other Python threads (``packscore serve`` and ``score``
    with the scorer in the process, every pool worker), not by a library user's ``LocalBackend``."""
    sys.setswitchinterval(min(sys.getswitchinterval(), FORWARD_SWITCH_INTERVAL_S))


def begin_update(lock: threading.Lock, name: str) -> float:
    """Takes ``lock`` for one weight update (the caller releases it) and returns its start time;
    a second update of the same model is refused, not queued."""
    if not lock.acquire(blocking=False):
        raise UpdateInProgressError(f"an update of {name} is already running")
    return time.perf_counter()


class LocalBackend:
    """The scorer in this process; one forward at a time."""

    concurrency = 1
    # Share of the free GPU memory a second copy of the weights may take; beyond it an update
    # copies the new weights into place between forwards instead.
    BESIDE_FRACTION = 0.9

    def __init__(self, scorer: Scorer, *, updates: bool = False):
        """``updates``: weight updates may come; their page-locked staging buffers are made here,
        since making them in the first update would stop the forwards beside it (tensor_file.Staging)."""
        self.scorer = scorer
        self.info = ModelInfo.of(scorer.loaded)
        self.max_row_tokens = scorer.max_batch_tokens
        self._lock = threading.Lock()  # held by a forward, and by a swap
        # Held by a swap while it waits for the running forward: a caller scoring row after row
        # would otherwise win the forward lock back every time (Python's locks are not fair).
        self._turnstile = threading.Lock()
        self._updating = threading.Lock()  # one update at a time
        self.update_in_place: bool | None = None  # None: beside the old weights when a second copy fits
        self.copying_in_place = False  # an update copies into the served weights: nothing scores meanwhile
        # The served weights' checkpoint and its files as read, to copy back from should an update
        # in place fail part way; None for a preset's weights.
        loaded = scorer.loaded
        self._served_from = (Path(loaded.source), loaded.source_files) if loaded.source_files is not None else None
        # The scheduler costs rows with it from the first request on, warm-up or not (``packscore score``)
        self.scorer.rounding_in_use()
        if updates and scorer.loaded.device.type == "cuda":
            from model_runtime.scoring.tensor_file import staging_for

            staging_for(next(scorer.loaded.model.parameters()).device)  # the device the update reads for

    @property
    def prefix_rounding(self):
        """Which members of a group may share their prompt (``Scorer.rounding_in_use``)."""
        return self.scorer.prefix_rounding

    def score_row(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        with self._turnstile:
            pass
        with self._lock:
            results = self.scorer.score_row(sequences)
            version = self.scorer.loaded.weights_version
        for r in results:
            r.weights_version = version
        return results

    def warm_up(self) -> None:
        with self._lock:
            self.scorer.warm_up()

    def update_weights(self, path: Path, version: str | None = None) -> WeightsUpdate:
        from model_runtime.scoring.content_hash import content_version
        from model_runtime.scoring.weights import (ReadDigests, changed_in_place, checkpoint_changed, files_snapshot,
                                                   mixed_version, plan_reads, read_parameters,
                                                   refuse_non_finite_reads, swap_parameters)

        path = Path(path)
        started = begin_update(self._updating, self.info.name)
        try:
            loaded = self.scorer.loaded
            files = files_snapshot(path)
            plan = plan_reads(loaded.model, path)
            beside = self._fits_beside() if self.update_in_place is None else not self.update_in_place
            if beside:
                # no version: the content hash, of the bytes read (the tensors not read, after)
                digests = ReadDigests() if version is None else None
                new = read_parameters(loaded.model, plan, digests=digests)
                new_version = version or content_version(path, read=digests)
                if (changed := checkpoint_changed(path, files)) is not None:
                    raise changed
                load_s = time.perf_counter() - started
                with self._turnstile, self._lock:
                    t0 = time.perf_counter()
                    swap_parameters(loaded.model, new)
                    previous = self._set_version(new_version)
                    swap_ms = 1e3 * (time.perf_counter() - t0)
                self._served_from = (path, files)
            else:
                # one read while the old weights serve: NaN refused, and no version given, the content hash
                hashed = refuse_non_finite_reads(loaded.model, plan, content=version is None)
                new_version = version or hashed
                with self._turnstile, self._lock:  # forwards wait while the weights are copied into place
                    t0 = time.perf_counter()
                    if (changed := checkpoint_changed(path, files)) is not None:  # since checked: nothing copied
                        raise changed
                    self.copying_in_place = True
                    try:
                        read_parameters(loaded.model, plan, into_model=True)
                        if (changed := changed_in_place(path, files)) is not None:
                            raise changed
                    except Exception as failure:  # part copied, or copied from changing files
                        restored, error = self._copy_back(failure)
                        if restored and not isinstance(failure, (CheckpointError, OSError)):
                            raise  # the server's own fault (CUDA, memory) as it is; the served weights are back
                        raise error from failure
                    except BaseException:
                        self._set_version(mixed_version())
                        raise
                    finally:
                        self.copying_in_place = False
                    previous = self._set_version(new_version)
                    self._served_from = (path, files)
                    swap_ms = 1e3 * (time.perf_counter() - t0)
                    load_s = time.perf_counter() - started
            return WeightsUpdate(new_version, previous, load_s, swap_ms)
        finally:
            self._updating.release()

    def _copy_back(self, failure: Exception) -> tuple[bool, CheckpointError]:
        """After an update in place failed part way (under the forward lock): the served version's
        weights copied back from its checkpoint, when its files are as they were read; whether
        they were, and the error that says so. Else the weights, of neither version, are named
        ``mixed:<hex>``, which no pinned request matches."""
        from model_runtime.scoring.weights import checkpoint_changed, mixed_version, plan_reads, read_parameters

        served = self.scorer.loaded.weights_version
        why = f"{failure}"
        if self._served_from is not None:
            source, files = self._served_from
            try:
                if checkpoint_changed(source, files) is None:
                    read_parameters(self.scorer.loaded.model, plan_reads(self.scorer.loaded.model, source), into_model=True)
                    if checkpoint_changed(source, files) is None:
                        log.warning("update in place failed part way (%s); %s copied back from %s", failure, served, source)
                        return True, CheckpointError(getattr(failure, "kind", "unreadable"),
                                                     f"{why}; {served} was copied back and serves as before")
                why += f"; {source} changed since {served} was read from it"
            except Exception as exc:
                why += f"; copying {served} back from {source} failed too: {exc}"
        else:
            why += f"; {served} has no checkpoint to copy back from"
        mixed = mixed_version()
        self._set_version(mixed)
        return False, CheckpointError("unreadable", f"{why}. The weights served now are a mix, named {mixed}, which "
                                      "no pinned request matches: update again once the files are complete")

    def _set_version(self, version: str) -> str:
        previous = self.scorer.loaded.weights_version
        self.scorer.loaded.weights_version = version
        self.info = replace(self.info, weights_version=version)
        return previous

    def _fits_beside(self) -> bool:
        device = self.scorer.loaded.device
        if device.type != "cuda":
            return True
        need = sum(p.numel() for p in self.scorer.loaded.model.parameters()) * self.scorer.loaded.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(device)
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return need <= self.BESIDE_FRACTION * (free + idle)

    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class UpdateInProgressError(RuntimeError):
    """An update of the same model is already running (the service answers 409)."""
