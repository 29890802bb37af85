"""What the pool waits for from its workers, and how their replies become results or errors.

``Pending`` is one row (or idle step, or weights command) awaiting its reply; ``reply_error``
classifies a worker's ``Failure``; ``split_reply`` cuts a ``RowResult`` into per-sequence scores;
``agreed_rounding`` is the row rounding every worker's ``Hello`` measured.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from model_runtime.pool import messages as msg
from model_runtime.scoring.head import HeadOutput
from model_runtime.scoring.rows import split_results
from model_runtime.types import InvalidSequenceError, SequenceInput, SequenceScores


@dataclass
class Pending:
    """One row (or idle step) waiting for its group leader's reply, or a weights command waiting
    for every rank's (``ranks`` replies, collected in ``replies``)."""

    request_id: int
    generation: int
    deadline: float  # time.monotonic() after which the world is considered hung
    done: threading.Event = field(default_factory=threading.Event)
    reply: msg.RowResult | None = None
    error: BaseException | None = None
    ranks: int = 1
    replies: list = field(default_factory=list)
    # A weights load's ranks: rank -> (when it last said anything, when its bytes read last grew, those bytes).
    progress: dict[int, tuple[float, float, int]] | None = None
    _settling: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def settle(self, reply=None, error=None) -> None:
        # The reader and a world's failure may settle one row at once: the first settles it whole.
        with self._settling:
            if not self.done.is_set():
                self.reply, self.error = reply, error
                self.done.set()

    def progressed(self, rank: int, bytes_read: int) -> None:
        """Rank ``rank``'s ``LoadProgress`` (the reader's thread alone writes and reads ``progress``)."""
        now = time.monotonic()
        _, grew, before = self.progress.get(rank, (now, now, 0))
        self.progress[rank] = (now, now if bytes_read > before else grew, max(before, bytes_read))

    def add(self, reply) -> None:
        """One rank's answer; settled once every rank has answered."""
        self.replies.append(reply)
        if len(self.replies) == self.ranks:
            self.settle(reply=self.replies)


@dataclass(frozen=True)
class Swap:
    """A swap for the stepper to send to every rank between two steps (FSDP lockstep)."""

    frame: bytes
    pending: Pending


def reply_error(failure: msg.Failure) -> BaseException:
    if failure.kind == "oom":
        return torch.OutOfMemoryError(f"out of memory in a worker: {failure.message}")
    if failure.kind == "invalid":
        return InvalidSequenceError(failure.message, "sequences")
    return RuntimeError(f"worker failure: {failure.message}")


def split_reply(sequences: Sequence[SequenceInput], reply: msg.RowResult) -> list[SequenceScores]:
    k = reply.top_k
    head = HeadOutput(
        torch.from_numpy(msg._array(reply.logprobs, msg.FLOAT)),
        torch.from_numpy(msg._array(reply.entropy, msg.FLOAT)),
        torch.from_numpy(msg._array(reply.top_k_ids, msg.IDS).reshape(-1, k).astype(np.int64)) if k else None,
        torch.from_numpy(msg._array(reply.top_k_logprobs, msg.FLOAT).reshape(-1, k)) if k else None,
    )
    expected = sum(s.num_scored for s in sequences)
    if head.logprobs_N.shape[0] != expected:
        raise RuntimeError(f"worker returned {head.logprobs_N.shape[0]} positions for a row with {expected}")
    results = split_results(sequences, head, k)
    for r in results:
        r.weights_version = reply.weights_version
    return results


def agreed_rounding(hellos: list[msg.Hello]):
    """The ``RowRounding`` every worker measured, which the scheduler's row costing follows; None
    where none was measured. Ranks that measured different tables would cut groups differently
    from the scheduler's costing, so they refuse to serve."""
    from model_runtime.scoring.rounding import RowRounding

    tables = {(h.prefix_max_rows, tuple(tuple(r) for r in h.prefix_runs)) for h in hellos}
    if len(tables) > 1:
        raise RuntimeError("the workers measured different narrow-product rounding tables (GPUs of several kinds?); "
                           "serve them without --prefix-sharing")
    max_rows, runs = tables.pop()
    return RowRounding.from_runs(runs, max_rows) if max_rows else None
