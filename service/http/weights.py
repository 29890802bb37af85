"""POST /v1/weights: a new checkpoint from under ``--weights-root`` for one served model.

The path is resolved inside the root (403 ``forbidden_path`` for anything that leaves it, a
symlink included); the backend loads it beside the old weights, checks it and swaps between
forwards (``ScoringBackend.update_weights``). A failed update changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from model_runtime.scoring.backend import BackendUnavailableError, UpdateInProgressError, WeightsUpdate
from model_runtime.scoring.checkpoint import index_shards
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.weights import RESERVED_VERSION_PREFIXES, files_snapshot
from model_runtime.still_lines import saying_still
from service.http.errors import ApiError, backend_unavailable, is_out_of_memory, short_repr
from service.http.errors import SHOWN_PATH, restart_failed
from service.http.schemas import WeightsRequest
from service.http.validation import body_object, pick_model, validated
from service.load_thread import NoLoadThreadError, in_load_thread
from service.runtime import ServedModel, Service

log = logging.getLogger(__name__)

WEIGHTS_ROUTE = "/v1/weights"
_RETRY_SOON = {"Retry-After": "2"}  # an update in progress: a load takes seconds


def _forbidden(path: str, why: str) -> ApiError:
    return ApiError(403, "forbidden_path", f"path {short_repr(path, SHOWN_PATH)} {why}; give a directory relative to --weights-root.", "path")


def resolve_checkpoint(root: Path, path: str) -> Path:
    """``path`` inside ``root``: 403 for an absolute path, ``..`` or a symlink leaving the root
    (the directory or any file in it), 422 when it names no directory."""
    if "\x00" in path or not path.strip():
        raise ApiError(422, "invalid_value", "path must name a checkpoint directory under --weights-root.", "path")
    pure = PurePosixPath(path.replace("\\", "/"))
    if pure.is_absolute() or PureWindowsPath(path).drive or PureWindowsPath(path).is_absolute():
        raise _forbidden(path, "is absolute")
    if ".." in pure.parts:
        raise _forbidden(path, "climbs out with '..'")
    try:
        real_root = root.resolve()
        target = (real_root / pure).resolve()  # follows every symlink on the way, dangling ones too
        if not target.is_relative_to(real_root):
            raise _forbidden(path, "leaves --weights-root through a symlink")
        if not target.is_dir():
            raise ApiError(422, "invalid_value", f"path {short_repr(path, SHOWN_PATH)} is not a directory under --weights-root.", "path")
        for entry in target.iterdir():  # the files the loader will open
            if entry.is_symlink() and not entry.resolve().is_relative_to(real_root):
                raise _forbidden(path, f"holds {entry.name}, a symlink that leaves --weights-root")
        for shard in _index_shards(target):  # and those its index names
            if "\x00" not in shard and not (target / shard).resolve().is_relative_to(real_root):
                raise _forbidden(path, f"has an index naming {shard[:200]!r}, a file outside --weights-root")
    except OSError as exc:  # a name too long, a loop of symlinks, a directory it may not list
        raise ApiError(422, "invalid_value", f"path {short_repr(path, SHOWN_PATH)} cannot be used: {exc.strerror or exc}.", "path") from None
    return target


def _index_shards(target: Path) -> list[str]:
    """The shard names the checkpoint's index lists (none where it has none, or where it is no
    index: the loader refuses that with 422)."""
    try:
        return [name for name in index_shards(target) or () if isinstance(name, str)]
    except CheckpointError:
        return []


def _named_model(model: Any, service: Service) -> str:
    """The served model a body names (or the only one, when it names none), else ``""``."""
    try:
        return pick_model(model, service.models, service.aliases) if model is None or isinstance(model, str) else ""
    except ApiError:
        return ""


def checkpoint_refused(exc: CheckpointError) -> ApiError:
    # API.md names two refusals of a checkpoint's content; one packscore cannot load at all (another
    # model_type, a quantization, no safetensors) is not the served model's either: incompatible.
    kind = "incompatible" if exc.kind == "unsupported" else exc.kind
    return ApiError(422, f"{kind}_checkpoint", f"The checkpoint was refused: {exc}", "path")


async def update_weights(service: Service, body: Any, root: Path) -> dict:
    """Runs one update to its end; the answer once the new version serves. Every outcome is
    counted, a refusal under its error type (``model=""`` before the model is known), a load that
    landed or failed as it ended (``_landed``, ``_load_failed``); a new one belongs in
    metrics.UPDATE_OUTCOMES, which writes them at 0 from the start."""
    requested_at = time.time()  # the record keeps the last update requested, whichever server finishes last
    name = ""
    try:
        name = _named_model(body_object(body).get("model"), service)  # a refused body still counts under its model
        request = validated(WeightsRequest, body)
        model = service.models[pick_model(request.model, service.models, service.aliases)]
        name = model.name
        answer, recording = await _run(service, model, resolve_checkpoint(root, request.path), request.version,
                                       requested_at)
    except _LoadFailed as exc:  # counted as the load ended (``_load_failed``), whether or not this handler waited
        raise exc.answer from None
    except ApiError as exc:
        service.metrics.weights_updates.labels(model=name, outcome=exc.type).inc()
        # the trainer has the answer; the operator a line (a path out of the root, a WARNING: who asks for that?)
        log.log(logging.WARNING if exc.status == 403 else logging.INFO, "weights update%s refused before any load: %d %s: %s",
                f" of {name}" if name else "", exc.status, exc.type, exc.message)
        raise
    except Exception:  # a bug: the 500 is the app's, the failed update is counted here too
        service.metrics.weights_updates.labels(model=name, outcome="internal_error").inc()
        raise
    if recording is not None:  # the update's own write: this handler cancelled meanwhile leaves it going on
        with contextlib.suppress(Exception):  # a failed write is logged and counted (_landed); the 200 stands
            await asyncio.shield(recording)
    return answer


def _landed(service: Service, model: ServedModel, answer: dict, requested_at: float, *,
            replay: bool = False) -> asyncio.Future | None:
    """``answer``'s update serves: the update's own ends, done whether or not its handler still waits
    (one cancelled meanwhile): its model waits no longer, it counts ``ok`` (not a ``replay``, the same
    request sent again: that update counted as it landed) and its ``--weights-record`` write starts.
    Returns that write (None without a record)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # it landed after the loop closed: the server had stopped, nothing scored with it
        log.info("%s's update to %s landed after the server stopped: not counted nor recorded", model.name,
                 answer["weights_version"])
        return None
    service.release(model.name)  # at once: a model that serves the update waits no longer
    if not replay:
        service.metrics.weights_updates.labels(model=model.name, outcome="ok").inc()
    if service.record is None or model.last_update is None:
        return None
    (_, path, files), _ = model.last_update  # the files as read before the update loaded them

    def recorded(written: bool | None, error: BaseException | None) -> None:
        if error is not None:  # write() logs its own failures, never raises: its thread did not start
            log.error("--weights-record %s: recording %s serving %s failed: %s; the update stands, but a restart "
                      "would not restore it", service.record.file, model.name, answer["weights_version"], error)
        if not written:
            service.metrics.weights_record_failures.labels(model=model.name).inc()

    # In a daemon thread: the write waits for the disk (fsync), and a stopping process must not wait for it.
    writing = in_load_thread(service.record.write, model.name, model.key, path, answer["weights_version"], files,
                             lambda: model.backend.info.weights_version, requested_at, ended=recorded)
    service.recording.add(writing)  # the drain waits for it, as for the update

    def written(done: asyncio.Future) -> None:
        service.recording.discard(done)
        if not done.cancelled():
            done.exception()  # a thread that did not start is logged and counted above, awaited or not

    writing.add_done_callback(written)
    return writing


