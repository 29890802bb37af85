"""The thread a scheduler's runner hands each forward to: the event loop awaits the forward's
result without running it, and a forward still running when the process must exit holds nothing.
``forward_state`` tells from the threads whether a forward has stalled."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Callable, Iterable

from model_runtime.scoring.backend import STALL_FACTOR, STALL_FLOOR_S, STALL_UNMEASURED_S


class ForwardThread:
    """One runner's forward thread, a daemon: a forward still running when the process must
    exit (the drain timed out) does not hold the exit."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Monotonic start of the forward under way, None while idle: one attribute, so that the event
        # loop never reads a new forward's state beside the previous one's start (a false "stalled").
        self.since: float | None = None
        self.expected_s: float | None = None  # what that forward should take at the measured rate
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self.since is not None

    @property
    def alive(self) -> bool:
        """Whether the thread still runs: after ``stop``, until the forward under way (if any) ended."""
        return self._thread.is_alive()

    async def run(self, fn: Callable, *args):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return await future

    def stop(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            if future.cancelled():  # its runner was cancelled (the scheduler closed) before it started: nobody waits
                continue
            self.since = time.monotonic()
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting runner
                result, error = None, exc
            finally:
                self.since = None
            try:
                loop.call_soon_threadsafe(settle, future, result, error)
            except RuntimeError:  # the loop closed while the forward ran
                return


def forward_state(threads: Iterable[ForwardThread]) -> str:
    """``"idle"``, ``"busy"`` (a forward runs within what its row should take) or ``"stalled"``
    (one has run past ``STALL_FACTOR`` times that, and at least ``STALL_FLOOR_S``; without a
    measured rate, past ``STALL_UNMEASURED_S``)."""
    now, state = time.monotonic(), "idle"
    for thread in threads:
        started = thread.since
        if started is None:
            continue
        expected = thread.expected_s
        bound = STALL_UNMEASURED_S if expected is None else max(STALL_FLOOR_S, STALL_FACTOR * expected)
        if now - started > bound:
            return "stalled"
        state = "busy"
    return state


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    """``future`` (awaited on the event loop) gets a thread's result or error, unless it was cancelled."""
    if not future.done():  # the awaiting side may have been cancelled meanwhile
        if error is not None:
            future.set_exception(_raisable(error))
        else:
            future.set_result(result)


def _raisable(error: BaseException) -> BaseException:
    # set_exception refuses StopIteration with a TypeError inside the loop's callback: the awaiting task never woke.
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(f"the call raised StopIteration{f': {error}' if str(error) else ''}")
        wrapped.__cause__ = error
        return wrapped
    return error
