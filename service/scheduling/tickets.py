"""What an admitted request is while the scheduler holds it: a ``Ticket`` (its sequences, their
results as they arrive, and the future the caller awaits) and one ``QueuedSequence`` per sequence,
the unit that rows are packed from."""

from __future__ import annotations

import asyncio
from typing import Sequence

from model_runtime.scoring.prefix import head_key
from model_runtime.types import SequenceInput, SequenceScores
from service.http import request_id


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
        self.items: list[QueuedSequence] = []
        self.quiet = False  # arrived after a quiet spell: its row need not wait to fill
        self.probe = False  # the readiness pass: scored like a request, not counted as traffic
        self.asked_at = 0.0  # time.monotonic() when it asked for room (waiting for it included in its queue wait)
        self.request_id = request_id.current.get()  # for log lines about it, written outside the request's task

    @property
    def done(self) -> bool:
        return self.future.done()

    def deliver(self, index: int, result: SequenceScores) -> bool:
        """Records sequence ``index``'s result; True when that was the last (the future then holds all)."""
        self.results[index] = result
        self.remaining -= 1
        if self.remaining:
            return False
        self.future.set_result(self.results)  # type: ignore[arg-type]
        return True


class QueuedSequence:
    """One queued sequence of a ticket."""

    __slots__ = ("ticket", "index", "seq", "tokens", "group", "enqueued_at", "queued", "started", "released")

    def __init__(self, ticket: Ticket, index: int, seq: SequenceInput, now: float, prefix_min_tokens: int = 0):
        self.ticket = ticket
        self.index = index
        self.seq = seq
        self.tokens = seq.length
        self.group = head_key(seq.input_ids, prefix_min_tokens)  # sequences that may share a prefix have one
        self.enqueued_at = now
        self.queued = True  # False once taken into a row or dropped with its ticket
        self.started = False  # True once its forward began
        self.released = False  # True once it no longer counts against admission (done or dropped)
