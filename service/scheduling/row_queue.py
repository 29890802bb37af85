"""The queue of admitted sequences, and which of them the next row takes.

- Every row starts with the oldest queued sequence, so a big request is never starved; the rest
  of the row is filled largest-first from the queued sequences that arrived within
  ``_LOOKAHEAD_AGE_S`` of that oldest one (whole bursts pack as tightly as offline scoring), a
  group's members (a shared prompt) one after another. With several GPUs, every other row may be
  led by the window's longest sequence that cannot sit beside the oldest (it would otherwise end
  a burst alone on one GPU).
- A row holds at most its budget of tokens, except a longer sequence, which gets a row of its
  own; with prefix sharing, a prefix that sequences of the row share counts once.

When a row is taken and at what budget is the scheduler's call (scheduler.py).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from model_runtime.scoring.prefix import RowTokens
from service.scheduling.rows import largest_first_by_group
from service.scheduling.tickets import QueuedSequence, Ticket

# Which queued sequences may fill the rest of a row: at most this many, arrived at most this
# long after the row's first (oldest) sequence, so newer work cannot overtake older for long.
_LOOKAHEAD = 4096
_LOOKAHEAD_AGE_S = 2.0


class RowQueue:
    """Admitted sequences not yet in a row, oldest first (a readiness probe's ahead of all).

    A sequence taken into a row or dropped with its request is marked (``queued = False``) and
    leaves the deque lazily. ``row_tokens`` is the full row budget, ``gpus`` the forwards that run
    at once, ``prefix_min_tokens`` the shortest prefix that rows count once (0: off).
    """

    def __init__(self, *, row_tokens: int, gpus: int, prefix_min_tokens: int):
        self.row_tokens = row_tokens
        self.gpus = gpus
        self.prefix_min_tokens = prefix_min_tokens
        self.waiting_tokens = 0  # in the queue, not yet in a row: what the packer can still pack
        self._items: deque[QueuedSequence] = deque()
        self._long_turn = False  # the next row may be led by a long sequence (_long_lead)

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def head(self) -> QueuedSequence:
        return self._items[0]

    def push(self, items: Sequence[QueuedSequence], *, front: bool = False) -> None:
        """Queues a request's sequences behind the others, or ahead of all (``front``: a probe)."""
        if front:
            self._items.extendleft(reversed(items))
        else:
            self._items.extend(items)
        self.waiting_tokens += sum(item.tokens for item in items)

    def drop(self, item: QueuedSequence) -> None:
        """``item`` leaves the queue unrun (its request ended); the packer skips it."""
        if item.queued:
            item.queued = False
            self.waiting_tokens -= item.tokens

    def expired_head(self, now: float) -> Ticket | None:
        """Clears sequences that already left from the head; the oldest one's ticket when its
        deadline has passed (the caller fails it, which drops its sequences), else None."""
        while self._items:
            head = self._items[0]
            if not head.queued:
                self._items.popleft()
            elif head.ticket.deadline is not None and now >= head.ticket.deadline:
                return head.ticket
            else:
                return None
        return None

    def deadline_due(self) -> float:
        """When a row must start for the queued sequences' deadlines: batching may spend at most
        half of what a sequence had left when queued (a partial row waits up to ``max_wait_s``)."""
        return min((it.enqueued_at + (it.ticket.deadline - it.enqueued_at) / 2 for it in self._items
                    if it.queued and it.ticket.deadline is not None), default=float("inf"))

    def take_row(self, rounding, budget: int | None = None) -> list[QueuedSequence]:
        """The next row (of ``budget`` tokens, default the full budget; ``rounding`` the backend's
        ``RowRounding`` or None): led by the oldest queued sequence, or every other row by a long
        one (``_long_lead``), then the largest that still fit among those queued within
        ``_LOOKAHEAD_AGE_S`` of the oldest (first-fit decreasing on a bounded window), a group's
        members one after another (``largest_first_by_group``)."""
        budget = budget or self.row_tokens
        head = self._items[0]
        horizon = head.enqueued_at + _LOOKAHEAD_AGE_S
        window: list[QueuedSequence] = []
        for item in self._items:
            if len(window) >= _LOOKAHEAD or item.enqueued_at > horizon:
                break
            if item.queued:
                window.append(item)
        lead = head
        if self._long_turn:
            lead = self._long_lead(head, window, rounding)
        self._long_turn = self.gpus > 1 and lead is head  # a long lead never follows a long lead
        row, run = [lead], RowTokens(self.prefix_min_tokens, rounding)  # the tokens the row's forward runs
        run.add(lead.seq.input_ids)
        for item in largest_first_by_group([it for it in window if it is not lead], lead):
            if run.total >= budget:
                break
            if run.add(item.seq.input_ids, budget):
                row.append(item)
        for item in row:
            item.queued = False  # the deque drops them lazily (see expired_head)
            self.waiting_tokens -= item.tokens
        if row == [head]:
            self._items.popleft()
        else:
            self._items = deque(item for item in self._items if item.queued)
        return row

    def _long_lead(self, head: QueuedSequence, window: list[QueuedSequence], rounding) -> QueuedSequence:
        """The longest sequence of ``window``, longer than ``head`` and too long to sit beside it
        in a row (in arrival order it would end a burst alone on one GPU), else ``head``; always
        ``head`` when its request is a probe or has a deadline. The oldest waits one row at most."""
        if head.ticket.probe or head.ticket.deadline is not None:
            return head
        run = RowTokens(self.prefix_min_tokens, rounding)
        run.add(head.seq.input_ids)
        too_long = [it for it in window  # longer than the oldest: shorter work never jumps ahead
                    if it.tokens > head.tokens and run.cost_with(it.seq.input_ids) > self.row_tokens]
        return max(too_long, key=lambda it: it.tokens, default=head)  # ties: the older
