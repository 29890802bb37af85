"""Runs the app under uvicorn, with SIGTERM meaning "drain, then exit 0", and the connection
guard of protocol.py (read and send timeouts, connection cap, JSON protocol errors)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import signal
import sys
import threading
import time
from typing import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE
from uvicorn.server import HANDLED_SIGNALS

from service.entrypoint import after_serving, exit_before_serving, hard_exit
from service.http.protocol import PROTOCOL_STATUSES, default_max_connections, guarded_protocol
from service.http.request_id import outside_request, uvicorn_log_config
from service.runtime import Service
from service.settings import Settings

log = logging.getLogger(__name__)

_EXIT_GRACE_S = 3.0  # past the drain timeout, the process exits whatever still runs


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM drains instead of closing the listening socket.

    uvicorn on SIGTERM stops accepting connections at once and re-raises the signal at exit
    (status -15). The contract wants new requests answered 503 with Retry-After while the
    admitted ones finish, and then a clean exit. A second SIGTERM, or SIGINT, during the drain falls
    back to uvicorn's own handling; a SIGINT once the drain is done, or once a failed start stopped the
    server, is ignored (the exit, 0 or the start's 1, 2 or 3, is under way), and so is a SIGTERM once a
    failed start stopped it (nothing was admitted to drain; the exit keeps the start's status), also where
    a drain began before the start failed: that exit, its drain's timer included, keeps the start's status.
    """

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future | None = None
        self._drain_deadline = 0.0
        self._exits_early = False  # SIGTERM exits at once until the loop is known (the early exit was in force)
        self._stopped_itself = False  # a drain or a failed start ended serving: the exit (0, or 1, 2, 3) is under way
        self.listen_failed = False  # the app started, then uvicorn could not bind its address (it exits 3)
        self.startup_status: int | None = None  # uvicorn's exit status when its startup failed (3)
        self._drained_from = ""  # the service's phase when a drain began: the start's, where it had not ended
        self._error_said = threading.Lock()  # the start's error line, written once: by the exit or the drain's timer
        self._error_written = False

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own, except that its handlers take over from the early exit (service.entrypoint) with no
        # moment of the default's between them, and that the default, not the early exit, is put back at its
        # end: a SIGTERM it recorded (a second, undrained one) is raised again under it, as uvicorn does.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._exits_early = signal.getsignal(signal.SIGTERM) is exit_before_serving  # known before it can be needed
        # A SIGINT ignored when started stays ignored (a script's `packscore serve &`, nohup), as `score` keeps it.
        handled = [sig for sig in HANDLED_SIGNALS if not (sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN)]
        found = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            stopped = signal.SIGINT in self._captured_signals or self._stopped_itself
            failed = self._start_failed() and signal.SIGTERM not in self._captured_signals
            for sig, handler in found.items():
                # Ctrl-C once a SIGINT, a drain or a failed start stopped the server is ignored: as a KeyboardInterrupt it
                # landed anywhere in the exit under way (130, 0, 1-3), the interpreter's teardown included, as a traceback.
                # A SIGTERM once a failed start stopped it too: the default's -15 would replace the start's 1, 2 or 3.
                ignored = stopped if sig == signal.SIGINT else failed
                signal.signal(sig, signal.SIG_IGN if ignored else after_serving(handler))
        for captured in reversed(self._captured_signals):
            if captured == signal.SIGINT:
                raise KeyboardInterrupt  # what the default handler raised; SIGINT is ignored by now
            signal.raise_signal(captured)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        shutdown = self.lifespan.shutdown

        async def shutdown_after_failed_bind() -> None:
            # uvicorn's startup stops the app only once its bind failed, then exits 3: known while the app stops
            # (a drain's timer may end that exit), not only once it raised
            self.listen_failed, self.startup_status = True, STARTUP_FAILURE
            await shutdown()

        self.lifespan.shutdown = shutdown_after_failed_bind
        try:
            await super().startup(sockets=sockets)
        except SystemExit as stop:  # uvicorn's 3: the app's start failed (its lifespan exits), else the bind did
            self.startup_status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            self._stopped_itself = True
            raise
        finally:
            del self.lifespan.shutdown  # the lifespan's own again, for the server's shutdown

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self._stopped_itself:
            # drained, or the start failed, and the server stopping by its bounded steps (a worker pool's stop by its
            # own timeouts): Ctrl-C now would only turn its 0, 1 or 2 into 130 and drop the start's error line
            return
        if sig == signal.SIGTERM and self._start_failed():
            # a supervisor stopping a server whose start failed: it is stopping, and nothing was admitted to drain; a
            # drain would say "draining" and arm its timer's exit 0 in place of the start's 1, 2 or 3
            return
        if sig == signal.SIGTERM and self._loop is None and self._exits_early:
            # uvicorn's own start (its config, the lifespan's creation) comes before startup() knows the
            # loop: nothing loads or is admitted yet, so this is still a SIGTERM before serving (exit 0)
            exit_before_serving(sig, frame)
        if sig == signal.SIGTERM and self._loop is not None and self._drain is None and not self.should_exit:
            # Not recorded as a captured signal: a drained SIGTERM ends with status 0.
            # The handler runs in whatever task the main thread was in: the drain is no request's.
            self._loop.call_soon_threadsafe(self._begin_drain, context=outside_request())
            return
        if self._loop is not None and not self.should_exit:
            # No drain (a second SIGTERM, SIGINT): what is still pending gets the contract's 503
            # now, before uvicorn's graceful shutdown cancels it into a plain-text 500.
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.service.abandon()),
                                            context=outside_request())
        super().handle_exit(sig, frame)

    def _start_failed(self) -> bool:
        """Whether a failed start (the model's, or uvicorn's) stops the server, a drain begun before it or not."""
        return (self.startup_status is not None or self.service.fatal_error is not None
                or (self._drain is None and self._stopped_itself))

    def exit_status(self, status: int) -> int:
        """The process's exit status, ``status`` where the start did not fail: a failed start's (uvicorn's 3, the
        model's 1 or 2, whose ``could not start`` line this writes once). For the exit and the drain's timer alike."""
        if self.startup_status is not None:
            return self.startup_status
        if status != 0 or self.service.fatal_error is None:
            return status
        with self._error_said:
            if not self._error_written:
                print(f"packscore: error: could not start: {self.service.fatal_error}", file=sys.stderr, flush=True)
                self._error_written = True
        return self.service.fatal_status

    @property
    def start_phase(self) -> str:
        """The model's start's phase, as it was when a drain began (the drain's own phase names none)."""
        return self._drained_from or self.service.phase

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets=sockets)
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            # uvicorn skips the app's shutdown after a second SIGINT: the loop's close would then cancel
            # the lifespan (a logged traceback) and the service would never stop (a pool's workers).
            await self.lifespan.shutdown()

    def _begin_drain(self) -> None:
        if self._drain is None:
            self._drain_deadline = time.monotonic() + self.service.settings.drain_timeout_s
            self._drained_from = self.service.phase
            self._drain = asyncio.ensure_future(self.service.drain())
            # The drain itself ends at its timeout; this catches whatever could still hold the exit after it (a
            # handler that ignores cancellation, a non-daemon thread, a failed start's slow stop: with its status).
            _exit_timer(self.service.settings.drain_timeout_s + _EXIT_GRACE_S, lambda: self.exit_status(0))

    async def on_tick(self, counter: int) -> bool:
        # Checked every 0.1 s by uvicorn's main loop: exit once drained or when startup failed.
        if self.service.fatal_error is not None:
            self._stopped_itself = True
            return True
        if self.service.drained:
            await super().on_tick(counter)  # the Date header uvicorn refreshes here: answers still go out meanwhile
            # An answer still being written to a slow reader is part of finishing what was admitted:
            # the exit (uvicorn then waits 1 s at most) would cut it off mid-body. So is a lingering close
            # (the drain's 503 to a body still arriving): cut off, the kernel resets it and a client still
            # sending meets the reset, not the 503; and so is that 503 before it starts (the drain ends
            # with nothing admitted before its handler wakes). A second SIGTERM or a SIGINT (should_exit)
            # stops without a drain, these waits included.
            waiting = self._sending() or self._lingering()
            if self.should_exit:
                return True
            self._stopped_itself = not (waiting and time.monotonic() < self._drain_deadline)
            return self._stopped_itself
        return await super().on_tick(counter)

    def _sending(self) -> bool:
        """Whether any connection still has an answer not yet handed to the kernel: started, or due to a
        request whose headers were read (while draining every such answer goes out at once)."""
        for connection in self.server_state.connections:
            transport, cycle = getattr(connection, "transport", None), getattr(connection, "cycle", None)
            if transport is None:
                continue
            if transport.get_write_buffer_size():  # closing or not: a closing transport flushes first
                return True
            if not transport.is_closing() and cycle is not None and not cycle.response_complete:
                return True
        return False

    def _lingering(self) -> bool:
        """Whether any connection still reads and drops the rest of a body it answered (protocol.py)."""
        return any(getattr(getattr(c, "transport", None), "lingering", False) for c in self.server_state.connections)


