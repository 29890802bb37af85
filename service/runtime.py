"""The state of one running service: loading, readiness, draining, and the parts it owns.

Lifecycle (phases):  loading -> warming_up -> probing -> ready -> draining
                     any of the first three -> failed (the CLI then exits non-zero)

Loading and warm-up run in threads so that /healthz answers and /readyz says why it is not
ready yet. Readiness is a real scoring pass through the scheduler, repeated when no forward has
succeeded recently or after the backend reported a failure.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

import numpy as np

from model_runtime.scoring.backend import ScoringBackend
from model_runtime.types import SequenceInput
from service.http.errors import ApiError
from service.http.metrics import Metrics
from service.http.validation import Limits, resolve_model_len
from service.scheduling.scheduler import Scheduler
from service.settings import Settings

log = logging.getLogger(__name__)

BackendSource = ScoringBackend | Callable[[], ScoringBackend]

_READY_MAX_AGE_S = 10.0  # a forward this recent proves the backend scores; older, /readyz runs a probe
_PROBE_TIMEOUT_S = 60.0
_PROBE_LENGTH = 8


async def _in_daemon_thread(fn: Callable, *args):
    """Runs ``fn`` in a daemon thread: a SIGTERM during a slow load must not wait for the load."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target():
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=target, name="packscore-load", daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():  # the awaiting side may have been cancelled meanwhile
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class Service:
    def __init__(self, settings: Settings, backend: BackendSource, metrics: Metrics | None = None):
        self.settings = settings
        self._backend_source = backend
        self.metrics = metrics or Metrics()
        self.api_key = settings.resolved_api_key()
        self.phase = "loading"
        self.backend: ScoringBackend | None = None
        self.scheduler: Scheduler | None = None
        self.limits: Limits | None = None
        self.served_name = settings.served_model_name or ""
        self.fatal_error: str | None = None  # set when loading failed; the server then exits non-zero
        self.inflight = 0  # /score requests admitted and not yet answered
        self.drained = False  # set once a drain finished: the server may exit
        self._probe: asyncio.Task | None = None
        self._probe_ok = False
        self._start_task: asyncio.Task | None = None
        self.metrics.watch(
            queued_tokens=lambda: self.scheduler.queued_tokens if self.scheduler else 0,
            queued_sequences=lambda: self.scheduler.queued_sequences if self.scheduler else 0,
            ready=lambda: 1.0 if self.is_ready() else 0.0,
            workers_alive=self._workers_alive,
        )

    # ---- startup -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts loading in the background and returns at once."""
        self._start_task = asyncio.create_task(self._start(), name="packscore-start")

    async def _start(self) -> None:
        try:
            source = self._backend_source
            backend = source if hasattr(source, "score_row") else await _in_daemon_thread(source)
            self.backend = backend
            self._configure(backend)
            self._advance("warming_up")
            started = time.perf_counter()
            await _in_daemon_thread(backend.warm_up)
            log.info("warm-up took %.1fs", time.perf_counter() - started)
            self.scheduler = Scheduler.from_settings(backend, self.settings, self.metrics)
            await self.scheduler.start()
            self._advance("probing")
            await self._run_probe()
            if not self._probe_ok:
                raise RuntimeError("the first readiness pass failed")
            self._advance("ready")
            log.info("ready: serving %r on %s", self.served_name, backend.info.device)
        except Exception as exc:
            log.exception("startup failed")
            self.fatal_error = f"{type(exc).__name__}: {exc}"
            if self.phase != "draining":
                self.phase = "failed"

    def _advance(self, phase: str) -> None:
        if self.phase != "draining":  # a SIGTERM during startup wins
            self.phase = phase

    def _configure(self, backend: ScoringBackend) -> None:
        info, s = backend.info, self.settings
        self.served_name = s.served_model_name or info.name
        model_len = resolve_model_len(s.max_model_len, info.max_model_len, s.queued_tokens)
        self.limits = Limits(
            vocab_size=info.vocab_size,
            max_model_len=model_len,
            max_sequences_per_request=s.max_sequences_per_request,
            max_request_tokens=s.queued_tokens,
            max_request_bytes=s.request_bytes,
        )
        self.metrics.describe_model(info, self.served_name)
        if info.slow_kernels:
            log.warning("slow reference kernels in use for %s", ", ".join(info.slow_kernels))

    # ---- readiness -----------------------------------------------------------------------------

    def _workers_alive(self) -> float:
        if self.backend is None:
            return 0.0
        alive = getattr(self.backend, "workers_alive", None)
        if alive is not None:
            return float(alive() if callable(alive) else alive)
        return float(self.backend.info.parallel.get("world_size", 1)) if self.backend.is_alive() else 0.0

    def is_ready(self) -> bool:
        """The last known readiness, without running anything (for the metric)."""
        return self.phase == "ready" and self._probe_ok and self.backend is not None and self.backend.is_alive()

    async def readiness(self) -> tuple[bool, str]:
        """(ready, status) for GET /readyz; runs a scoring pass when the last proof is stale."""
        if self.phase != "ready":
            return False, self.phase
        assert self.backend is not None and self.scheduler is not None
        if not self.backend.is_alive():
            self._probe_ok = False  # a worker came back: it must score again before we are ready
            return False, "worker_down"
        last = self.scheduler.last_success_at
        stale = last is None or time.monotonic() - last > _READY_MAX_AGE_S or self.scheduler.last_failure
        if stale or not self._probe_ok:
            await self._run_probe()
        if self.phase != "ready":
            return False, self.phase
        return (True, "ready") if self._probe_ok else (False, "probe_failed")

    async def _run_probe(self) -> None:
        # Concurrent /readyz calls share one pass.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_once())
        await asyncio.shield(self._probe)

    async def _probe_once(self) -> None:
        assert self.scheduler is not None and self.backend is not None
        vocab = self.backend.info.vocab_size
        seq = SequenceInput(np.arange(_PROBE_LENGTH, dtype=np.int64) % vocab)
        ticket = None
        try:
            ticket = self.scheduler.submit([seq], probe=True)
            scores = await asyncio.wait_for(asyncio.shield(ticket.future), _PROBE_TIMEOUT_S)
            ok = bool(np.all(np.isfinite(scores[0].logprobs)))
            if not ok:
                log.error("readiness pass returned non-finite log-probabilities")
        except (ApiError, TimeoutError) as exc:
            if ticket is not None:
                self.scheduler.cancel(ticket)
            log.error("readiness pass failed: %s", exc)
            ok = False
        self._probe_ok = ok

    # ---- draining and shutdown -----------------------------------------------------------------

    def begin_drain(self) -> None:
        """SIGTERM: readiness turns 503 and new requests get 503; admitted ones finish."""
        if self.phase != "draining":
            log.info("draining: finishing admitted requests within %.0fs", self.settings.drain_timeout_s)
            self.phase = "draining"
            if self.scheduler is not None:  # not admitted yet: as new as a request arriving now
                self.scheduler.stop_admitting(ApiError(
                    503, "draining", "The server is shutting down; retry on another replica.",
                    headers={"Retry-After": "1", "Connection": "close"}))

    async def drain(self) -> None:
        self.begin_drain()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        finished = True
        if self.scheduler is not None:
            finished = await self.scheduler.wait_idle(self.settings.drain_timeout_s)
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # answers being encoded and sent
        if not finished and self.scheduler is not None:
            log.warning("drain timeout: %d requests unfinished get 503", self.scheduler.pending_requests)
            await self.scheduler.close("the server is shutting down (drain timeout)")
        self.drained = True

    async def stop(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.backend is not None:
            self.backend.close()
