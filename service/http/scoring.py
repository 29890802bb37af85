"""POST /score (alias /v1/score): the body read and validated, the request admitted and waited
for, every sequence scored by one weights version (re-scored where a swap fell between its rows),
and the answer in the encoding the client asked for."""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from model_runtime.types import SequenceInput, SequenceScores
from model_runtime.wording import counted
from service.http.encoding import CONTENT_TYPE, decode_body, encode_score_response, request_encoding, response_encoding
from service.http.encoding import non_finite_score, result_record
from service.http.errors import ApiError, backend_unavailable, body_too_large, deadline_error, draining_error
from service.http.errors import non_finite_error, restart_failed
from service.http.errors import short_repr
from service.http.protocol import PROTOCOL_ANSWER
from service.http.rollout import mismatch
from service.http.validation import Limits, ScoreJob, parse_score_request
from service.http.wire import BODY_REFUSED, declared_length
from service.runtime import ServedModel, Service
from service.scheduling.scheduler import Scheduler
from service.scheduling.tickets import Ticket
from service.weights_record import describe_withheld

log = logging.getLogger(__name__)

# Re-scores of a request that straddled a weight swap before it holds the model's updates off
# (the last re-score then sees one version): the common single swap costs no update any wait.
_HOLD_FROM_RESCORE = 2
_DAY_MS = 86_400_000
# In the ASGI scope: when the request reached the app (the gate), before its body was read; deadline_ms counts from it.
ARRIVED = "packscore.arrived"
CLIENT_CLOSED = 499  # nginx's convention for "the client went away before the answer"
# Bodies larger than this are decoded and validated in a thread, so that the event loop keeps
# answering (/healthz, other requests) meanwhile; smaller ones cost less than the hand-off.
_DECODE_INLINE_BYTES = 256 << 10


def not_ready(service: Service) -> ApiError:
    if service.phase == "draining":
        return draining_error()
    if service.phase == "awaiting_weights":
        return ApiError(503, "not_ready", f"The server is not ready: {describe_withheld(service.withheld, full=True)}.",
                        headers={"Retry-After": "5"})
    return ApiError(503, "not_ready", f"The model is not ready yet ({service.phase.replace('_', ' ')}).",
                    headers={"Retry-After": "5"})


async def score_request(request: Request, service: Service) -> Response:
    """POST /score: the body read and validated, the request admitted, scored by one weights
    version and answered in the encoding ``Accept`` names."""
    arrived = request.scope.get(ARRIVED) or time.monotonic()  # before the body is read
    limits = service.limits
    if service.phase != "ready" or service.scheduler is None or limits is None:
        raise not_ready(service)
    in_encoding = request_encoding(request.headers.get("content-type"), request.headers.get("content-encoding"))
    try:
        raw = await read_body(request, limits.max_request_bytes, service)
        served = {name: m.limits for name, m in service.models.items()}
        if len(raw) > _DECODE_INLINE_BYTES:
            job = await asyncio.to_thread(_parse, raw, in_encoding, served, service.aliases)
        else:
            job = _parse(raw, in_encoding, served, service.aliases)
    except ApiError as exc:
        _add_limits(exc, limits)
        raise
    model = service.models[job.model]
    limits = model.limits
    if service.phase != "ready":  # SIGTERM while the body was being read
        raise not_ready(service)
    if job.weights_version is not None and job.weights_version != model.backend.info.weights_version:
        raise _version_mismatch(job.weights_version, model)
    if not model.backend.is_alive():  # a worker died: answer now instead of failing in the queue
        if (failed := restart_failed(model.backend)) is not None:  # the restart itself fails
            raise failed
        raise backend_unavailable("A scoring worker is down; retry shortly.", retry_after_s=5)
    # From the request's arrival, not from the end of its body: a large body on a slow link spends the
    # trainer's time too. Capped at a day: an unbounded integer must not overflow the clock arithmetic.
    deadline = arrived + min(job.deadline_ms, _DAY_MS) / 1000.0 if job.deadline_ms is not None else None
    if deadline is not None and (job.deadline_ms == 0 or time.monotonic() >= deadline):
        raise deadline_error()  # no result is ready in time: a trainer out of time gets what a late one gets
    service.inflight += 1
    try:
        try:
            scored = await _score_with_one_version(request, model, job, deadline)
        except ApiError as exc:  # a sequence found too large for memory in the queue
            _add_limits(exc, limits)
            raise
        if scored is None:
            service.metrics.rejections.labels(reason="client_disconnected").inc()
            return Response(status_code=CLIENT_CLOSED)
        # Several Accept lines are one list (RFC 9110 section 5.3), as a proxy may have split it
        out_encoding = response_encoding(", ".join(request.headers.getlist("accept")), in_encoding)
        body = _score_body(job, *scored, service)
        # Counted at the answer: a request that failed, timed out or lost its client after some rows returned nothing.
        service.metrics.tokens_scored.labels(model=job.model).inc(job.scored_tokens)
        return Response(encode_score_response(body, out_encoding), media_type=CONTENT_TYPE[out_encoding],
                        headers=limits.headers())
    finally:
        service.inflight -= 1


