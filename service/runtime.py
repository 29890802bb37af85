"""The state of one running service: loading, readiness, draining, and the parts it owns.

Lifecycle (phases):  loading [-> awaiting_weights] -> warming_up -> probing -> ready -> draining
                     loading, warming_up, probing -> failed (the CLI then exits non-zero)
                     warming_up, probing -> warming_up (a worker pool lost a worker: once it restarted)

``awaiting_weights``: a model's ``--weights-record`` checkpoint could not be served; the process
waits, not ready, until a weight update of every such model succeeds (``Service.release``).

Loading and warm-up run in threads so that /healthz answers and /readyz says why it is not
ready yet; the log says when each begins and, while it runs on, that it still does. Readiness is
a real scoring pass through the scheduler, repeated when no forward has succeeded recently or
after the backend reported a failure (``readiness.Readiness``); a drain and a stop are
``draining.Draining``'s; both are parts of ``Service``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from model_runtime.scoring.backend import BackendUnavailableError, ScoringBackend
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.still_lines import saying_still
from service.draining import Draining
from service.http.metrics import Metrics
from service.http.validation import Limits, resolve_model_len
from service.load_thread import NoLoadThreadError, in_load_thread
from service.readiness import FirstPassFailed, Readiness
from service.scheduling.admission import SharedCapacity
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.weights_record import UnservableError, WeightsRecord, Withheld, unservable

log = logging.getLogger(__name__)

BackendSource = ScoringBackend | Callable[[], ScoringBackend]
# One source, or served name -> source for several models (None: named by the model itself).
BackendSources = BackendSource | Mapping[str | None, BackendSource]

_RESTORE_ATTEMPTS = 3  # a --weights-record restore tried again after a worker pool restart
# a restore whose load thread the thread limit refused, tried again after these pauses (seconds)
_NO_THREAD_BACKOFF_S = (0.5, 1.0, 2.0)
# warm-up and the first pass, cut short by a lost worker: one that dies at every pass fails the start
_FIRST_PASS_ATTEMPTS = 3


async def _saying_while(doing: str, name: str, awaitable):
    """Awaits ``awaitable``, logging "still DOING NAME: 30 s" each ``still_lines.EVERY_S`` while it runs (the
    log of a 9B's start is otherwise silent for minutes); no line once it ended."""
    with saying_still(log, f"{doing} {name}"):
        return await awaitable


@dataclass
class ServedModel:
    """One model of the deployment: its backend (weights and version), limits and scheduler."""

    name: str
    backend: ScoringBackend
    limits: Limits
    key: str | None = None  # its NAME in --model NAME=PATH (None for a plain --model PATH)
    scheduler: Scheduler | None = None
    updating: bool = False  # a POST /v1/weights for it is running: until its load thread ended, not its handler
    swap_holds: int = 0  # requests re-scoring after swaps: no update starts while any holds
    hold_waiters: int = 0  # requests waiting for the running update's end to hold: no new update starts before them
    versions_served: set[str] = field(default_factory=set)  # every version this model served
    # The last update's answer, with the version, directory and files (names, sizes, mtimes) it
    # loaded: the same request again, files untouched, gets that answer (a retry after a lost one).
    last_update: tuple[tuple, dict] | None = None

    def serves(self, source: tuple, update) -> dict:
        """``update`` (a ``WeightsUpdate``) of ``source`` (version, directory, files) serves: its
        versions are taken, and its answer is kept for the same request again. Returns that answer."""
        self.versions_served.update((update.previous_version, update.weights_version))
        answer = {"model": self.name, "weights_version": update.weights_version,
                  "previous_version": update.previous_version, "load_s": update.load_s, "swap_ms": update.swap_ms}
        self.last_update = (source, dict(answer))
        return answer


class Service(Readiness, Draining):
    def __init__(self, settings: Settings, backend: BackendSources, metrics: Metrics | None = None,
                 record: WeightsRecord | None = None):
        """``record``: the opened ``--weights-record`` (the CLI opens it with ``--model`` as configured,
        before a hub id is resolved); by default opened here from ``settings``."""
        self.settings = settings
        self.record = record if record is not None else WeightsRecord.from_settings(settings)
        self._backend_sources = dict(backend) if isinstance(backend, Mapping) else {None: backend}
        self.metrics = metrics or Metrics()
        self.api_key = settings.resolved_api_key()
        self.admin_key = settings.resolved_admin_key()
        self.phase = "loading"
        self.models: dict[str, ServedModel] = {}  # in --model order; the first is the default
        self.aliases: dict[str, str] = {}  # another name a request may give a served model -> its served name
        self.fatal_error: str | None = None  # set when loading failed; the server then exits non-zero
        self.fatal_status = 1  # 2 when the checkpoint was refused (the CLI's status for a refusal)
        self.inflight = 0  # /score requests admitted and not yet answered
        self.recording: set[asyncio.Future] = set()  # --weights-record writes of updates that serve, under way
        self.drained = False  # set once a drain finished: the server may exit
        self._drain_waiters: set[asyncio.Future] = set()  # when_draining's futures not yet done
        self._probe: asyncio.Task | None = None
        self._probe_ok = False
        self._probe_failures: dict[str, str] = {}  # served name -> why its last readiness pass failed
        self._start_task: asyncio.Task | None = None
        self._loading: Callable | None = None  # the source whose load runs now (stop() aborts it where it can)
        self.withheld: dict[str, Withheld] = {}  # models waiting for an update (awaiting_weights)
        self._released: asyncio.Event | None = None  # set once no model is withheld
        self.metrics.watch(
            queued_tokens=lambda: sum(m.scheduler.queued_tokens for m in self._scheduled()),
            queued_sequences=lambda: sum(m.scheduler.queued_sequences for m in self._scheduled()),
            ready=lambda: 1.0 if self.is_ready() else 0.0,
            workers_alive=self._workers_alive,
            worker_restarts=lambda: {m.name: float(getattr(m.backend, "restarts", 0)) for m in list(self.models.values())},
        )

    # ---- the served models (the first one stands for all where one is asked for) ---------------

    @property
    def default(self) -> ServedModel | None:
        return next(iter(self.models.values()), None)

    @property
    def backend(self) -> ScoringBackend | None:
        return self.default.backend if self.default else None

    @property
    def scheduler(self) -> Scheduler | None:
        return self.default.scheduler if self.default else None

    @property
    def limits(self) -> Limits | None:
        return self.default.limits if self.default else None

    @property
    def served_name(self) -> str:
        return self.default.name if self.default else (self.settings.served_model_name or "")

    def _scheduled(self) -> list[ServedModel]:
        return [m for m in list(self.models.values()) if m.scheduler is not None]

    # ---- startup -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts loading in the background and returns at once."""
        self._start_task = asyncio.create_task(self._start(), name="packscore-start")

    async def _start(self) -> None:
        try:
            for key, source in self._backend_sources.items():
                backend = source if hasattr(source, "score_row") else await self._load(source, key)
                self._configure(key, backend)
            if self.record is not None:
                await self._restore_recorded(self.record)
            if self.withheld:
                self._released = asyncio.Event()
                self._advance("awaiting_weights")
                await self._released.wait()
            self._advance("warming_up")
            shared = None
            if len(self.models) > 1:
                concurrency = max(int(getattr(m.backend, "concurrency", 1)) for m in self.models.values())
                shared = SharedCapacity(self.settings.queued_tokens, concurrency)
            for model in self.models.values():
                model.scheduler = Scheduler.from_settings(model.backend, self.settings, self.metrics, shared=shared,
                                                        model=model.name)
                await model.scheduler.start()
            for attempt in range(_FIRST_PASS_ATTEMPTS):
                if await self._first_pass(last=attempt == _FIRST_PASS_ATTEMPTS - 1):
                    break
                await self._await_restarted_workers()
            self._advance("ready")
            log.info("ready: serving %s", ", ".join(f"{m.name!r} on {m.backend.info.device}" for m in self.models.values()))
        except Exception as exc:
            if isinstance(exc, CheckpointError):  # a refusal names its problem: no traceback
                log.error("startup failed: %s", exc)
                self.fatal_error, self.fatal_status = str(exc), 2
            elif isinstance(exc, (FirstPassFailed, BackendUnavailableError)):  # the message names the cause
                log.error("startup failed: %s", exc)
                self.fatal_error = str(exc)
            else:
                log.exception("startup failed")
                self.fatal_error = f"{type(exc).__name__}: {exc}"
            if self.phase != "draining":
                self.phase = "failed"

    async def _load(self, source: Callable[[], ScoringBackend], key: str | None) -> ScoringBackend:
        self._loading = source
        name = key or getattr(source, "name", None) or self.settings.served_model_name or "the model"
        try:
            return await _saying_while("loading", name, in_load_thread(source))
        finally:
            self._loading = None

    async def _first_pass(self, last: bool) -> bool:
        """Warm-up and the first readiness pass; False when a worker pool lost a worker meanwhile
        (it restarts itself, as it would once ready: the start waits for it instead of failing),
        unless this is the ``last`` attempt: a worker lost every time fails the start."""
        try:
            for model in self.models.values():
                started = time.perf_counter()
                log.info("warming up %s: %s", model.name, self._warm_up_does(model))
                # On the thread the forwards run on: what the warm-up builds per thread (cuDNN's
                # attention plans) is then there for every request.
                await _saying_while("warming up", model.name, model.scheduler.run_on_forward_thread(model.backend.warm_up))
                log.info("warm-up of %s took %.1fs", model.name, time.perf_counter() - started)
            self._advance("probing")
            await self._first_probe()
            return True
        except (BackendUnavailableError, RuntimeError) as exc:
            if last or not self._restarting_models() or self.phase == "draining":
                raise
            log.warning("a worker failed before the first readiness pass (%s); waiting for its pool to restart", exc)
            return False

    def _warm_up_does(self, model: ServedModel) -> str:
        """What the warm-up line says it does (docs/gpu.md: "The first start warms up")."""
        if model.backend.info.device != "cuda":
            return "one short scoring pass (nothing to compile)"
        cache = self.settings.triton_cache_dir
        kept = f"those already in {cache} are not compiled again" if cache else \
            "--triton-cache-dir keeps them for the next start"
        return f"compiling and running its kernels for the served shapes (about a minute with an empty kernel cache; {kept})"

    def _restarting_models(self) -> list[ServedModel]:
        """Served models whose worker pool is down and restarts itself (it has a restart count)."""
        return [m for m in self.models.values() if hasattr(m.backend, "restarts") and not m.backend.is_alive()]

    async def _await_restarted_workers(self) -> None:
        self._advance("warming_up")
        while self._restarting_models() and self.phase != "draining":
            await asyncio.sleep(0.2)

    def _advance(self, phase: str) -> None:
        if self.phase != "draining":  # a SIGTERM during startup wins
            self.phase = phase

    def _configure(self, key: str | None, backend: ScoringBackend) -> None:
        info, s = backend.info, self.settings
        name = key or s.served_model_name or info.name
        if name in self.models:
            backend.close()
            raise ValueError(f"two served models are named {name!r}; name them with --model NAME=PATH")
        model_len = resolve_model_len(s.max_model_len, info.max_model_len, s.queued_tokens)
        limits = Limits(
            vocab_size=info.vocab_size,
            max_model_len=model_len,
            max_sequences_per_request=s.max_sequences_per_request,
            max_request_tokens=s.queued_tokens,
            max_request_bytes=s.request_bytes,
        )
        self.models[name] = ServedModel(name, backend, limits, key)
        directory = s.model_specs().get(None) if key is None and s.served_model_name is None else None
        if directory is not None and directory not in (name, *self.models, *self.aliases) and Path(directory).is_dir():
            self.aliases[directory] = name  # the exact --model string also names it, as vLLM takes it
        self.metrics.describe_model(info, name)
        self.metrics.weights_awaited.labels(model=name).set(0)
        if s.weights_root is not None:
            self.metrics.expect_updates(name, recorded=self.record is not None)
        if info.slow_kernels:
            log.warning("slow reference kernels in use for %s", ", ".join(info.slow_kernels))

    async def _restore_recorded(self, record: WeightsRecord) -> None:
        """Each model the record names with its own --model source serves the recorded checkpoint,
        swapped in by the update route's own checks before readiness; one that cannot is withheld."""
        record.warn_unserved(set(self.models))
        for model in self.models.values():
            entry = record.entry_for(model.name, model.key)
            if entry is None:
                continue
            try:
                path = record.checked_path(entry)
                log.info("restoring %s from --weights-record %s: version %s from %s", model.name, record.file,
                         entry.version, path)
                update = await _saying_while("restoring", model.name,
                                             self._restore_through_restarts(model, path, entry.version))
            except (UnservableError, CheckpointError, BackendUnavailableError, OSError, RuntimeError) as exc:
                self._withhold(model, record.withhold(model.name, entry, unservable(exc)))
                continue
            model.serves((entry.version, path, entry.files), update)
            self.metrics.describe_model(model.backend.info, model.name)
            log.info("%s serves version %s from %s (restored from --weights-record %s; --model %s was loaded first)",
                     model.name, entry.version, path, record.file, entry.model)

    async def _restore_through_restarts(self, model: ServedModel, path, version: str):
        """The recorded update; a worker lost meanwhile says nothing about the checkpoint: once its
        pool restarted, the update runs again (twice at most: a checkpoint that kills a worker every
        time, say by the host's memory, is withheld as any that cannot be served). Nor does a load
        thread the thread limit refused: tried again after short pauses, withheld only if it stays refused."""
        attempt = refused = 0
        while True:
            try:
                return await in_load_thread(model.backend.update_weights, path, version)
            except NoLoadThreadError as exc:
                if refused == len(_NO_THREAD_BACKOFF_S) or self.phase == "draining":
                    raise UnservableError(
                        f"at each of {refused + 1} attempts {exc}; the checkpoint was not read",
                        "no thread could be started for its load (the process's thread limit)") from exc
                pause = _NO_THREAD_BACKOFF_S[refused]
                refused += 1
                log.warning("restoring %s from --weights-record: %s; trying again in %gs (attempt %d of %d)",
                            model.name, exc, pause, refused + 1, len(_NO_THREAD_BACKOFF_S) + 1)
                await asyncio.sleep(pause)
            except BackendUnavailableError as exc:
                attempt += 1
                if not hasattr(model.backend, "restarts") or attempt == _RESTORE_ATTEMPTS or self.phase == "draining":
                    raise
                log.warning("restoring %s from --weights-record: %s; again once its workers restarted", model.name, exc)
                while not model.backend.is_alive() and self.phase != "draining":
                    await asyncio.sleep(0.2)

    def _withhold(self, model: ServedModel, withheld: Withheld) -> None:
        self.withheld[model.name] = withheld
        self.metrics.weights_awaited.labels(model=model.name).set(1)

    def release(self, name: str) -> None:
        """A weight update of ``name`` succeeded: it no longer waits; once none does, the start goes
        on (warm-up, the first readiness pass) as any start does."""
        if self.withheld.pop(name, None) is None:
            return
        self.metrics.weights_awaited.labels(model=name).set(0)
        waiting = ", ".join(map(repr, self.withheld))
        log.info("%s serves the update it awaited; %s", name, f"still awaiting weights: {waiting}" if waiting else
                 "starting up")
        if not self.withheld and self._released is not None:
            self._released.set()