def _exit_timer(seconds: float, status: Callable[[], int] = lambda: 0) -> None:
    """Exits the process ``seconds`` from now with ``status()``, unless the interpreter got past its wait for
    other threads by then: from there on the timer's line, written while the interpreter finalises,
    could abort it ("could not acquire lock for <stderr>"), and its status would replace the exit's."""
    timer = threading.Timer(seconds, _exit_now, args=(status,))
    timer.daemon = True
    timer.start()
    atexit.register(_disarm, timer)  # atexit runs after threading's wait for non-daemon threads


def _disarm(timer: threading.Timer) -> None:
    timer.cancel()
    timer.join(1.0)  # one already firing exits the process within it


def _exit_now(status: Callable[[], int]) -> None:
    log.warning("drain: still running %.0f s past the drain timeout; exiting", _EXIT_GRACE_S)
    hard_exit(status())


def uvicorn_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for ``settings``: the guarded h11 protocol, the server's limits."""
    max_connections = settings.max_connections or default_max_connections()
    metrics = app.state.service.metrics
    # The protocol's own answers before any path is read (a 408 for headers, a 400, the cap's 503): route "other",
    # as the gate labels any path it does not serve; at 0 from the start, so increase() sees a fresh pod's first.
    answered = {status: metrics.requests.labels(route="other", status=str(status)) for status in PROTOCOL_STATUSES}
    latency = metrics.request_latency.labels(route="other")

    def on_answered(status: int, seconds: float) -> None:  # timed as the gate times its answers: one sample per count
        answered[status].inc()
        latency.observe(seconds)

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=guarded_protocol(settings.request_read_timeout_s, max_connections, settings.send_timeout_s,
                              metrics.send_timeouts.inc,
                              lambda reason: metrics.connections_closed.labels(reason=reason).inc(),
                              settings.request_bytes, on_answered),
        # A proxy or client reusing a connection the server closes at that moment gets no answer
        # (a proxy's 502): idle connections outlive the proxies' own idle timeouts.
        timeout_keep_alive=settings.keep_alive_timeout_s,
        log_level=settings.log_level,
        log_config=uvicorn_log_config(),  # uvicorn's lines name their request, as the app's do
        access_log=settings.log_level == "debug",  # one line per request costs CPU under load
        # After a drain every admitted request has its answer, written out (on_tick): connections
        # still open then are idle or stuck, and the drain timeout is the contract's bound on the exit.
        timeout_graceful_shutdown=1,
    )


