"""The HTTP app: ``create_app(settings, backend)`` builds it; nothing lives at module level.

Routes follow docs/api.md: POST /score (alias /v1/score), GET /healthz (alias /health), /readyz,
/metrics, /v1/models, and POST /v1/weights with ``--weights-root``; /docs serves Swagger UI from the
installed package, no CDN. Every error is the contract's JSON body, whatever the request's encoding.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model_runtime.types import SequenceInput, SequenceScores
from service.http import metrics as metrics_module
from service.http.encoding import CONTENT_TYPE, JSON, MSGPACK, encode_json, encode_score_response, request_encoding
from service.http.encoding import decode_body, response_encoding, result_record
from service.http.errors import ERROR_RESPONSES, ApiError, backend_unavailable, from_validation_errors
from service.http.rollout import mismatch
from service.http.schemas import ErrorResponse, Health, ModelList, Readiness, ScoreRequest, ScoreResponse, Usage
from service.http.schemas import WeightsRequest, WeightsResponse
from service.http.validation import ScoreJob, parse_score_request
from service.http.weights import WEIGHTS_ROUTE, update_weights
from service.runtime import BackendSources, ServedModel, Service
from service.scheduling.scheduler import Scheduler, Ticket
from service.settings import Settings

log = logging.getLogger(__name__)

SCORE_ROUTES = ("/score", "/v1/score")
_OPEN_ROUTES = frozenset({"/healthz", "/health", "/readyz"})  # no API key: probes must work without secrets
_SERVED_WHILE_DRAINING = _OPEN_ROUTES | {"/metrics"}
_ROUTE_LABELS = frozenset({*SCORE_ROUTES, *_OPEN_ROUTES, "/metrics", "/v1/models", WEIGHTS_ROUTE, "/docs", "/redoc",
                           "/openapi.json"})
# Re-scores of a request that straddled a weight swap before it holds the model's updates off
# (the last re-score then sees one version): the common single swap costs no update any wait.
_HOLD_FROM_RESCORE = 2
_DAY_MS = 86_400_000
_CLIENT_CLOSED = 499  # nginx's convention for "the client went away before the answer"
# Bodies larger than this are decoded and validated in a thread, so that the event loop keeps
# answering (/healthz, other requests) meanwhile; smaller ones cost less than the hand-off.
_DECODE_INLINE_BYTES = 256 << 10
_CLOSE = {"Connection": "close"}

_BIN = {"type": "string", "format": "binary"}
_MSGPACK_SCORE_RESPONSE = {
    "type": "object",
    "description": "As the JSON answer, but logprobs / entropy / top_k_logprobs are bins of little-endian "
    "float32 and top_k_ids a bin of int32, top-k flattened row-major [n_scored, k].",
    "required": ["model", "weights_version", "results", "usage"],
    "properties": {
        "model": {"type": "string"},
        "weights_version": {"type": "string"},
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "logprobs"],
                "properties": {
                    "id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "logprobs": _BIN,
                    "entropy": _BIN,
                    "top_k_ids": _BIN,
                    "top_k_logprobs": _BIN,
                    "mismatch": {"$ref": "#/components/schemas/Mismatch"},
                },
            },
        },
        "usage": {"$ref": "#/components/schemas/Usage"},
    },
}
_RETRY_AFTER = {"Retry-After": {"description": "whole seconds to wait before retrying", "schema": {"type": "integer"}}}


def _errors(*codes: int) -> dict:
    out = {}
    for code in codes:
        out[code] = dict(ERROR_RESPONSES[code])
        if code in (429, 503):
            out[code]["headers"] = _RETRY_AFTER
    return out


def error_response(error: ApiError, metrics: metrics_module.Metrics) -> Response:
    metrics.rejections.labels(reason=error.type).inc()
    return Response(error.body(), status_code=error.status, media_type=JSON, headers=error.headers)


def create_app(settings: Settings, backend: BackendSources) -> FastAPI:
    """The service app. ``backend`` is a ScoringBackend, or a function that loads one (run in a
    thread by the lifespan hook, so /healthz answers while the model loads), or a mapping of
    served name -> either for several models."""
    service = Service(settings, backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    # FastAPIOffline: FastAPI whose /docs and /redoc load Swagger UI and ReDoc from its own package
    # (served under /static-offline-docs), not from a CDN an air-gapped cluster cannot reach.
    app = FastAPIOffline(
        title="packscore",
        version="1",
        description="Per-token log-probabilities and entropy of token sequences under the served model. "
        "Requests and answers in JSON or msgpack (Content-Type / Accept: application/msgpack).",
        lifespan=lifespan,
        swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from validator.swagger.io
    )
    app.state.service = service
    app.add_middleware(_Gate, service=service)
    _install_error_handlers(app, service)
    _add_routes(app, service)
    app.openapi = lambda: _openapi(app, service)  # type: ignore[method-assign]
    return app


class _Gate:
    """Wraps every request: counts it in the metrics, checks the API key, refuses while draining.

    A plain ASGI middleware (not BaseHTTPMiddleware) so that handlers still receive the
    client's disconnect message.
    """

    def __init__(self, app: ASGIApp, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in _ROUTE_LABELS else "other"
        metrics = self.service.metrics
        started = time.perf_counter()
        status = 500

        async def send_observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await error_response(refusal, metrics)(scope, receive, send_observed)
            else:
                await self.app(scope, receive, send_observed)
        finally:
            metrics.requests.labels(route=route, status=str(status)).inc()
            metrics.request_latency.labels(route=route).observe(time.perf_counter() - started)

    def _refusal(self, scope: Scope, path: str) -> ApiError | None:
        key = self.service.api_key
        if path == WEIGHTS_ROUTE and self.service.admin_key is not None:
            return self._admin_refusal(scope)
        if key is not None and path not in _OPEN_ROUTES:
            if not _bearer_is(scope, key):
                if self.service.admin_key is not None and _bearer_is(scope, self.service.admin_key):
                    # a key the server knows, not allowed here: the contract's 403, as for the scoring key on /v1/weights
                    return ApiError(403, "forbidden", "The admin key may only update weights; send the scoring key.")
                return ApiError(
                    401,
                    "unauthorized",
                    "A valid API key is required: send 'Authorization: Bearer <key>'.",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if self.service.phase == "draining" and path not in _SERVED_WHILE_DRAINING:
            return _draining_error()
        return None

    def _admin_refusal(self, scope: Scope) -> ApiError | None:
        """With --admin-key, POST /v1/weights takes that key only: the scoring key gets 403."""
        if _bearer_is(scope, self.service.admin_key):
            return _draining_error() if self.service.phase == "draining" else None
        if self.service.api_key is not None and _bearer_is(scope, self.service.api_key):
            return ApiError(403, "forbidden", "The scoring key may not update weights; send the admin key.")
        return ApiError(401, "unauthorized", "The admin key is required: send 'Authorization: Bearer <admin key>'.",
                        headers={"WWW-Authenticate": "Bearer"})


def _bearer_is(scope: Scope, key: str) -> bool:
    given = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


def _draining_error() -> ApiError:
    # Connection: close, so that a keep-alive client reconnects (to another replica) instead of
    # finding its next request met by a closed socket.
    return ApiError(503, "draining", "The server is shutting down; retry on another replica.",
                    headers={"Retry-After": "1", **_CLOSE})


def _install_error_handlers(app: FastAPI, service: Service) -> None:
    metrics = service.metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc, metrics)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(from_validation_errors(list(exc.errors()) or [{}]), metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kinds = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"No route {request.url.path}.", 405: f"{request.method} is not allowed on {request.url.path}."}
        error = ApiError(exc.status_code, kinds.get(exc.status_code, "http_error"),
                         message.get(exc.status_code, str(exc.detail)), headers=dict(exc.headers or {}))
        return error_response(error, metrics)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal_error", "The server failed unexpectedly; this is a bug."), metrics)


def _add_routes(app: FastAPI, service: Service) -> None:
    score_doc = dict(
        summary="Score token sequences",
        description="Per-token log-probabilities (and entropy, top-k) for each sequence; see docs/api.md.",
        response_class=Response,
        responses={
            200: {
                "model": ScoreResponse,
                "description": "scores, in the encoding named by Accept (default: the request's)",
                "content": {MSGPACK: {"schema": _MSGPACK_SCORE_RESPONSE}},
            },
            **_errors(400, 401, 404, 409, 413, 422, 429, 503, 504),
        },
    )

    async def score(request: Request) -> Response:
        return await _score(request, service)

    for path in SCORE_ROUTES:
        app.add_api_route(path, score, methods=["POST"], operation_id=f"score{path.replace('/', '_')}", **score_doc)

    async def healthz() -> Response:
        return Response(encode_json({"status": "ok"}), media_type=JSON)

    for path in ("/healthz", "/health"):  # /health: the name vLLM, TGI and SGLang answer on
        app.add_api_route(path, healthz, methods=["GET"], response_model=Health,
                          summary="Liveness: the process serves HTTP", operation_id=f"health{path.replace('/', '_')}")

    @app.get(
        "/readyz",
        response_model=Readiness,
        summary="Readiness: model loaded, workers alive, a real scoring pass succeeded",
        responses={503: {"model": Readiness, "description": "not ready, with the reason", "headers": _RETRY_AFTER}},
    )
    async def readyz() -> Response:
        ready, status = await service.readiness()
        if ready:
            body = {"status": "ready", "model": service.served_name, "models": list(service.models),
                    "limits": service.limits.as_dict()}
            return Response(encode_json(body), media_type=JSON)
        error = {"type": "not_ready", "message": f"Not ready: {status.replace('_', ' ')}.", "param": None}
        headers = {"Retry-After": "1", **_CLOSE} if status == "draining" else {"Retry-After": "5"}
        return Response(encode_json({"status": status, "error": error}), status_code=503, media_type=JSON,
                        headers=headers)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response, responses=_errors(401))
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=metrics_module.CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, summary="The served models", responses=_errors(401, 503))
    async def models() -> Response:
        if service.phase in ("loading", "failed") or not service.models:
            raise _not_ready(service)
        return Response(encode_json({"data": [_model_card(m) for m in list(service.models.values())]}), media_type=JSON)

    if service.settings.weights_root is not None:
        _add_weights_route(app, service, service.settings.weights_root)


def _model_card(model: ServedModel) -> dict:
    info = model.backend.info
    return {
        "id": model.name,
        "architecture": info.architecture,
        "vocab_size": info.vocab_size,
        "max_model_len": model.limits.max_model_len,
        "dtype": info.dtype,
        "device": info.device,
        "parallel": {k: info.parallel.get(k) for k in ("world_size", "dp", "sp", "fsdp")},
        "kernels": dict(info.kernels),
        "weights_version": info.weights_version,
    }


def _add_weights_route(app: FastAPI, service: Service, root) -> None:
    @app.post(
        WEIGHTS_ROUTE,
        summary="Serve a new checkpoint of a model (loaded from under --weights-root, swapped between forwards)",
        response_class=Response,
        responses={200: {"model": WeightsResponse, "description": "the new version serves"},
                   **_errors(400, 401, 403, 404, 409, 422, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            JSON: {"schema": {"$ref": "#/components/schemas/WeightsRequest"}},
            MSGPACK: {"schema": {"$ref": "#/components/schemas/WeightsRequest"}}}}},
    )
    async def weights(request: Request) -> Response:
        if service.phase != "ready":
            raise _not_ready(service)
        encoding = request_encoding(request.headers.get("content-type"))
        body = decode_body(await _read_body(request, 1 << 20, service), encoding)
        answer = await update_weights(service, body, root)
        return Response(encode_json(answer), media_type=JSON)


def _not_ready(service: Service) -> ApiError:
    if service.phase == "draining":
        return _draining_error()
    return ApiError(503, "not_ready", f"The model is not ready yet ({service.phase.replace('_', ' ')}).",
                    headers={"Retry-After": "5"})


async def _score(request: Request, service: Service) -> Response:
    limits = service.limits
    if service.phase != "ready" or service.scheduler is None or limits is None:
        raise _not_ready(service)
    in_encoding = request_encoding(request.headers.get("content-type"))
    try:
        raw = await _read_body(request, limits.max_request_bytes, service)
        served = {name: m.limits for name, m in service.models.items()}
        if len(raw) > _DECODE_INLINE_BYTES:
            job = await asyncio.to_thread(_parse, raw, in_encoding, served)
        else:
            job = _parse(raw, in_encoding, served)
    except ApiError as exc:
        if exc.status == 413:  # tell the client the limits it must split under
            exc.headers.update(limits.headers())
        raise
    model = service.models[job.model]
    limits = model.limits
    if service.phase != "ready":  # SIGTERM while the body was being read
        raise _not_ready(service)
    if job.weights_version is not None and job.weights_version != model.backend.info.weights_version:
        raise _version_mismatch(job.weights_version, model)
    if not model.backend.is_alive():  # a worker died: answer now instead of failing in the queue
        raise backend_unavailable("A scoring worker is down; retry shortly.", retry_after_s=5)
    # Capped at a day: an unbounded integer must not overflow the clock arithmetic.
    deadline = time.monotonic() + min(job.deadline_ms, _DAY_MS) / 1000.0 if job.deadline_ms is not None else None
    service.inflight += 1
    try:
        scored = await _score_with_one_version(request, model, job, deadline)
        if scored is None:
            service.metrics.rejections.labels(reason="client_disconnected").inc()
            return Response(status_code=_CLIENT_CLOSED)
        out_encoding = response_encoding(request.headers.get("accept"), in_encoding)
        body = _score_body(job, *scored, service)
        return Response(encode_score_response(body, out_encoding), media_type=CONTENT_TYPE[out_encoding],
                        headers=limits.headers())
    finally:
        service.inflight -= 1


def _parse(raw: bytes, encoding, served) -> ScoreJob:
    return parse_score_request(decode_body(raw, encoding), served)


def _version_mismatch(pinned: str, model: ServedModel) -> ApiError:
    served = model.backend.info.weights_version
    return ApiError(409, "weights_version_mismatch",
                    f"weights_version {pinned!r} is not served; {model.name!r} now serves {served!r}.", "weights_version")


async def _score_with_one_version(request: Request, model: ServedModel, job: ScoreJob,
                                  deadline: float | None) -> tuple[list[SequenceScores], str] | None:
    """The job's scores, every one by the same weights version, and that version; None if the
    client went away.

    A weight swap between two of its rows leaves a request scored by two versions: its sequences
    scored by another than the one now served (or the pinned one) are scored again, so no request
    fails because of a swap. Before its second re-score a request holds the model's updates off
    (``_hold_swaps``) until it has its answer: swaps landing faster than it is scored cannot keep
    it from ending. A pinned request whose version no longer serves gets 409.
    """
    scheduler = model.scheduler
    assert scheduler is not None
    scores: list[SequenceScores | None] = [None] * len(job.sequences)
    todo = list(range(len(job.sequences)))
    held = False
    try:
        for attempt in range(_HOLD_FROM_RESCORE + 1):
            if attempt == _HOLD_FROM_RESCORE:
                held = await _hold_swaps(model, deadline)
                todo = _rescore_needed(scores, model, job)  # against what serves now, fixed while held
                if not todo:  # what served while it waited is the version its sequences have
                    return scores, job.weights_version or model.backend.info.weights_version  # type: ignore[return-value]
            # A re-score goes first and past the admission bound, as the probe: its tokens were admitted.
            got = await _admit_and_wait(request, scheduler, [job.sequences[i] for i in todo], deadline, rescore=attempt > 0)
            if got is None:
                return None
            for i, s in zip(todo, got):
                scores[i] = s
            todo = _rescore_needed(scores, model, job)
            if not todo:
                return scores, job.weights_version or model.backend.info.weights_version  # type: ignore[return-value]
            log.info("%d of %d sequences of a request scored by another version of %s than %s: scoring them again",
                     len(todo), len(scores), model.name, job.weights_version or model.backend.info.weights_version)
    finally:
        if held:
            model.swap_holds -= 1
    # Not reached while updates start only through update_weights: held, no swap lands during the
    # last re-score. A backend that swapped on its own would end here rather than loop.
    raise ApiError(503, "unavailable", f"The weights of {model.name!r} changed while the request was scored; retry.",
                   headers={"Retry-After": "1"})


def _rescore_needed(scores: list[SequenceScores | None], model: ServedModel, job: ScoreJob) -> list[int]:
    """The sequences not scored by the version the request must have (the pinned one, else the
    one now served); raises 409 for a pinned version that no longer serves and is still needed."""
    served = model.backend.info.weights_version
    target = job.weights_version or served
    todo = [i for i, s in enumerate(scores) if s is not None and (s.weights_version or served) != target]
    if todo and target != served:
        raise _version_mismatch(target, model)
    return todo


async def _hold_swaps(model: ServedModel, deadline: float | None) -> bool:
    """Waits for a running update of ``model`` to end, then keeps any other from starting until
    the caller releases it (``ServedModel.swap_holds``, which ``update_weights`` waits on)."""
    while model.updating:
        if deadline is not None and time.monotonic() >= deadline:
            raise ApiError(504, "deadline_exceeded", "deadline_ms passed before the result was ready.", "deadline_ms")
        await asyncio.sleep(0.01)
    model.swap_holds += 1
    return True


async def _read_body(request: Request, limit: int, service: Service) -> bytes:
    """The request's body, at most ``limit`` bytes. A body still arriving when draining begins
    gets the drain's 503 at once: it was not admitted, and the exit would otherwise cut it off
    mid-read (uvicorn then answers a plain-text 500)."""
    if service.phase == "draining":
        raise _draining_error()
    reading = asyncio.ensure_future(_read_all(request, limit))
    draining = service.when_draining()
    try:
        await asyncio.wait({reading, draining}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        draining.cancel()
        if not reading.done():
            reading.cancel()
            await asyncio.wait({reading})
    if reading.cancelled():
        raise _draining_error()
    return reading.result()


async def _read_all(request: Request, limit: int) -> bytes:
    # Connection: close, so the rest of an oversized body is not read and thrown away.
    too_large = ApiError(413, "body_too_large", f"The body exceeds {limit} bytes (max_request_bytes); split the request.",
                         headers=dict(_CLOSE))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody to answer: counted as nginx's 499, not as a server error
        raise ApiError(499, "client_closed_request", "The client closed the connection before its body arrived.") from None
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
    raise ApiError(504, "deadline_exceeded", "deadline_ms passed before the result was ready.", "deadline_ms")


async def _until_disconnect(request: Request) -> None:
    # The body has been read; the server's next message is http.disconnect once the client goes.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _score_body(job: ScoreJob, scores: list[SequenceScores], version: str, service: Service) -> dict:
    results = [
        result_record(seq_id, s, return_entropy=job.return_entropy, top_k=job.top_k) for seq_id, s in zip(job.ids, scores)
    ]
    for record, s, rollout in zip(results, scores, job.rollout):
        if rollout is not None:
            record["mismatch"] = figures = mismatch(s.logprobs, rollout)
            service.metrics.observe_mismatch(job.model, figures)
    return {
        "model": job.model,
        "weights_version": version,
        "results": results,
        "usage": {"input_tokens": job.input_tokens, "scored_tokens": job.scored_tokens},
    }


def _openapi(app: FastAPI, service: Service) -> dict:
    """FastAPI's schema plus the /score request body, which the route decodes itself (JSON or msgpack)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    request_schema = ScoreRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(request_schema.pop("$defs", {}))
    components["ScoreRequest"] = request_schema
    for model in (ErrorResponse, Usage, WeightsRequest, WeightsResponse):
        components.setdefault(model.__name__, model.model_json_schema(ref_template="#/components/schemas/{model}"))
    if service.limits is not None:
        _describe_limits(components, service)
    ref = {"$ref": "#/components/schemas/ScoreRequest"}
    body = {"required": True, "content": {JSON: {"schema": ref}, MSGPACK: {"schema": ref}}}
    for path in SCORE_ROUTES:
        schema["paths"][path]["post"]["requestBody"] = body
    if service.api_key is not None:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path not in _OPEN_ROUTES:
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
    if service.limits is not None:  # complete only once the model is known
        app.openapi_schema = schema
    return schema


def _describe_limits(components: dict, service: Service) -> None:
    """Puts the served model's limits into the request schema, so clients and fuzzers see them."""
    served = [m.limits for m in service.models.values()]
    ids = components["SequenceIn"]["properties"]["input_ids"]
    ids["items"]["maximum"] = max(limits.vocab_size for limits in served) - 1
    ids["maxItems"] = max(limits.max_model_len for limits in served)
    request = components["ScoreRequest"]["properties"]
    request["sequences"]["maxItems"] = served[0].max_sequences_per_request
    request["model"] = {"anyOf": [{"type": "string", "enum": list(service.models)}, {"type": "null"}],
                        "default": None, "description": request["model"].get("description", "")}
