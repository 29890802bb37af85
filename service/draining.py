"""Draining and stopping: a SIGTERM's drain, a stop without one, and whether torch work still runs after.

``begin_drain`` turns readiness and new requests to 503; ``drain`` then lets admitted requests,
answers being sent and weight updates finish within ``--drain-timeout-s`` (those left get 503);
``abandon`` answers them 503 at once; ``stop`` ends the start, the schedulers and the backends.
``Draining`` is a part of ``runtime.Service``: it uses the service's ``phase``, ``settings``,
``models``, ``scheduler``, ``inflight``, ``recording``, ``drained``, ``_scheduled``,
``_drain_waiters``, ``_start_task`` and ``_loading``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from service.http.errors import draining_error
from service.load_thread import LOAD_THREAD

log = logging.getLogger("service.runtime")  # the service's lines, under the one logger name a log filter knows

# a stopped scheduler's idle forward threads end within it; one still alive then is taken as running
_FORWARD_THREADS_END_S = 1.0

# the start's phases that admit no request (awaiting_weights admits weight updates, which a drain lets finish)
_START_PHASES = ("loading", "warming_up", "probing")


def _set_done(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Draining:
    """The service's drain and stop (see the module docstring)."""

    def begin_drain(self, *, abandoning: bool = False) -> None:
        """SIGTERM: readiness turns 503 and new requests get 503; admitted ones finish (``abandoning``:
        they are answered 503 next, which the log line says instead; during the start, which admitted
        nothing, the line says that the start stops, at once where ``abandoning``)."""
        if self.phase != "draining":
            starting = self.phase.replace("_", " ") if self.phase in _START_PHASES else None
            if abandoning and starting:
                log.info("stopping the model's start (%s) at once, without a drain; no request was admitted yet",
                         starting)
            elif abandoning:
                log.info("stopping without a drain: admitted requests still pending are answered 503")
            elif starting:
                log.info("draining: stopping the model's start (%s); no request was admitted yet", starting)
            else:
                log.info("draining: finishing admitted requests within %gs", self.settings.drain_timeout_s)
            self.phase = "draining"
            for waiter in list(self._drain_waiters):
                waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
            if self.scheduler is not None:  # not admitted yet: as new as a request arriving now
                self.scheduler.stop_admitting(draining_error())

    def when_draining(self) -> asyncio.Future:
        """A future of the running event loop, done once draining begins (a request body still
        arriving then is answered 503 at once: it was never admitted). Cancel it when done with it."""
        waiter = asyncio.get_running_loop().create_future()
        if self.phase == "draining":
            waiter.set_result(None)
        else:
            self._drain_waiters.add(waiter)
            waiter.add_done_callback(self._drain_waiters.discard)
        return waiter

    async def drain(self) -> None:
        self.begin_drain()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        finished = True
        for model in self._scheduled():
            finished &= await model.scheduler.wait_idle(max(0.0, deadline - time.monotonic()))
        # answers being encoded and sent, and weight updates under way with their record writes (a trainer waits on them)
        while (self.inflight or self.recording or any(m.updating for m in self.models.values())) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not finished:
            await self._close_pending("drain timeout", "the server is shutting down (drain timeout)")
        self.drained = True

    async def abandon(self) -> None:
        """Stopping without a drain: every admitted request still pending is answered 503 now."""
        self.begin_drain(abandoning=True)
        await self._close_pending("stopping without a drain", "the server is stopping without a drain")

    async def _close_pending(self, why: str, reason: str) -> None:
        """Closes every scheduler with ``reason``: its requests still pending get 503, counted and named
        in a warning that begins with ``why``."""
        for model in self._scheduled():
            if model.scheduler.pending_requests:
                log.warning("%s: %d unfinished request(s) of %s get 503 (requests %s)", why,
                            model.scheduler.pending_requests, model.name, model.scheduler.pending_request_ids())
            await model.scheduler.close(reason)

    def torch_work_running(self) -> bool:
        """Once stopped: whether a forward (one the drain timeout cut off), a load or a weights update is
        still under way in another thread: the process must then exit without finalising the interpreter
        under it, which aborts in torch's threads. A forward thread is asked whether it ended, not whether
        it runs: one that took a row just before its scheduler closed starts it a moment later."""
        if any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
            return True
        return not all(model.scheduler.threads_ended(_FORWARD_THREADS_END_S) for model in self._scheduled())

    async def stop(self) -> None:
        loading = self._loading
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        if loading is not None and hasattr(loading, "abort"):  # a worker pool starting: its workers go too
            loading.abort()
        for model in self._scheduled():
            await model.scheduler.close()
        for model in self.models.values():
            model.backend.close()