async def _run(service: Service, model: ServedModel, path: Path, version: str | None,
               requested_at: float) -> tuple[dict, asyncio.Future | None]:
    """The update's answer once it serves, and its ``--weights-record`` write (``_landed``)."""
    # the body's own faults first: a bad version is 422 whatever an update in progress
    if version is not None and version.lower().startswith(RESERVED_VERSION_PREFIXES):
        # Such a name could later be the content hash of other weights, which would then serve under it.
        raise ApiError(422, "invalid_value", f"versions starting with {', '.join(map(repr, RESERVED_VERSION_PREFIXES))} "
                       "are the names packscore gives (content hashes, presets, mixed weights); omit "
                       "version to get the checkpoint's own, or choose another name.", "version")
    if not callable(getattr(model.backend, "update_weights", None)):
        raise ApiError(409, "update_unsupported", f"The backend of {model.name!r} cannot update its weights.", "model")
    # A request re-scoring after swaps must see one version, and one waiting to hold gets in first.
    while (model.swap_holds or model.hold_waiters) and not model.updating:
        await asyncio.sleep(0.01)
    if model.updating:
        raise ApiError(409, "update_in_progress", f"An update of {model.name!r} is already running; retry once it is done.", "model",
                       headers=_RETRY_SOON)
    source = (version, path, files_snapshot(path))
    if version is not None and model.last_update is not None and model.last_update[0] == source \
            and model.backend.info.weights_version == version:
        log.info("weights update of %s to %s repeated: it already serves these files; answered as before, "
                 "not counted as an update again", model.name, version)
        answer = dict(model.last_update[1])
        return answer, _landed(service, model, answer, requested_at, replay=True)
    served = model.versions_served | {model.backend.info.weights_version}
    if version is not None and version in served:
        # A version names one set of weights: a pinned request must never get other numbers under it.
        raise ApiError(409, "version_in_use", f"version {version!r} already named weights {model.name!r} served; "
                       "give the new weights a version of their own (or none: their content hash).", "version")
    before = model.backend.info.weights_version
    answer: dict = {}
    recording: asyncio.Future | None = None
    failure: list[ApiError | BaseException] = []  # the load's failure as answered, once counted
    loading: asyncio.Future | None = None

    # "still updating NAME: 30 s" while the load runs (a large checkpoint's read: a minute, minutes from a network
    # disk), until its thread is done, before the lines of its outcome, waited for by this handler or not
    still = contextlib.ExitStack()

    def ended(update: WeightsUpdate | None, error: BaseException | None) -> None:
        # The update's thread is done, whether or not this handler still waits for it (cancelled at shutdown).
        nonlocal recording
        still.close()
        model.updating = False
        if model.backend.info.weights_version != before:  # it swapped, or a failed update in place left other weights
            service.metrics.describe_model(model.backend.info, model.name)
        if error is None:
            answer.update(_served(service, model, source, update))
            recording = _landed(service, model, answer, requested_at)
        else:
            failure.append(_load_failed(service, model, error, gave_up=loading is not None and loading.cancelled()))

    model.updating = True
    model.versions_served.add(before)  # served now: a request scored by it alone may name it after the swap
    log.info("weights update of %s from %s (version %s)", model.name, path, version or "content hash")
    still.enter_context(saying_still(log, f"updating {model.name}"))
    # Not asyncio.to_thread: a handler cancelled at shutdown must not end "updating" while the load
    # runs on, nor leave a non-daemon thread that a stop waits for.
    loading = in_load_thread(model.backend.update_weights, path, version, ended=ended)
    try:
        await loading
    except Exception as exc:
        if not failure:  # ``ended`` itself failed (a bug): the app's 500, counted by the handler
            raise
        raise _LoadFailed(failure[0] if isinstance(failure[0], ApiError) else exc) from None
    return answer, recording