def run_server(app: FastAPI, settings: Settings) -> int:
    """Serves until SIGTERM (drained) or SIGINT; returns the process's exit status."""
    service: Service = app.state.service
    server = DrainingServer(uvicorn_config(app, settings), service)
    why = "a forward, load or weights update still runs in another thread"
    try:
        server.run()
        status = 0
    except KeyboardInterrupt:  # SIGINT: uvicorn shut down gracefully, then re-raised it
        status = 130
    except SystemExit as stop:  # uvicorn could not listen (3): the load its startup began still runs
        status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if server.listen_failed:  # uvicorn's error line names the address and why: this says what is dropped
            why = (f"the port could not be bound, so the model's start ({server.start_phase.replace('_', ' ')}), "
                   "still running in another thread, is abandoned")
    status = server.exit_status(status)  # a first pass that timed out: its forward still runs
    _exit_if_torch_work_running(service, status, why)
    # The interpreter's last collections would walk every object the model and its libraries made, the
    # longest part of the exit; all is answered and flushed by now, so they are left alone.
    gc.freeze()
    return status


def _exit_if_torch_work_running(service: Service, status: int, why: str) -> None:
    """A forward cut off by the drain timeout (or a load, or an update) still runs in another
    thread: finalising the interpreter under it ends in std::terminate (status -6) from torch's
    threads, so the process ends here, its answers already sent and its logs flushed. ``why``: what
    runs, and why it is left."""
    if service.torch_work_running():
        log.warning("exiting with status %d: %s", status, why)
        hard_exit(status)