def _add_limits(exc: ApiError, limits: Limits) -> None:
    """Every 413 tells the client the limits it must split under (its model's, where known)."""
    if exc.status == 413:
        exc.headers = {**limits.headers(), **exc.headers}


def _parse(raw: bytes, encoding, served, aliases) -> ScoreJob:
    return parse_score_request(decode_body(raw, encoding), served, aliases=aliases)


def _version_mismatch(pinned: str, model: ServedModel) -> ApiError:
    served = model.backend.info.weights_version
    return ApiError(409, "weights_version_mismatch",
                    f"weights_version {short_repr(pinned)} is not served; {model.name!r} now serves {served!r}.", "weights_version")


async def _score_with_one_version(request: Request, model: ServedModel, job: ScoreJob,
                                  deadline: float | None) -> tuple[list[SequenceScores], str] | None:
    """The job's scores, every one by the same weights version, and that version; None if the
    client went away.

    A weight swap between two of its rows leaves a request scored by two versions: its sequences
    scored by another than the one now served (or the pinned one) are scored again, so no request
    fails because of a swap. Before its second re-score a request holds the model's updates off
    (``_hold_swaps``) until it has its answer: swaps landing faster than it is scored cannot keep
    it from ending. A request scored by one version answers with it, though a swap landed since.
    A pinned request whose version no longer serves gets 409.
    """
    scheduler = model.scheduler
    assert scheduler is not None
    scores: list[SequenceScores | None] = [None] * len(job.sequences)
    todo = list(range(len(job.sequences)))
    held = False
    try:
        for attempt in range(_HOLD_FROM_RESCORE + 1):
            if attempt == _HOLD_FROM_RESCORE:
                await _hold_swaps(model, deadline)
                held = True
                todo, target = _rescore_needed(scores, model, job)  # against what serves now, fixed while held
                if not todo:  # what served while it waited is the version its sequences have
                    return scores, target  # type: ignore[return-value]
            # A re-score goes first and past the admission bound, as the probe: its tokens were admitted.
            got = await _admit_and_wait(request, scheduler, [job.sequences[i] for i in todo], deadline, rescore=attempt > 0)
            if got is None:
                return None
            for i, s in zip(todo, got):
                scores[i] = s
            todo, target = _rescore_needed(scores, model, job)
            if not todo:
                return scores, target  # type: ignore[return-value]
            log.info("%d of %s of a request scored by another version of %s than %s: scoring %s again", len(todo),
                     counted(len(scores), "sequence"), model.name, target, "it" if len(todo) == 1 else "them")
    finally:
        if held:
            model.swap_holds -= 1
    # Not reached while updates start only through update_weights: held, no swap lands during the
    # last re-score. A backend that swapped on its own would end here rather than loop.
    raise ApiError(503, "unavailable", f"The weights of {model.name!r} changed while the request was scored; retry.",
                   headers={"Retry-After": "1"})


def _rescore_needed(scores: list[SequenceScores | None], model: ServedModel, job: ScoreJob) -> tuple[list[int], str]:
    """``(todo, target)``: the version the request must have (the pinned one; else the one that
    scored all its sequences, or where they differ the one now served) and its sequences scored by
    another; 409 for a pinned version that no longer serves and is still needed."""
    served = model.backend.info.weights_version
    versions = {s.weights_version or served for s in scores if s is not None}
    # One version for all that served: its answer, though a swap landed since (scored again, the next
    # swap could land after that too). Not one a failed swap left on some ranks: it never served.
    one = versions.pop() if len(versions) == 1 and None not in scores else None
    target = job.weights_version or (one if one in model.versions_served | {served} else served)
    todo = [i for i, s in enumerate(scores) if s is not None and (s.weights_version or served) != target]
    if todo and target != served:
        raise _version_mismatch(target, model)
    return todo, target


async def _hold_swaps(model: ServedModel, deadline: float | None) -> None:
    """Waits for a running update of ``model`` to end, then keeps any other from starting until
    the caller takes its hold back (``ServedModel.swap_holds``, which ``update_weights`` waits on).
    While it waits no new update starts either (``ServedModel.hold_waiters``): back-to-back updates
    would each start within its poll and keep it waiting, up to its deadline."""
    model.hold_waiters += 1
    try:
        while model.updating:
            if deadline is not None and time.monotonic() >= deadline:
                raise deadline_error()
            await asyncio.sleep(0.01)
    finally:
        model.hold_waiters -= 1
    model.swap_holds += 1


