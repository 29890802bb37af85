"""Readiness: what GET /readyz answers, the readiness pass it runs, and what /metrics and errors read of it.

``readiness()`` is a real scoring pass through every served model's scheduler (one sequence
each, side by side, shared by concurrent calls), run again when no forward has succeeded for
``_READY_MAX_AGE_S`` or after one failed; no pass makes a deployment ready whose workers are down
(``restart_error``, ``restart_retry_after_s``: a pool's failed restart), whose weights are being
copied in place, or one of whose forwards has stalled. ``Readiness`` is a part of
``runtime.Service``: it uses the service's ``phase``, ``models``, ``_scheduled``, ``_probe``,
``_probe_ok`` and ``_probe_failures``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from model_runtime.types import SequenceInput
from service.http.errors import ApiError
from service.http.request_id import outside_request

if TYPE_CHECKING:
    from service.runtime import ServedModel

log = logging.getLogger("service.runtime")  # the service's lines, under the one logger name a log filter knows

_READY_MAX_AGE_S = 10.0  # a forward this recent proves the backend scores; older, /readyz runs a probe
_PROBE_TIMEOUT_S = 60.0
# How long GET /readyz waits for its scoring pass: an answer within a probe's timeout (Helm's 5 s)
_READY_WAIT_S = 4.0
_PROBE_LENGTH = 8


class FirstPassFailed(RuntimeError):
    """The start's first readiness pass did not score; its message says which model and why."""


