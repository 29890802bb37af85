"""Admission in time: how much work the queue may hold, and who waits for room.

The queue holds ``queue_seconds`` of work per GPU at the measured scoring rate, never less
than ``floor_rows`` full rows per GPU (what keeps a prefetched row behind every running one
whatever the rate), never more than ``max_tokens`` (``--max-queued-tokens``, also the largest
request). Before a full row was measured, the rate of the readiness pass stands in: a small
row is mostly fixed cost, so it underestimates, and the floor covers the rest.

A request that does not fit waits here, first come first served, until earlier work
finishes and frees room, up to ``max_wait_s`` (or its deadline, which the caller enforces);
only then is it refused with 429. A request larger than the whole bound is admitted once
nothing else is admitted, so any request under ``max_tokens`` runs eventually. The waiting
room itself holds at most ``max_tokens`` tokens; beyond that a request is refused at once.

Retry-After on a 429 is the time until the request would fit at the measured rate, but never
more than half the time the admitted work keeps the GPUs busy: a client that sleeps that long
is back before they run dry. Before a full row was measured it is 1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:
    from service.scheduling.scheduler import Scheduler

_RATE_HALF_LIFE_S = 10.0  # memory of the rate estimate
_MEASURED_ROW_FRACTION = 0.25  # rows smaller than this fraction of the budget say little about the rate


class QueueFullError(Exception):
    """No room within the wait; ``retry_after_s`` is the hint for the client."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Counts admitted tokens against a bound measured in seconds of work.

    Args:
        gpus: forwards that run at the same time (the backend's concurrency).
        row_tokens: token budget of one row.
        queue_seconds: seconds of measured work per GPU the admitted queue holds; None: the
            bound is ``max_tokens`` alone (a fixed token count).
        floor_rows: full rows per GPU the bound never goes below (also the prior).
        max_tokens: hard cap on admitted tokens, and on the tokens of one request.
        max_wait_s: how long a request may wait for room before 429.
    """

    def __init__(self, *, gpus: int, row_tokens: int, queue_seconds: float | None, floor_rows: float,
                 max_tokens: int, max_wait_s: float):
        self.gpus = max(1, int(gpus))
        self.row_tokens = int(row_tokens)
        self.queue_seconds = queue_seconds
        self.floor_rows = float(floor_rows)
        self.max_tokens = int(max_tokens)
        self.max_wait_s = float(max_wait_s)
        self.admitted = 0  # tokens admitted and not yet released (queued or in a forward)
        self.waiting = 0  # tokens of requests waiting for room
        self.rate: float | None = None  # measured tokens/s of one GPU
        self._measured = False  # False while ``rate`` is only the prior from a small row
        self._rate_at = 0.0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._closed: BaseException | None = None  # close()'s error: a request that would wait for room gets it

    # ---- the bound ------------------------------------------------------------------------

    def observe(self, tokens: int, seconds: float) -> None:
        """A forward of ``tokens`` took ``seconds`` on one GPU.

        A row under a quarter of the budget is mostly fixed cost and says little about the rate:
        it only serves as the prior until a real row is measured (the readiness pass, at start).
        """
        if seconds <= 0:
            return
        now = time.monotonic()
        rate = tokens / seconds
        if tokens < _MEASURED_ROW_FRACTION * self.row_tokens:
            if self.rate is None:
                self.rate = rate
            return
        if not self._measured:
            self.rate, self._measured = rate, True
        else:
            keep = 0.5 ** ((now - self._rate_at) / _RATE_HALF_LIFE_S)
            self.rate = keep * self.rate + (1 - keep) * rate
        self._rate_at = now

    @property
    def bound(self) -> int:
        """Tokens the admitted queue may hold now."""
        if self.queue_seconds is None:
            return self.max_tokens
        floor = self.floor_rows * self.row_tokens * self.gpus
        timed = self.queue_seconds * self.rate * self.gpus if self.rate else 0.0
        return int(min(self.max_tokens, max(floor, timed)))

    def fits(self, tokens: int) -> bool:
        return self.admitted + tokens <= self.bound or self.admitted == 0

    def retry_after_s(self, tokens: int) -> int:
        """Whole seconds a refused request should wait: until it would fit, but never long
        enough for the admitted work to run out first (1..60)."""
        if not self._measured:  # the small-row prior understates the rate: a wait from it outlasts the queue
            return 1
        total = self.rate * self.gpus
        until_room = (self.admitted + tokens - self.bound) / total
        busy_for = self.admitted / total
        return int(min(60, max(1, min(math.ceil(until_room), math.floor(busy_for / 2)))))

    # ---- admitting ------------------------------------------------------------------------

    def try_admit(self, tokens: int) -> bool:
        """Admits at once when nobody waits ahead and the tokens fit."""
        if not self._waiters and self.fits(tokens):
            self.admitted += tokens
            return True
        return False

    def force(self, tokens: int) -> None:
        """Counts tokens that bypass the bound (the readiness pass)."""
        self.admitted += tokens

    async def admit(self, tokens: int, timeout_s: float | None = None) -> None:
        """Waits for room, first come first served, up to ``max_wait_s`` (and ``timeout_s``);
        raises QueueFullError past the wait, or the error given to ``close()``."""
        if self.try_admit(tokens):
            return
        if self._closed is not None:  # a drain began after the caller checked: it would wait unseen by close()
            raise self._closed.with_traceback(None)
        wait = self.max_wait_s if timeout_s is None else min(self.max_wait_s, timeout_s)
        if wait <= 0 or self.waiting + tokens > self.max_tokens:
            raise self.refusal(tokens)
        future = asyncio.get_running_loop().create_future()
        entry = (tokens, future)
        self._waiters.append(entry)
        self.waiting += tokens
        try:
            await asyncio.wait_for(asyncio.shield(future), wait)
        except TimeoutError:
            if self._leave(entry):
                return  # admitted just as the wait ended
            raise self.refusal(tokens) from None
        except asyncio.CancelledError:  # the caller went away
            if self._leave(entry):
                self.release(tokens)
            raise

    def _leave(self, entry: tuple[int, asyncio.Future]) -> bool:
        """Takes a waiter out of the line; True when it had been admitted meanwhile."""
        tokens, future = entry
        if future.done() and not future.cancelled() and future.exception() is None:
            return True
        if entry in self._waiters:
            self._waiters.remove(entry)
            self.waiting -= tokens
            self._wake()  # a large request leaving the head may let smaller ones in
        future.cancel()
        return False

    def close(self, error: BaseException) -> None:
        """Fails every waiting request with ``error`` (the server is stopping), and every request
        that would wait from now on."""
        self._closed = error
        while self._waiters:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(error)
        self.waiting = 0

    def release(self, tokens: int) -> None:
        """Admitted tokens are done (scored, failed or dropped); lets waiters in, in order."""
        self.admitted -= tokens
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.fits(self._waiters[0][0]):
            tokens, future = self._waiters.popleft()
            self.waiting -= tokens
            self.admitted += tokens
            future.set_result(None)

    def refusal(self, tokens: int) -> QueueFullError:
        retry = self.retry_after_s(tokens)
        return QueueFullError(
            f"The admission queue is full ({self.admitted} tokens admitted, bound {self.bound}, "
            f"{self.waiting} waiting); retry in {retry} s.",
            retry,
        )


class SharedCapacity:
    """What the schedulers of several served models share: the admission bound and the forward slots.

    Each served model has its own scheduler (rows never mix models); they share one ``Admission``
    (the first scheduler's: one time-measured bound within ``--max-queued-tokens`` for the whole
    deployment) and run at most ``concurrency`` forwards at once across models, each on its own
    lane: the data-parallel group (GPUs) it runs on, which every model's pool numbers alike. So two
    models on one GPU never hold two rows' activations together, and no GPU idles meanwhile (not
    under FSDP, whose stepper places rows itself: there ``pins_groups`` is off).
    """

    def __init__(self, max_queued_tokens: int, concurrency: int):
        self.max_queued_tokens = int(max_queued_tokens)
        self.slots = asyncio.Semaphore(max(1, int(concurrency)))  # first come first served
        self._free_lanes = set(range(max(1, int(concurrency))))
        self.schedulers: list[Scheduler] = []
        self.admission: Admission | None = None  # set by the first scheduler

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[int]:
        """A forward slot, in turn: the lowest lane no forward of any model runs on."""
        async with self.slots:
            lane = min(self._free_lanes)
            self._free_lanes.remove(lane)
            try:
                yield lane
            finally:
                self._free_lanes.add(lane)

    @property
    def queued_tokens(self) -> int:
        return sum(s.queued_tokens for s in self.schedulers)
