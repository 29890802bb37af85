"""Dynamic batching: admitted requests are split into sequences, packed into forwards, reassembled.

Pipeline (asyncio tasks joined by bounded hand-offs, forwards in a thread pool):

    submit() -> FIFO of sequences -> packer -> rows -> runner x concurrency -> results -> dispatcher
                                                         (backend.score_row in a thread)

- FIFO across requests: every row starts with the oldest queued sequence, so a big request is
  never starved; later sequences may fill the rest of the row when they fit.
- A row holds at most ``max_batch_tokens`` tokens, except a longer sequence, which gets a row of
  its own; with prefix sharing, a prefix that sequences of the row share counts once.
- A full row is formed as soon as there are enough tokens, even while every runner is busy, so
  the next forward is ready before the current one ends (one prefetched row per runner). A
  partial row waits up to ``max_wait_ms`` after its oldest sequence arrived, and only closes
  once some runner is idle: while all are busy, waiting costs nothing and fills the row.
- A forward that fails is retried split in halves, down to single sequences; only the requests
  owning a sequence that fails alone fail (413 when it does not fit in memory). A backend that
  is unavailable fails the row's requests with 503.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from model_runtime.scoring.backend import BackendUnavailableError, ScoringBackend
from model_runtime.scoring.prefix import RowTokens, tokens_saved
from model_runtime.types import InvalidSequenceError, SequenceInput, SequenceScores
from service.http.errors import ApiError, backend_unavailable
from service.http.metrics import Metrics

log = logging.getLogger(__name__)

# How far past the head of the queue the packer looks for sequences that fit the row's rest.
_LOOKAHEAD = 1024
_RATE_HALF_LIFE_S = 10.0  # memory of the throughput estimate behind Retry-After


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA or not), or a RuntimeError naming memory; no torch import needed."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Ticket:
    """One admitted request: its sequences, their results as they arrive, and a future for all."""

    def __init__(self, sequences: Sequence[SequenceInput], deadline: float | None, loop: asyncio.AbstractEventLoop):
        self.sequences = list(sequences)
        self.tokens = sum(s.length for s in self.sequences)
        self.deadline = deadline  # time.monotonic() value, or None
        self.results: list[SequenceScores | None] = [None] * len(self.sequences)
        self.remaining = len(self.sequences)
        self.future: asyncio.Future[list[SequenceScores]] = loop.create_future()
        # A failed ticket whose caller has already gone must not log "exception never retrieved".
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.items: list[_Item] = []

    @property
    def done(self) -> bool:
        return self.future.done()


class _Item:
    """One queued sequence of a ticket."""

    __slots__ = ("ticket", "index", "seq", "tokens", "enqueued_at", "queued", "started", "released")

    def __init__(self, ticket: Ticket, index: int, seq: SequenceInput, now: float):
        self.ticket = ticket
        self.index = index
        self.seq = seq
        self.tokens = seq.length
        self.enqueued_at = now
        self.queued = True  # False once taken into a row or dropped with its ticket
        self.started = False  # True once its forward began
        self.released = False  # True once it no longer counts against admission (done or dropped)


class Scheduler:
    def __init__(
        self,
        backend: ScoringBackend,
        *,
        max_batch_tokens: int,
        max_wait_ms: float,
        max_queued_tokens: int,
        metrics: Metrics | None = None,
        model: str | None = None,
        prefix_min_tokens: int = 0,
    ):
        self.backend = backend
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_queued_tokens = int(max_queued_tokens)
        # The series of the model it schedules: ``model`` is the served name (default: the backend's).
        self.metrics = (metrics or Metrics()).for_model(model or backend.info.name)
        self.prefix_min_tokens = int(prefix_min_tokens)  # rows count a shared prefix once (0: off)
        self.concurrency = max(1, int(getattr(backend, "concurrency", 1)))
        self._queue: deque[_Item] = deque()
        self._waiting_tokens = 0  # in the queue, not yet in a row: what the packer can still pack
        # Admitted and not yet finished (waiting or in a forward): the admission bound and the
        # packscore_queued_* gauges.
        self._queued_tokens = 0
        self._queued_sequences = 0
        self._pending: set[Ticket] = set()
        self._outstanding_rows = 0  # formed rows not yet finished (waiting for a runner or running)
        self._tasks: list[asyncio.Task] = []
        self._pool: ThreadPoolExecutor | None = None
        self._rate_tokens_per_s: float | None = None
        self._rate_updated = 0.0
        self.last_success_at: float | None = None  # monotonic time of the last successful forward
        self.last_failure: str | None = None  # why the last forward failed for backend reasons
        self._closed = False

    @classmethod
    def from_settings(cls, backend: ScoringBackend, settings, metrics: Metrics | None = None) -> "Scheduler":
        """The scheduler the server and offline scoring build from their ``Settings``: rows of
        the backend's ``max_row_tokens`` (a sequence-parallel group takes sp times the per-GPU
        budget), else of ``--max-batch-tokens``."""
        return cls(
            backend,
            max_batch_tokens=getattr(backend, "max_row_tokens", settings.max_batch_tokens),
            max_wait_ms=settings.max_wait_ms,
            max_queued_tokens=settings.queued_tokens,
            metrics=metrics,
            model=settings.served_model_name or backend.info.name,
            prefix_min_tokens=getattr(settings, "prefix_min_tokens_in_use", 0),
        )

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._rows: asyncio.Queue[list[_Item]] = asyncio.Queue()  # bounded by _outstanding_rows
        self._results: asyncio.Queue[tuple[list[_Item], list[SequenceScores]]] = asyncio.Queue(
            maxsize=2 * self.concurrency
        )
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="packscore-forward")
        self._tasks = [asyncio.create_task(self._pack_loop(), name="packscore-packer")]
        self._tasks += [asyncio.create_task(self._run_loop(), name=f"packscore-runner-{i}") for i in range(self.concurrency)]
        self._tasks.append(asyncio.create_task(self._dispatch_loop(), name="packscore-dispatcher"))

    async def close(self, reason: str = "the server is shutting down") -> None:
        """Fails whatever is still pending with 503 and stops the pipeline."""
        self._closed = True
        for ticket in list(self._pending):
            self.fail(ticket, ApiError(503, "unavailable", f"{reason[0].upper()}{reason[1:]}; retry.", headers={"Retry-After": "1"}))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pool is not None:
            # A forward already running in a thread cannot be interrupted; do not wait for it.
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission ---------------------------------------------------------------------------

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def queued_sequences(self) -> int:
        return self._queued_sequences

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    def retry_after_s(self, tokens: int = 0) -> int:
        """Whole seconds until ``tokens`` more would likely fit, from the recent throughput (1..60)."""
        rate = self._rate_tokens_per_s
        excess = self._queued_tokens + tokens - self.max_queued_tokens
        if not rate or excess <= 0:
            return 1
        return int(min(60, max(1, math.ceil(excess / (rate * self.concurrency)))))

    def submit(self, sequences: Sequence[SequenceInput], *, deadline: float | None = None, probe: bool = False) -> Ticket:
        """Admits a validated request, or raises ApiError 429 (queue full) / 503 (closed).

        ``probe`` (the readiness pass) goes to the head of the queue and is not counted against
        the admission bound: a busy server is still a ready one.
        """
        if self._closed:
            raise ApiError(503, "unavailable", "The server is shutting down; retry.", headers={"Retry-After": "1"})
        ticket = Ticket(sequences, deadline, self._loop)
        if not probe and self._queued_tokens + ticket.tokens > self.max_queued_tokens:
            retry = self.retry_after_s(ticket.tokens)
            raise ApiError(
                429,
                "queue_full",
                f"The admission queue is full ({self._queued_tokens} of {self.max_queued_tokens} tokens queued); "
                f"retry in {retry} s.",
                headers={"Retry-After": str(retry)},
            )
        now = time.monotonic()
        ticket.items = [_Item(ticket, i, seq, now) for i, seq in enumerate(ticket.sequences)]
        if probe:
            self._queue.extendleft(reversed(ticket.items))
        else:
            self._queue.extend(ticket.items)
        self._waiting_tokens += ticket.tokens
        self._queued_tokens += ticket.tokens
        self._queued_sequences += len(ticket.items)
        self._pending.add(ticket)
        self._wake.set()
        return ticket

    def fail(self, ticket: Ticket, error: BaseException) -> None:
        """Ends ``ticket`` with ``error`` and drops its sequences that have not started."""
        if ticket.done:
            return
        ticket.future.set_exception(error)
        self._forget(ticket)

    def cancel(self, ticket: Ticket) -> None:
        """The caller has gone (disconnect or deadline): drop its queued sequences."""
        if not ticket.done:
            ticket.future.cancel()
        self._forget(ticket)

    def _forget(self, ticket: Ticket) -> None:
        self._pending.discard(ticket)
        for item in ticket.items:
            if item.queued:
                item.queued = False  # the packer skips it; counters change now so admission frees up
                self._waiting_tokens -= item.tokens
            if not item.started:  # still queued, or in a row that has not started: never runs
                self._release(item)
        self._wake.set()

    def _release(self, item: _Item) -> None:
        if not item.released:
            item.released = True
            self._queued_tokens -= item.tokens
            self._queued_sequences -= 1

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until every admitted request has its answer; False when ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._pending:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # ---- packer ------------------------------------------------------------------------------

    async def _pack_loop(self) -> None:
        while True:
            row = await self._next_row()
            self._outstanding_rows += 1
            self._rows.put_nowait(row)

    def _drop_stale_head(self) -> None:
        now = time.monotonic()
        while self._queue:
            head = self._queue[0]
            if not head.queued:
                self._queue.popleft()
            elif head.ticket.deadline is not None and now >= head.ticket.deadline:
                self.fail(head.ticket, _deadline_error())
            else:
                return

    async def _next_row(self) -> list[_Item]:
        while True:
            self._drop_stale_head()
            timeout = None
            if self._queue:
                head = self._queue[0]
                full = self._waiting_tokens >= self.max_batch_tokens or head.tokens >= self.max_batch_tokens
                now = time.monotonic()
                due = head.enqueued_at + self.max_wait_s
                if full and self._outstanding_rows < 2 * self.concurrency:
                    return self._take_row()
                if not full and now >= due and self._outstanding_rows < self.concurrency:
                    return self._take_row()
                if not full and now < due:
                    timeout = due - now
            # Woken by a new request, a cancellation or a runner that finished a row.
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def _take_row(self) -> list[_Item]:
        budget = self.max_batch_tokens
        head = self._queue.popleft()
        row, run = [head], RowTokens(self.prefix_min_tokens)  # the tokens the row's forward runs
        run.add(head.seq.input_ids)
        kept: list[_Item] = []
        scanned = 0
        while self._queue and run.total < budget and scanned < _LOOKAHEAD:
            item = self._queue.popleft()
            scanned += 1
            if not item.queued:
                continue
            if run.cost_with(item.seq.input_ids) <= budget:
                row.append(item)
                run.add(item.seq.input_ids)
            else:
                kept.append(item)
        self._queue.extendleft(reversed(kept))  # skipped sequences keep their place at the front
        for item in row:
            item.queued = False
            self._waiting_tokens -= item.tokens
        return row

    # ---- runners -----------------------------------------------------------------------------

    async def _run_loop(self) -> None:
        while True:
            row = await self._rows.get()
            try:
                await self._forward(row)
            except Exception:  # never let one row stop a runner; its requests get a 500
                log.exception("unexpected error while scoring a row")
                for item in row:
                    self.fail(item.ticket, ApiError(500, "internal_error", "Scoring failed unexpectedly."))
            finally:
                for item in row:
                    self._release(item)
                self._outstanding_rows -= 1
                self._wake.set()

    async def _forward(self, row: list[_Item]) -> None:
        row = [item for item in row if not item.ticket.done]
        if not row:
            return
        started = time.monotonic()
        for item in row:
            if not item.started:  # a retry after a split is not a second wait
                item.started = True
                self.metrics.queue_wait.observe(started - item.enqueued_at)
        try:
            scores = await self._loop.run_in_executor(self._pool, self.backend.score_row, [it.seq for it in row])
        except BackendUnavailableError as exc:
            self.last_failure = str(exc) or "backend unavailable"
            log.error("backend unavailable for a row of %d sequences: %s", len(row), exc)
            error = backend_unavailable(f"No scoring worker could take the request: {exc}.", retry_after_s=2)
            for item in row:
                self.fail(item.ticket, error)
            return
        except Exception as exc:
            await self._retry_split(row, exc)
            return
        elapsed = time.monotonic() - started
        tokens = sum(item.tokens for item in row)
        if self.prefix_min_tokens:
            self.metrics.prefix_tokens_saved.inc(tokens_saved([it.seq for it in row], self.prefix_min_tokens))
        self._observe_forward(tokens, elapsed)
        await self._results.put((row, scores))

    async def _retry_split(self, row: list[_Item], exc: Exception) -> None:
        if len(row) > 1:
            # Split by tokens so each half roughly halves the memory the forward needed.
            half, acc, mid = sum(it.tokens for it in row) / 2, 0, 1
            for mid in range(1, len(row)):
                acc += row[mid - 1].tokens
                if acc >= half:
                    break
            log.warning("forward of %d sequences failed (%s); retrying in halves of %d and %d",
                        len(row), _short(exc), mid, len(row) - mid)
            await self._forward(row[:mid])
            await self._forward(row[mid:])
            return
        item = row[0]
        param = f"sequences[{item.index}].input_ids"
        if is_out_of_memory(exc):
            log.warning("sequence of %d tokens does not fit in memory alone: %s", item.tokens, _short(exc))
            error = ApiError(413, "sequence_too_large",
                             f"Sequence {item.index} ({item.tokens} tokens) does not fit in the accelerator's memory.", param)
        elif isinstance(exc, InvalidSequenceError):
            error = ApiError(422, "invalid_value", str(exc), param)
        else:
            log.error("forward of one sequence failed", exc_info=exc)
            error = ApiError(500, "internal_error", f"Scoring failed: {_short(exc)}.")
        self.fail(item.ticket, error)

    def _observe_forward(self, tokens: int, elapsed: float) -> None:
        now = time.monotonic()
        self.last_success_at = now
        self.last_failure = None
        m = self.metrics
        m.forward_seconds.observe(elapsed)
        m.batch_tokens.observe(tokens)
        m.batch_fill_ratio.observe(tokens / self.max_batch_tokens)
        rate = tokens / max(elapsed, 1e-6)
        if self._rate_tokens_per_s is None:
            self._rate_tokens_per_s = rate
        else:
            weight = 0.5 ** ((now - self._rate_updated) / _RATE_HALF_LIFE_S)
            self._rate_tokens_per_s = weight * self._rate_tokens_per_s + (1 - weight) * rate
        self._rate_updated = now

    # ---- dispatcher --------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            row, scores = await self._results.get()
            scored = 0
            for item, result in zip(row, scores):
                ticket = item.ticket
                if ticket.done:
                    continue
                ticket.results[item.index] = result
                ticket.remaining -= 1
                scored += item.seq.num_scored
                if ticket.remaining == 0:
                    self._pending.discard(ticket)
                    ticket.future.set_result(ticket.results)  # type: ignore[arg-type]
            self.metrics.tokens_scored.inc(scored)


def _deadline_error() -> ApiError:
    return ApiError(504, "deadline_exceeded", "deadline_ms passed before the result was ready.", "deadline_ms")


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."