async def read_body(request: Request, limit: int, service: Service, named: str = "max_request_bytes",
                    hint: str = "split the request") -> bytes:
    """The request's body, at most ``limit`` bytes (else 413, naming the limit as ``named``, then
    ``hint``). A body still arriving when draining begins gets the drain's 503 at once: it was not
    admitted, and the exit would otherwise cut it off mid-read (uvicorn then answers a plain-text 500)."""
    if service.phase == "draining":
        raise draining_error()
    reading = asyncio.ensure_future(_read_all(request, limit, named, hint))
    draining = service.when_draining()
    try:
        await asyncio.wait({reading, draining}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        draining.cancel()
        if not reading.done():
            reading.cancel()
            await asyncio.wait({reading})
    if reading.cancelled():
        raise draining_error()
    return reading.result()


async def _read_all(request: Request, limit: int, named: str, hint: str) -> bytes:
    too_large = body_too_large(limit, named, hint)
    declared = declared_length(request.scope)
    if declared is not None and declared > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        answered = request.scope.get(PROTOCOL_ANSWER)  # the protocol answered and closed: counted as what was sent
        if answered == 408:
            raise ApiError(408, "request_timeout", "The body did not arrive within request_read_timeout_s.") from None
        if answered == 400:  # h11 refused the body's framing (a broken chunk): the protocol's malformed_request
            raise ApiError(400, "malformed_request", BODY_REFUSED) from None
        # nobody to answer: counted as nginx's 499, not as a server error; one rejection reason wherever the client left
        raise ApiError(499, "client_disconnected", "The client closed the connection before its body arrived.") from None
    return b"".join(chunks)


async def _admit_and_wait(request: Request, scheduler: Scheduler, sequences: list[SequenceInput],
                          deadline: float | None, rescore: bool = False) -> list[SequenceScores] | None:
    """The request's results once admitted and scored; None if the client went away first.

    Raises ApiError 429 when no room freed up within the admission wait, 504 past the deadline.
    """
    disconnected = asyncio.ensure_future(_until_disconnect(request))
    try:
        if rescore:  # its tokens were admitted once: it goes first, as the probe does
            admit = asyncio.ensure_future(_submit_now(scheduler, sequences, deadline))
        else:
            admit = asyncio.ensure_future(scheduler.submit_when_room(sequences, deadline=deadline))
        try:
            await asyncio.wait({admit, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            admit.cancel()
            raise
        if not admit.done():  # the client left while its request waited for room
            admit.cancel()
            await asyncio.wait({admit})
        if admit.cancelled() or (disconnected.done() and admit.exception() is not None):
            return None
        ticket = admit.result()  # raises the 429 (or 503)
        if disconnected.done():
            scheduler.cancel(ticket)
            return None
        return await _wait(scheduler, ticket, deadline, disconnected)
    finally:
        disconnected.cancel()


async def _submit_now(scheduler: Scheduler, sequences: list[SequenceInput], deadline: float | None) -> Ticket:
    return scheduler.submit(sequences, deadline=deadline, probe=True)


async def _wait(scheduler: Scheduler, ticket: Ticket, deadline: float | None,
                disconnected: asyncio.Future) -> list[SequenceScores] | None:
    """The ticket's results; None if the client went away; ApiError 504 past the deadline."""
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait({ticket.future, disconnected}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        scheduler.cancel(ticket)
        raise
    if ticket.future.done():
        return ticket.future.result()  # raises the ticket's ApiError, if it failed
    scheduler.cancel(ticket)  # drops its sequences that have not started
    if disconnected in done:
        return None
    raise deadline_error()


async def _until_disconnect(request: Request) -> None:
    # The body has been read; the server's next message is http.disconnect once the client goes.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _score_body(job: ScoreJob, scores: list[SequenceScores], version: str, service: Service) -> dict:
    for i, s in enumerate(scores):
        if (where := non_finite_score(s)) is not None:
            log.warning("%s scored sequences[%d] of a request with non-finite numbers at %s", job.model, i, where)
            raise non_finite_error(i, where)
    results = [
        result_record(seq_id, s, return_entropy=job.return_entropy, top_k=job.top_k) for seq_id, s in zip(job.ids, scores)
    ]
    for record, s, rollout in zip(results, scores, job.rollout):
        if rollout is not None:
            record["mismatch"] = figures = mismatch(s.logprobs, rollout)
            if rollout.size:  # an empty scored range measures nothing: its zeros would pull a dashboard down
                service.metrics.observe_mismatch(job.model, figures)
    return {
        "model": job.model,
        "weights_version": version,
        "results": results,
        "usage": {"input_tokens": job.input_tokens, "scored_tokens": job.scored_tokens},
    }
