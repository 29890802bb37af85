"""What a failed forward means for its requests: the scheduler retries a failing row in two
halves split by tokens (``split_point``), down to single sequences, and a sequence that fails
alone answers its own request (``sequence_error``): 413 when it does not fit in memory, 422 when
the backend finds it invalid, else 500. Log lines about a whole row name its requests
(``row_requests``)."""

from __future__ import annotations

import logging
from typing import Sequence

from model_runtime.types import InvalidSequenceError
from service.http import request_id
from service.http.errors import ApiError, is_out_of_memory
from service.scheduling.tickets import QueuedSequence

log = logging.getLogger(__name__)


def split_point(row: Sequence[QueuedSequence]) -> int:
    """Where a failing row of two or more sequences splits for its retry: by tokens, so that each
    half roughly halves the memory the forward needed."""
    half, acc, mid = sum(it.tokens for it in row) / 2, 0, 1
    for mid in range(1, len(row)):
        acc += row[mid - 1].tokens
        if acc >= half:
            break
    return mid


def sequence_error(item: QueuedSequence, exc: BaseException) -> ApiError:
    """The answer of ``item``'s request when its forward failed with ``exc`` on it alone."""
    param = f"sequences[{item.index}].input_ids"
    if is_out_of_memory(exc):
        log.warning("sequence of %d tokens does not fit in memory alone: %s", item.tokens, short(exc),
                    extra=request_id.for_request(item.ticket.request_id))
        return ApiError(413, "sequence_too_large",
                        f"Sequence {item.index} ({item.tokens} tokens) does not fit in the accelerator's memory.", param)
    if isinstance(exc, InvalidSequenceError):
        return ApiError(422, "invalid_value", str(exc), param)
    log.error("forward of one sequence failed", exc_info=exc, extra=request_id.for_request(item.ticket.request_id))
    return ApiError(500, "internal_error", f"Scoring failed: {short(exc)}.")


def row_requests(row: Sequence[QueuedSequence]) -> str:
    """What a log line about a whole row names (each of its requests got its own answer): ``requests a, b``,
    and ``the readiness pass`` where it is in the row, as that pass has no request id."""
    named = request_id.of_many(item.ticket.request_id for item in row if not item.ticket.probe)
    probe = any(item.ticket.probe for item in row)
    if not named:
        return "the readiness pass" if probe else "no request id"
    return f"requests {named}" + (" and the readiness pass" if probe else "")


def short(exc: BaseException) -> str:
    """The first line of ``exc`` with its type, at most 200 characters: for a log line or a message."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."