class Readiness:
    """The service's readiness (see the module docstring)."""

    def _workers_alive(self) -> float:
        total = 0.0
        for backend in [m.backend for m in list(self.models.values())]:
            alive = getattr(backend, "workers_alive", None)
            if alive is not None:
                total += float(alive() if callable(alive) else alive)
            elif backend.is_alive():
                total += float(backend.info.parallel.get("world_size", 1))
        return total

    def _all_alive(self) -> bool:
        return bool(self.models) and all(m.backend.is_alive() for m in self.models.values())

    def restart_error(self) -> str | None:
        """Why a served model's workers could not restart, while they are down (the worker pool)."""
        for m in self.models.values():
            if not m.backend.is_alive() and (error := getattr(m.backend, "restart_error", None)):
                return f"{m.name}: {error}"
        return None

    def restart_retry_after_s(self) -> int:
        """Whole seconds until every pool whose restart failed has tried again (the latest of their next
        attempts, ``restart_retry_after_s``; 30 where a backend does not say): /readyz's Retry-After for
        ``restart_failed``, since it is not ready before the last of them is back. 5 where none failed any more."""
        return max((int(getattr(m.backend, "restart_retry_after_s", 30)) for m in list(self.models.values())
                    if not m.backend.is_alive() and getattr(m.backend, "restart_error", None)), default=5)

    def is_ready(self) -> bool:
        """The last known readiness, without running anything (for the metric)."""
        return (self.phase == "ready" and self._probe_ok and self._all_alive() and not self._copying_in_place()
                and not self._stalled())

    def _stalled(self) -> bool:
        """A forward has run far past what its row should take (a stopped worker, a hung GPU)."""
        return any(m.scheduler.forward_state() == "stalled" for m in self._scheduled())

    def _copying_in_place(self) -> bool:
        """An update copies into some model's served weights (``LocalBackend.copying_in_place``):
        that model scores nothing until the copy ends, so the deployment is not ready."""
        return any(getattr(m.backend, "copying_in_place", False) for m in self.models.values())

    async def readiness(self) -> tuple[bool, str]:
        """(ready, status) for GET /readyz; runs a scoring pass when the last proof is stale."""
        if self.phase != "ready":
            return False, self.phase
        if not self._all_alive():
            self._probe_ok = False  # a worker came back: it must score again before we are ready
            return False, "restart_failed" if self.restart_error() else "worker_down"
        if self._copying_in_place():
            return False, "updating_weights"
        if self._stalled():
            # One replica stuck (a stopped worker, a hung GPU) while others keep succeeding: the
            # successes alone would keep the proof fresh and hide it.
            return False, "stalled"
        now = time.monotonic()
        stale = any(
            m.scheduler.last_success_at is None or now - m.scheduler.last_success_at > _READY_MAX_AGE_S
            or m.scheduler.last_failure
            for m in self._scheduled()
        )
        if stale or not self._probe_ok:
            proven = self._probe_ok
            if not await self._run_probe(_READY_WAIT_S):
                # The pass waits behind a running forward (a long row), or the backend is stuck.
                states = [m.scheduler.forward_state() for m in self._scheduled()]
                if "stalled" in states:
                    return False, "stalled"
                if proven and "busy" in states:
                    return True, "ready"  # busy, as it was when last proven; the pass runs after the row
                return False, "probe_pending"
        if self.phase != "ready":
            return False, self.phase
        if not self._probe_ok and not self._all_alive():  # a worker lost under the pass failed it: say so
            return False, "restart_failed" if self.restart_error() else "worker_down"
        return (True, "ready") if self._probe_ok else (False, "probe_failed")

    def probe_failed_models(self) -> dict[str, bool]:
        """Served name -> whether its last readiness pass scored non-finite log-probabilities (else it
        failed or timed out), for /readyz's unauthenticated 503: names and kinds, no exception text."""
        return {name: reason.startswith("scored non-finite") for name, reason in self._probe_failures.items()}

    async def _first_probe(self) -> None:
        """The start's first readiness pass, awaited to its end; ``FirstPassFailed`` when it did not score."""
        await self._run_probe(_PROBE_TIMEOUT_S + 1)  # the pass bounds itself
        if not self._probe_ok:
            if any(m.scheduler.closed_reason for m in self._scheduled()):  # the server stopping cut the pass off:
                raise asyncio.CancelledError  # the start ends as service.stop()'s cancel ends it, not as a failed one
            why = "; ".join(f"{name} {reason}" for name, reason in self._probe_failures.items())
            raise FirstPassFailed(f"the first readiness pass failed: {why or 'it did not finish in time'}")

    async def _run_probe(self, wait_s: float) -> bool:
        """Runs (or joins) the scoring pass; whether it finished within ``wait_s`` (it runs on)."""
        # Concurrent /readyz calls share one pass.
        if self._probe is None or self._probe.done():
            # Shared by every /readyz that joins it and outliving the one that started it: no request's.
            self._probe = asyncio.create_task(self._probe_once(), context=outside_request())
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), wait_s)
        except TimeoutError:
            return False
        return True

    async def _probe_once(self) -> None:
        # Every served model scores one sequence; they run side by side.
        self._probe_failures = {}
        results = await asyncio.gather(*(self._probe_model(m) for m in self._scheduled()))
        self._probe_ok = bool(results) and all(results)

    async def _probe_model(self, model: ServedModel) -> bool:
        assert model.scheduler is not None
        seq = SequenceInput(np.arange(_PROBE_LENGTH, dtype=np.int64) % model.backend.info.vocab_size)
        ticket = None
        try:
            ticket = model.scheduler.submit([seq], probe=True)
            scores = await asyncio.wait_for(asyncio.shield(ticket.future), _PROBE_TIMEOUT_S)
            ok = bool(np.all(np.isfinite(scores[0].logprobs)))
            if not ok:
                log.error("readiness pass of %s returned non-finite log-probabilities", model.name)
                self._probe_failures[model.name] = f"scored non-finite log-probabilities in {model.backend.info.dtype}, from finite weights"
        except (ApiError, TimeoutError) as exc:
            if ticket is not None:
                model.scheduler.cancel(ticket)
            if (stopping := model.scheduler.closed_reason) is not None:  # the server stopped it, not the model
                log.info("readiness pass of %s cancelled: %s", model.name, stopping)
                self._probe_failures[model.name] = f"cancelled: {stopping}"
                return False
            why = f"no result within {_PROBE_TIMEOUT_S:g}s" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            log.error("readiness pass of %s failed: %s", model.name, why)
            self._probe_failures[model.name] = f"failed: {why}"
            ok = False
        return ok
