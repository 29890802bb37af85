"""What ``run_server`` leaves to the interpreter's exit once uvicorn has returned."""

import asyncio
import contextlib
import gc
import threading
import time

import numpy as np

from model_runtime.types import SequenceInput
from service.http import server
from service.http.app import create_app
from service.http.errors import ApiError
from service.scheduling import forward_thread
from service.settings import Settings
from service.testing import FakeBackend, running_app, wait_until


def test_the_served_heap_is_frozen_before_the_interpreter_s_last_collections(monkeypatch):
    """Those collections walk every object the model and its libraries made, the longest part of a
    real model's exit; frozen objects are not walked (nothing in them is left to write)."""
    monkeypatch.setattr(server.DrainingServer, "run", lambda self, sockets=None: None)  # served and drained
    settings = Settings(host="127.0.0.1", port=1)
    try:
        assert server.run_server(create_app(settings, FakeBackend()), settings) == 0
        assert gc.get_freeze_count() > 0, "the heap was left for the interpreter's exit to walk"
    finally:
        gc.unfreeze()  # the rest of this test process collects as before


class _ClockHeldOnAForwardThread:
    """``time`` for forward_thread.py whose first ``monotonic()`` on a forward thread waits for ``release``:
    the thread has taken its row and found its runner waiting, and not yet marked the forward started."""

    def __init__(self, entered: threading.Event, release: threading.Event):
        self.entered, self.release = entered, release

    def monotonic(self) -> float:
        if threading.current_thread().name.startswith("packscore-forward") and not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return time.monotonic()


def test_a_row_its_forward_thread_took_just_before_the_close_keeps_the_exit_from_finalising(monkeypatch):
    """Between taking a row and marking its forward started, a forward thread read as idle: the exit's check
    (``torch_work_running``) saw no forward, the interpreter's teardown began, and the forward then ran torch
    under it (SIGABRT in torch's threads instead of the exit's status)."""
    exits, entered, release = [], threading.Event(), threading.Event()
    monkeypatch.setattr(server, "hard_exit", exits.append)
    backend = FakeBackend()
    app = create_app(Settings(), backend)
    service = app.state.service

    async def main():
        async with running_app(app):
            monkeypatch.setattr(forward_thread, "time", _ClockHeldOnAForwardThread(entered, release))
            ticket = service.scheduler.submit([SequenceInput(np.arange(1, 9, dtype=np.int32))])
            await wait_until(entered.is_set)
            rows = len(backend.rows)
        with contextlib.suppress(ApiError):  # the close answered it 503
            await ticket.future
        return rows

    rows = asyncio.run(main())
    try:
        server._exit_if_torch_work_running(service, 0, "a forward still runs")
    finally:
        release.set()
    assert service.scheduler.threads_ended(10), "the forward thread did not end once released"
    assert len(backend.rows) == rows + 1, "the held row never ran: the window was not the one before its forward"
    assert exits == [0], "the exit went on to finalise the interpreter while a forward thread was about to run a row"


class _Transport:
    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


class _Connection:
    """A connection as uvicorn's server state holds it: its transport and its request's cycle."""

    def __init__(self, started: bool, complete: bool):
        self.transport = _Transport()
        self.cycle = type("Cycle", (), {"response_started": started, "response_complete": complete})()


def test_a_drain_that_ended_waits_for_an_answer_not_yet_started():
    """A drain with nothing admitted may end before the handler of a body still arriving wakes to send
    its 503: exiting then resets that connection, and its client, still sending, meets the reset."""
    import uvicorn

    drained = type("Drained", (), {"fatal_error": None, "drained": True})()
    waiting = server.DrainingServer(uvicorn.Config(lambda *a: None), drained)
    waiting._drain_deadline = time.monotonic() + 60
    for started, complete, exits in [(False, False, False), (True, False, False), (True, True, True)]:
        waiting.server_state.connections = {_Connection(started, complete)}
        assert asyncio.run(waiting.on_tick(1)) is exits, (started, complete)
    waiting._drain_deadline = time.monotonic() - 1  # the drain's time is up: exits whatever is unanswered
    waiting.server_state.connections = {_Connection(False, False)}
    assert asyncio.run(waiting.on_tick(1)) is True