class _LoadFailed(Exception):
    """The update's load failed and was counted as it ended; ``answer`` is the request's: an ``ApiError``,
    or the unexpected error itself (a bug: the app's 500)."""

    def __init__(self, answer: BaseException):
        super().__init__(str(answer))
        self.answer = answer


def _load_failed(service: Service, model: ServedModel, exc: BaseException, gave_up: bool) -> ApiError | BaseException:
    """The update's load failed with ``exc``: its failure logged and counted under its outcome, once, as
    the update ends, whether or not its handler still waits (``gave_up``: cut off by the shutdown or its
    caller). Returns the answer: an ``ApiError``, or ``exc`` where it was unexpected (a bug: the app's 500)."""
    refusal = _refusal(model, exc)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # it failed after the loop closed: the server had stopped, nobody reads the metrics
        log.info("%s's update failed after the server stopped (%s): not counted", model.name, exc)
        return refusal or exc
    if refusal is None and gave_up:  # the app's 500 logs it where a handler waits; here none does
        log.error("weights update of %s failed after its request was cut off", model.name, exc_info=exc)
    service.metrics.weights_updates.labels(model=model.name, outcome=refusal.type if refusal else "internal_error").inc()
    return refusal or exc


def _refusal(model: ServedModel, exc: BaseException) -> ApiError | None:
    """The answer to an update whose load failed with ``exc``, logged; None where it was unexpected."""
    if isinstance(exc, CheckpointError):
        log.warning("weights update of %s refused: %s", model.name, exc)
        return checkpoint_refused(exc)
    if isinstance(exc, UpdateInProgressError):
        return ApiError(409, "update_in_progress", f"{exc}; retry once it is done.", "model", headers=_RETRY_SOON)
    if isinstance(exc, BackendUnavailableError):
        if (failed := restart_failed(model.backend, f"The weights of {model.name!r} could not be updated")) is not None:
            return failed  # the pool cannot restart: why and when it next tries, as /score's 503 and /readyz say
        return backend_unavailable(f"The weights of {model.name!r} could not be updated: {exc}.", retry_after_s=5)
    if isinstance(exc, NoLoadThreadError):  # the server's moment, not the checkpoint's: it was not read
        log.error("weights update of %s not started: %s", model.name, exc)
        return backend_unavailable(f"The weights of {model.name!r} could not be updated now: {exc}; the checkpoint "
                                   "was not read.", retry_after_s=5)
    if isinstance(exc, (OSError, RuntimeError)):  # the old version still serves: the update changed nothing
        log.error("weights update of %s failed", model.name, exc_info=exc)
        if is_out_of_memory(exc):
            return backend_unavailable(f"The new weights of {model.name!r} do not fit in memory now: {exc}.", retry_after_s=30)
        return ApiError(422, "unreadable_checkpoint", f"The checkpoint could not be loaded: {exc}", "path")
    return None


def _served(service: Service, model: ServedModel, source: tuple, update: WeightsUpdate) -> dict:
    """``update`` serves: its versions taken, its answer kept and returned, its timings observed."""
    answer = model.serves(source, update)
    metrics = service.metrics
    metrics.weights_load_seconds.labels(model=model.name).observe(update.load_s)
    metrics.weights_swap_seconds.labels(model=model.name).observe(update.swap_ms / 1000.0)
    metrics.describe_model(model.backend.info, model.name)
    log.info("%s now serves %s (was %s): loaded in %.2fs, swapped in %.1fms",
             model.name, update.weights_version, update.previous_version, update.load_s, update.swap_ms)
    return answer
