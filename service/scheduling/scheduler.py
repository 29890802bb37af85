"""Dynamic batching: admitted requests are split into sequences, packed into forwards, reassembled.

Pipeline (asyncio tasks joined by bounded hand-offs, forwards in a thread pool):

    submit() -> FIFO of sequences -> packer -> rows -> runner x concurrency -> results -> dispatcher
                                                         (backend.score_row in a thread)

- Admission (admission.py): the queue holds a few seconds of measured work per GPU; a request
  over that waits here for room (up to its deadline or ``--max-admission-wait-s``) before 429.
- Which queued sequences a row takes (row_queue.py): the oldest first, then the largest that fit
  among those that arrived soon after it, a group's members together, up to ``max_batch_tokens``.
  With several GPUs, once nothing more is coming and less than a full row per GPU is queued, the
  last rows are sized so that every GPU ends together.
- A full row is formed as soon as there are enough tokens, even while every runner is busy, so
  the next forward is ready before the current one ends (one prefetched row per runner). A
  partial row waits up to ``max_wait_ms`` after its oldest sequence arrived, and only closes
  once some runner is idle: while all are busy, waiting costs nothing and fills the row. A
  request that arrives after a quiet spell (no other request for ``_QUIET_S``) does not wait:
  nothing is coming to fill its row, and an idle request's latency is the forward's alone.
- A forward that fails is retried split in halves, down to single sequences (forward_failures.py);
  only the requests owning a sequence that fails alone fail (413 when it does not fit in memory).
  A backend that is unavailable fails the row's requests with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from typing import Callable, Sequence

from model_runtime.scoring.backend import BackendUnavailableError, ScoringBackend
from model_runtime.scoring.prefix import tokens_saved
from model_runtime.types import SequenceInput, SequenceScores
from model_runtime.wording import counted
from service.http import request_id
from service.http.errors import ApiError, backend_unavailable, deadline_error
from service.http.metrics import Metrics
from service.scheduling.admission import Admission, QueueFullError, SharedCapacity
from service.scheduling.forward_failures import row_requests, sequence_error, short, split_point
from service.scheduling.forward_thread import ForwardThread, forward_state
from service.scheduling.row_queue import RowQueue
from service.scheduling.rows import tail_row_tokens
from service.scheduling.tickets import QueuedSequence, Ticket

log = logging.getLogger(__name__)

_QUIET_S = 0.05  # a request after this long without another one starts at once
_FLOOR_ROWS = 3.0  # the admission bound never holds fewer full rows per GPU (running, prefetched, filling)


class Scheduler:
    def __init__(
        self,
        backend: ScoringBackend,
        *,
        max_batch_tokens: int,
        max_wait_ms: float,
        max_queued_tokens: int,
        queue_seconds: float | None = None,
        max_admission_wait_s: float = 0.0,
        metrics: Metrics | None = None,
        model: str | None = None,
        prefix_min_tokens: int = 0,
        shared: SharedCapacity | None = None,
    ):
        self.backend = backend
        self._shared = shared
        if shared is not None:
            shared.schedulers.append(self)
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_queued_tokens = int(max_queued_tokens)
        # The series of the model it schedules: ``model`` is the served name (default: the backend's).
        self.metrics = (metrics or Metrics()).for_model(model or backend.info.name)
        self.prefix_min_tokens = int(prefix_min_tokens)  # rows count a shared prefix once (0: off)
        self.concurrency = max(1, int(getattr(backend, "concurrency", 1)))
        self._pins_groups = bool(getattr(backend, "pins_groups", False))  # score_row(..., group=) runs on that group
        if shared is not None and shared.admission is not None:
            self.admission = shared.admission  # one bound for every served model
        else:
            self.admission = Admission(gpus=self.concurrency, row_tokens=self.max_batch_tokens, queue_seconds=queue_seconds,
                                       floor_rows=_FLOOR_ROWS, max_tokens=self.max_queued_tokens,
                                       max_wait_s=max_admission_wait_s)
            if shared is not None:
                shared.admission = self.admission
        self._last_arrival = float("-inf")
        self._queue = RowQueue(row_tokens=self.max_batch_tokens, gpus=self.concurrency,
                               prefix_min_tokens=self.prefix_min_tokens)
        # Admitted and not yet finished (waiting or in a forward): the admission bound and the
        # packscore_queued_* gauges.
        self._queued_tokens = 0
        self._queued_sequences = 0
        self._pending: set[Ticket] = set()
        self._outstanding_rows = 0  # formed rows not yet finished (waiting for a runner or running)
        self._unstarted: deque[int] = deque()  # tokens of the formed rows no runner has taken yet, in order
        self._taken: dict[ForwardThread, tuple[float, int]] = {}  # a runner's row: when taken, its tokens
        self._tasks: list[asyncio.Task] = []
        self._threads: list[ForwardThread] = []
        self.last_success_at: float | None = None  # monotonic time of the last successful forward
        self.last_failure: str | None = None  # why the last forward failed for backend reasons
        self._closed = False
        self._closed_reason = "the server is shutting down"

    @property
    def prefix_rounding(self):
        """The backend's ``RowRounding`` (measured at its warm-up), so that rows count a shared
        prefix as the backend will run it; None where the backend has none."""
        return getattr(self.backend, "prefix_rounding", None)

    @classmethod
    def from_settings(cls, backend: ScoringBackend, settings, metrics: Metrics | None = None,
                      shared: SharedCapacity | None = None, model: str | None = None) -> "Scheduler":
        """The scheduler the server and offline scoring build from their ``Settings``: rows of
        the backend's ``max_row_tokens`` (a sequence-parallel group takes sp times the per-GPU
        budget), else of ``--max-batch-tokens``."""
        return cls(
            backend,
            max_batch_tokens=getattr(backend, "max_row_tokens", settings.max_batch_tokens),
            max_wait_ms=settings.max_wait_ms,
            max_queued_tokens=settings.queued_tokens,
            queue_seconds=settings.queue_seconds,
            max_admission_wait_s=settings.max_admission_wait_s,
            metrics=metrics,
            model=model or settings.served_model_name or backend.info.name,
            prefix_min_tokens=getattr(settings, "prefix_min_tokens_in_use", 0),
            shared=shared,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._rows: asyncio.Queue[list[QueuedSequence]] = asyncio.Queue()  # bounded by _outstanding_rows
        self._results: asyncio.Queue[tuple[list[QueuedSequence], list[SequenceScores]]] = asyncio.Queue(2 * self.concurrency)
        self._threads = [ForwardThread(f"packscore-forward-{i}") for i in range(self.concurrency)]
        self._tasks = [asyncio.create_task(self._pack_loop(), name="packscore-packer")]
        self._tasks += [asyncio.create_task(self._run_loop(thread), name=f"packscore-runner-{i}")
                        for i, thread in enumerate(self._threads)]
        self._tasks.append(asyncio.create_task(self._dispatch_loop(), name="packscore-dispatcher"))

    async def run_on_forward_thread(self, fn: Callable):
        """``fn()`` on the first forward thread, where the forwards run: state a backend keeps
        per thread (cuDNN caches its attention plans per thread) is then built where it is read."""
        return await self._threads[0].run(fn)

    def stop_admitting(self, error: ApiError) -> None:
        """Requests still waiting for room get ``error`` (a drain began); admitted ones run on."""
        self.admission.close(error)

    async def close(self, reason: str = "the server is shutting down") -> None:
        """Fails whatever is still pending with 503 and stops the pipeline."""
        self._closed = True
        self._closed_reason = reason
        error = _closed_error(reason)
        self.admission.close(error)
        for ticket in list(self._pending):
            self.fail(ticket, error)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for thread in self._threads:
            thread.stop()  # a forward already running cannot be interrupted: its thread is a daemon

    @property
    def closed_reason(self) -> str | None:
        """Why ``close`` stopped this scheduler (the server stopping), None while it is open."""
        return self._closed_reason if self._closed else None

    # ---- admission ---------------------------------------------------------------------------

    @property
    def forward_running(self) -> bool:
        """Whether a forward is still under way on one of this scheduler's threads."""
        return any(thread.running for thread in self._threads)

    @property
    def threads_alive(self) -> bool:
        """Whether one of this scheduler's forward threads still runs (after ``close``: until it has ended)."""
        return any(thread.alive for thread in self._threads)

    def threads_ended(self, timeout: float) -> bool:
        """After ``close``: waits up to ``timeout`` for this scheduler's forward threads to end; False at once
        when one runs a forward, or when one is still alive at the timeout (one that took a row just before
        the close has not marked its forward started yet)."""
        deadline = time.monotonic() + timeout
        while self.threads_alive:
            if self.forward_running or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def forward_state(self) -> str:
        """``"idle"``, ``"busy"`` or ``"stalled"``: how this scheduler's forwards stand
        (``forward_thread.forward_state``), what /readyz reports while its probe waits."""
        return forward_state(self._threads)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def queued_sequences(self) -> int:
        return self._queued_sequences

    @property
    def pending_requests(self) -> int:
        """Clients' requests admitted and not yet answered; a readiness pass's ticket is the server's own, not one."""
        return sum(not ticket.probe for ticket in self._pending)

    def pending_request_ids(self) -> str:
        """The ids of the requests still pending, for a log line about them all (``a, b and N more``)."""
        return request_id.of_many(ticket.request_id for ticket in self._pending if not ticket.probe)

    def retry_after_s(self, tokens: int = 0) -> int:
        """Whole seconds after which ``tokens`` more would likely fit (1..60)."""
        return self.admission.retry_after_s(tokens)

    def submit(self, sequences: Sequence[SequenceInput], *, deadline: float | None = None, probe: bool = False) -> Ticket:
        """Admits a validated request now, or raises ApiError 429 (no room now) / 503 (closed).

        ``probe`` (the readiness pass) goes to the head of the queue and is not counted against
        the admission bound: a busy server is still a ready one.
        """
        self._check_open()
        tokens = sum(s.length for s in sequences)
        if probe:
            self.admission.force(tokens)
        elif not self.admission.try_admit(tokens):
            raise _queue_full(self.admission.refusal(tokens))
        return self._enqueue(sequences, deadline, probe)

    async def submit_when_room(self, sequences: Sequence[SequenceInput], *, deadline: float | None = None) -> Ticket:
        """Admits a validated request, waiting for room up to its deadline or the server's
        maximum wait; raises ApiError 429 when the queue stayed full, 503 when closed."""
        self._check_open()
        tokens = sum(s.length for s in sequences)
        asked_at = time.monotonic()
        timeout = None if deadline is None else deadline - asked_at
        try:
            await self.admission.admit(tokens, timeout)
        except QueueFullError as exc:
            # Its own deadline ended the wait (the event loop's timer may fire a hair early): 504,
            # not a 429 that a client would retry past its deadline.
            if deadline is not None and time.monotonic() >= deadline - 0.005:
                raise deadline_error() from None
            raise _queue_full(exc) from None
        if self._closed:
            self.admission.release(tokens)
            self._check_open()
        return self._enqueue(sequences, deadline, False, asked_at)

    def _check_open(self) -> None:
        if self._closed:
            raise _closed_error(self._closed_reason)

    def _enqueue(self, sequences: Sequence[SequenceInput], deadline: float | None, probe: bool,
                 asked_at: float | None = None) -> Ticket:
        ticket = Ticket(sequences, deadline, self._loop)
        ticket.probe = probe
        now = time.monotonic()
        ticket.asked_at = now if asked_at is None else asked_at
        if not probe:
            ticket.quiet = now - self._last_arrival >= _QUIET_S
            self._last_arrival = now
        ticket.items = [QueuedSequence(ticket, i, seq, now, self.prefix_min_tokens) for i, seq in enumerate(ticket.sequences)]
        self._queue.push(ticket.items, front=probe)
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
            self._queue.drop(item)  # the packer skips it; counters change now so admission frees up
            if not item.started:  # still queued, or in a row that has not started: never runs
                self._release(item)
        self._wake.set()

    def _release(self, item: QueuedSequence) -> None:
        if not item.released:
            item.released = True
            self._queued_tokens -= item.tokens
            self._queued_sequences -= 1
            self.admission.release(item.tokens)

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
            self._unstarted.append(sum(it.tokens for it in row))
            self._rows.put_nowait(row)

    def _drop_stale_head(self) -> None:
        now = time.monotonic()
        while (ticket := self._queue.expired_head(now)) is not None:
            self.fail(ticket, deadline_error())

    async def _next_row(self) -> list[QueuedSequence]:
        while True:
            self._drop_stale_head()
            timeout = None
            if self._queue:
                head = self._queue.head
                full = self._queue.waiting_tokens >= self.max_batch_tokens or head.tokens >= self.max_batch_tokens
                now = time.monotonic()
                due = head.enqueued_at + (0.0 if head.ticket.quiet else self.max_wait_s)
                if not full and now < due:
                    due = min(due, self._queue.deadline_due())
                tail = self._tail_row_tokens(now)
                if tail is not None:  # the last of the work: a row for each idle GPU, sized to end together
                    if self._outstanding_rows < self.concurrency:
                        return self._queue.take_row(self.prefix_rounding, tail)
                elif full and self._outstanding_rows < 2 * self.concurrency:
                    return self._queue.take_row(self.prefix_rounding)
                if not full and now >= due and self._outstanding_rows < self.concurrency:
                    return self._queue.take_row(self.prefix_rounding)
                if tail is None and not full and now < due:
                    timeout = due - now
            # Woken by a new request, a cancellation or a runner that finished a row.
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            if self._closed:  # Python 3.11's wait_for drops a cancel that lands as the wake is set: close() hung
                raise asyncio.CancelledError

    def _tail_row_tokens(self, now: float) -> int | None:
        """The next row's size when the queue is the last of the work (no request for ``_QUIET_S``,
        none waiting for room, less than a full row per GPU: ``rows.tail_row_tokens``), else None.
        None on one GPU, in a pool shared by several models, or before a rate was measured."""
        rate = self.admission.rate
        if (self.concurrency == 1 or self._shared is not None or not rate or self.admission.waiting
                or now - self._last_arrival < _QUIET_S):
            return None
        # Counted here, not from the forward threads: rows formed back to back, or taken by a runner
        # whose thread has not started them yet, are the GPUs' load too (else each row came out smaller).
        taken = [self._taken.get(thread) for thread in self._threads]
        return tail_row_tokens(self._queue.waiting_tokens, self.max_batch_tokens, taken, self._unstarted, rate, now)

    # ---- runners -----------------------------------------------------------------------------

    async def _run_loop(self, thread: "ForwardThread") -> None:
        while True:
            row = await self._rows.get()
            self._taken[thread] = (time.monotonic(), self._unstarted.popleft())
            try:
                await self._forward(row, thread)
            except Exception:  # never let one row stop a runner; its requests get a 500
                log.exception("unexpected error while scoring a row (%s)", row_requests(row))
                for item in row:
                    self.fail(item.ticket, ApiError(500, "internal_error", "Scoring failed unexpectedly."))
            finally:
                for item in row:
                    self._release(item)
                self._outstanding_rows -= 1
                del self._taken[thread]
                self._wake.set()

    async def _forward(self, row: list[QueuedSequence], thread: "ForwardThread") -> None:
        try:
            async with self._shared.lane() if self._shared is not None else contextlib.nullcontext() as lane:
                # Not started until another model's forward leaves the slot: a request that ended meanwhile never runs.
                row = [item for item in row if not item.ticket.done]
                if not row:
                    return
                started = time.monotonic()
                for item in row:
                    if not item.started:  # a retry after a split is not a second wait
                        item.started = True
                        # From when its request asked for room: under overload the wait is in the admission line.
                        self.metrics.queue_wait.observe(started - item.ticket.asked_at)
                rate = self.admission.rate
                thread.expected_s = sum(it.tokens for it in row) / rate if rate else None  # for forward_state
                # With several models, on the group (GPUs) of its lane, not the backend's own first idle one;
                # a lane past a smaller pool's groups is none of its GPUs: that pool picks
                pinned = lane is not None and self._pins_groups and lane < self.concurrency
                score = functools.partial(self.backend.score_row, group=lane) if pinned else self.backend.score_row
                scores = await thread.run(score, [it.seq for it in row])
        except BackendUnavailableError as exc:
            self.last_failure = str(exc) or "backend unavailable"
            log.error("backend unavailable for a row of %s (%s): %s", counted(len(row), "sequence"),
                      row_requests(row), exc)
            error = backend_unavailable(f"No scoring worker could take the request: {exc}.", retry_after_s=2)
            for item in row:
                self.fail(item.ticket, error)
            return
        except Exception as exc:
            await self._retry_split(row, exc, thread)
            return
        elapsed = time.monotonic() - started
        tokens = sum(item.tokens for item in row)
        seqs = [it.seq for it in row]
        saved = tokens_saved(seqs, self.prefix_min_tokens, self.prefix_rounding) if self.prefix_min_tokens else 0
        self.metrics.prefix_tokens_saved.inc(saved)
        self._observe_forward(tokens, tokens - saved, elapsed)
        await self._results.put((row, scores))

    async def _retry_split(self, row: list[QueuedSequence], exc: Exception, thread: "ForwardThread") -> None:
        if len(row) > 1:
            mid = split_point(row)
            log.warning("forward of %d sequences (%s) failed (%s); retrying in halves of %d and %d",
                        len(row), row_requests(row), short(exc), mid, len(row) - mid)
            await self._forward(row[:mid], thread)
            await self._forward(row[mid:], thread)
            return
        self.fail(row[0].ticket, sequence_error(row[0], exc))

    def _observe_forward(self, tokens: int, run: int, elapsed: float) -> None:
        """A row of ``tokens`` admitted tokens ran ``run`` of them (a shared prefix once) in ``elapsed`` s."""
        now = time.monotonic()
        self.last_success_at = now
        self.last_failure = None
        m = self.metrics
        m.forward_seconds.observe(elapsed)
        # What the row ran, as the budget counts it: the admitted tokens would put a shared row above 1.
        m.batch_tokens.observe(run)
        m.batch_fill_ratio.observe(run / self.max_batch_tokens)
        self.admission.observe(tokens, elapsed)  # its rate drains the queue, which counts admitted tokens

    # ---- dispatcher --------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            row, scores = await self._results.get()
            for item, result in zip(row, scores):
                ticket = item.ticket
                if not ticket.done and ticket.deliver(item.index, result):
                    self._pending.discard(ticket)


def _closed_error(reason: str) -> ApiError:
    # API.md: a 503 while draining carries Connection: close, so a keep-alive client reconnects elsewhere.
    return ApiError(503, "unavailable", f"{reason[0].upper()}{reason[1:]}; retry.",
                    headers={"Retry-After": "1", "Connection": "close"})


def _queue_full(exc: QueueFullError) -> ApiError:
    return ApiError(429, "queue_full", str(exc), headers={"Retry-After": str(exc.retry_after_s)})

