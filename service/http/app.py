"""The HTTP app: ``create_app(settings, backend)`` builds it; nothing lives at module level.

Routes follow docs/api.md: POST /score (alias /v1/score; its work is ``service.http.scoring``),
GET /healthz (alias /health), /readyz, /metrics, /v1/models, and POST /v1/weights with
``--weights-root``; /docs serves Swagger UI from the installed package, no CDN. Every error is the
contract's JSON body, whatever the request's encoding.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from service.http import metrics as metrics_module
from service.http import request_id
from service.http.encoding import JSON, MSGPACK, decode_body, encode_json, request_encoding
from service.http.errors import ERROR_RESPONSES, ApiError, body_too_large, draining_error, from_validation_errors
from service.http.errors import SHOWN_PATH, shortened
from service.http.protocol import PROTOCOL_ANSWER
from service.http.schemas import ErrorResponse, Health, ModelList, Readiness, ScoreRequest, ScoreResponse, Usage
from service.http.schemas import WeightsRequest, WeightsResponse
from service.http.scoring import ARRIVED, CLIENT_CLOSED, not_ready, read_body, score_request
from service.http.weights import WEIGHTS_ROUTE, update_weights
from service.http.wire import declared_length
from service.runtime import BackendSources, ServedModel, Service
from service.settings import Settings
from service.weights_record import WeightsRecord, Withheld, describe_withheld

log = logging.getLogger(__name__)
# uvicorn's access log: a line written to it follows --log-level as uvicorn's own do (on at debug only)
_ACCESS_LOG = logging.getLogger("uvicorn.access")

SCORE_ROUTES = ("/score", "/v1/score")
_OPEN_ROUTES = frozenset({"/healthz", "/health", "/readyz"})  # no API key: probes must work without secrets
_SERVED_WHILE_DRAINING = _OPEN_ROUTES | {"/metrics"}
_ROUTE_LABELS = frozenset({*SCORE_ROUTES, *_OPEN_ROUTES, "/metrics", "/v1/models", WEIGHTS_ROUTE, "/docs", "/redoc",
                           "/openapi.json"})
_CLOSE = {"Connection": "close"}
_CLOSE_HEADER = [(b"connection", b"close")]  # the same, as an ASGI message carries it
# /readyz's 503 by status: a drain closes the connection; an update in place lasts seconds
_NOT_READY_HEADERS = {"draining": {"Retry-After": "1", **_CLOSE}, "updating_weights": {"Retry-After": "2"}}

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
_REQUEST_ID_DOC = {"description": "the request's X-Request-Id if it sent 1-128 visible ASCII characters, else one the "
                   "server made; the server's log lines for the request name it", "schema": {"type": "string"}}


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


def create_app(settings: Settings, backend: BackendSources, record: WeightsRecord | None = None) -> FastAPI:
    """The service app. ``backend`` is a ScoringBackend, or a function that loads one (run in a
    thread by the lifespan hook, so /healthz answers while the model loads), or a mapping of
    served name -> either for several models. ``record``: the opened ``--weights-record``
    (default: opened from ``settings``)."""
    service = Service(settings, backend, record=record)
    service.metrics.expect_answers((*sorted(_ROUTE_LABELS), "other"), SCORE_ROUTES)
    if settings.weights_root is not None:  # each model's own outcomes once it is loaded (Service._configure)
        service.metrics.expect_weights_route()
    if service.admin_key is not None and settings.weights_root is None:
        log.warning("--admin-key has no effect without --weights-root: POST /v1/weights is not served")

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
        redirect_slashes=False,  # /score/ is a JSON 404 naming /score, not a 307 with an empty body
        swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from validator.swagger.io
    )
    app.state.service = service
    app.add_middleware(_Gate, service=service)
    _install_error_handlers(app, service)
    _add_routes(app, service)
    app.openapi = lambda: _openapi(app, service)  # type: ignore[method-assign]
    return app


class _Gate:
    """Wraps every request: names it (``X-Request-Id``, service.http.request_id), counts it in the
    metrics, checks the API key, refuses while draining (and closes the connection of every answer
    then), answers an unhandled error's 500 and a request cut off by the shutdown with the drain's 503
    (one cancelled otherwise, or whose client had left, counts as 499, and has the access-log line
    uvicorn writes only for an answer it sends).

    A plain ASGI middleware (not BaseHTTPMiddleware) so that handlers still receive the
    client's disconnect message. It answers the 500 itself, not through an exception handler
    (Starlette runs that one outside every middleware): every answer passes through here.
    """

    def __init__(self, app: ASGIApp, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the protocol names a request it answered 400 or 408 before this ran: one id for both
        rid = scope.get(request_id.SCOPE_KEY) or request_id.from_headers(scope["headers"])
        # Reset at the end: an in-process caller (httpx's ASGITransport) runs the app in its own task.
        token = request_id.current.set(rid)
        scope[request_id.SCOPE_KEY] = rid  # the protocol's own 408 or 400 for this request reads it
        scope[ARRIVED] = time.monotonic()
        if scope["path"][:8].lower().startswith(("http://", "https://")):
            _to_origin_form(scope)
        id_header = (request_id.HEADER, rid.encode("ascii"))
        path = scope["path"]
        route = path if path in _ROUTE_LABELS else "other"
        metrics = self.service.metrics
        started = time.perf_counter()
        status, started_answer = 500, False
        # Both framings (RFC 9112 6.1: chunked wins) may be a smuggling attempt: answered, then the connection closes.
        names = {name for name, _ in scope["headers"]}
        smuggling = b"content-length" in names and b"transfer-encoding" in names

        async def send_observed(message: Message) -> None:
            nonlocal status, started_answer
            if message["type"] == "http.response.start":
                status, started_answer = message["status"], True
                # Draining too: a connection kept after this answer would meet the exit's close with the next request.
                closing = smuggling or self.service.phase == "draining"
                kept = [(k, v) for k, v in message.get("headers", ()) if not closing or k.lower() != b"connection"]
                message = {**message, "headers": [*kept, id_header, *(_CLOSE_HEADER if closing else ())]}
            await send(message)

        try:
            refusal = self._refusal(scope, path) or self._body_refusal(scope, path)
            if refusal is not None:
                await error_response(refusal, metrics)(scope, receive, send_observed)
            else:
                await self.app(scope, receive, send_observed)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope["method"], path)
            if started_answer:  # only uvicorn can close a connection mid-answer; its traceback would repeat ours
                request_id.tag(exc, rid, logged=True)
                raise
            # The state the bug left behind is unknown: this connection is not reused.
            error = ApiError(500, "internal_error", "The server failed unexpectedly; this is a bug.", headers=_CLOSE)
            await error_response(error, metrics)(scope, receive, send_observed)
        except BaseException as exc:  # a cancellation (shutdown): uvicorn's line about it names the request
            request_id.tag(exc, rid)
            if isinstance(exc, asyncio.CancelledError) and not started_answer:
                status = CLIENT_CLOSED  # no server error: unanswered, as a client gone (send_observed counts an answer)
                if self.service.phase == "draining":  # uvicorn's grace ended: the drain's 503, not its plain-text 500
                    if await _client_left(receive):  # nobody to answer: a client gone, as anywhere else
                        answered = "its client had already left: nothing sent"
                    else:
                        await _answer_cancelled(error_response(draining_error(), metrics), scope, receive, send_observed)
                        answered = "answered the drain's 503"
                    # a documented outcome, not a bug: one line, and no "Exception in ASGI application" traceback
                    log.warning("%s %s cut off by the shutdown (still running after uvicorn's grace): %s",
                                scope["method"], path, answered)
                    request_id.tag(exc, rid, logged=True)
            raise
        finally:
            if scope.get(PROTOCOL_ANSWER):  # the protocol answered (408, 400) and closed: the handler's went nowhere
                status = scope[PROTOCOL_ANSWER]
            elif status == CLIENT_CLOSED:  # its client gone, uvicorn wrote nothing, nor its access line
                _log_access(scope, status)
            metrics.requests.labels(route=route, status=str(status)).inc()
            metrics.request_latency.labels(route=route).observe(time.perf_counter() - started)
            request_id.current.reset(token)

    def _refusal(self, scope: Scope, path: str) -> ApiError | None:
        key = self.service.api_key
        # Without --weights-root the weights route does not exist: 404 whatever key is sent (API.md).
        weights_off = path == WEIGHTS_ROUTE and self.service.settings.weights_root is None
        if path == WEIGHTS_ROUTE and self.service.admin_key is not None and not weights_off:
            return self._admin_refusal(scope)
        # API.md opens GET /healthz, /health and /readyz (HEAD: GET without the body, for probes)
        opened = path in _OPEN_ROUTES and scope.get("method") in ("GET", "HEAD")
        if key is not None and not opened and not weights_off:
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
            return draining_error()
        return None

    def _body_refusal(self, scope: Scope, path: str) -> ApiError | None:
        """413 for a declared body past --max-request-bytes on a route that reads none: kept alive, its
        answer would leave the body to be parsed and dropped until the read timeout. Routes that read a body
        give their own 413 (/score's names the limits to split under)."""
        weights_on = self.service.settings.weights_root is not None
        reads_body = scope.get("method") == "POST" and (path in SCORE_ROUTES or (path == WEIGHTS_ROUTE and weights_on))
        declared, limit = declared_length(scope), self.service.settings.request_bytes
        if reads_body or declared is None or declared <= limit:
            return None
        return body_too_large(limit, "max_request_bytes", f"{scope.get('method')} {path} takes no body")

    def _admin_refusal(self, scope: Scope) -> ApiError | None:
        """With --admin-key, POST /v1/weights takes that key only: the scoring key gets 403."""
        if _bearer_is(scope, self.service.admin_key):
            return draining_error() if self.service.phase == "draining" else None
        if self.service.api_key is not None and _bearer_is(scope, self.service.api_key):
            return ApiError(403, "forbidden", "The scoring key may not update weights; send the admin key.")
        return ApiError(401, "unauthorized", "The admin key is required: send 'Authorization: Bearer <admin key>'.",
                        headers={"WWW-Authenticate": "Bearer"})


def _log_access(scope: Scope, status: int) -> None:
    """The access-log line uvicorn writes as an answer starts, for a request whose answer no client
    received (a 499): its logger, level and format, so that a grep of the log finds every request."""
    _ACCESS_LOG.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                     get_path_with_query_string(scope), scope["http_version"], status)


async def _client_left(receive: Receive) -> bool:
    """Whether the client has closed the connection: the server then has ``http.disconnect`` for the next
    receive at once, where it would otherwise wait (for more of the body, or for the disconnect)."""
    message = asyncio.ensure_future(receive())
    await asyncio.sleep(0)  # the receive's first step: a disconnect already known is returned there
    if not message.done():
        message.cancel()
        return False
    return not message.cancelled() and message.exception() is None and message.result()["type"] == "http.disconnect"


async def _answer_cancelled(answer: Response, scope: Scope, receive: Receive, send: Send) -> None:
    """Sends ``answer`` for a request whose handler was cancelled; a client already gone is no error."""
    try:
        await answer(scope, receive, send)
    except Exception:  # the connection is gone: nothing to answer
        log.debug("the answer to a cancelled request could not be sent", exc_info=True)


def _to_origin_form(scope: Scope) -> None:
    """Rewrites the path of a request whose target came in absolute form (``POST http://host/score``),
    which an HTTP/1.1 server must accept (RFC 9112, 3.2.2) and uvicorn's h11 passes on whole as the path.
    In place: the protocol marks this very scope when it answers 408 or 400 (PROTOCOL_ANSWER), and the gate and
    the score route read that mark."""
    scope["path"] = urlsplit(scope["path"]).path or "/"
    scope["raw_path"] = (urlsplit(scope["raw_path"].decode("latin-1")).path or "/").encode("latin-1")


def _bearer_is(scope: Scope, key: str) -> bool:
    given = dict(scope["headers"]).get(b"authorization", b"")
    scheme, _, token = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


def _probe_failures(failed: dict[str, bool]) -> str:
    """The models whose readiness pass failed, each with how: ``'policy' (non-finite log-probabilities)``."""
    return ", ".join(f"{name!r} ({'non-finite log-probabilities' if non_finite else 'no result'})"
                     for name, non_finite in failed.items())


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
        path = request.url.path
        # no redirect for a trailing slash (a client that does not follow it would see a bare 307)
        hint = f" (did you mean {path.rstrip('/')}?)" if path.endswith("/") and path.rstrip("/") in _ROUTE_LABELS else ""
        if exc.status_code == 404 and path.rstrip("/") == WEIGHTS_ROUTE and service.settings.weights_root is None:
            hint = ": weight updates are off, since the server was started without --weights-root"  # not a typo to hunt
        shown = shortened(path, SHOWN_PATH)  # a client's 60 KB path is not echoed back
        message = {404: f"No route {shown}{hint}.", 405: f"{shortened(request.method)} is not allowed on {shown}."}
        headers = dict(exc.headers or {})
        allow = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
        if "GET" in allow and "HEAD" not in allow:  # every GET route answers HEAD too
            headers["Allow"] = ", ".join([*allow, "HEAD"])
        error = ApiError(exc.status_code, kinds.get(exc.status_code, "http_error"),
                         message.get(exc.status_code, str(exc.detail)), headers=headers)
        return error_response(error, metrics)


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
            **_errors(400, 401, 403, 404, 409, 413, 422, 429, 503, 504),
        },
    )

    async def score(request: Request) -> Response:
        return await score_request(request, service)

    for path in SCORE_ROUTES:
        app.add_api_route(path, score, methods=["POST"], operation_id=f"score{path.replace('/', '_')}", **score_doc)

    async def healthz() -> Response:
        return Response(encode_json({"status": "ok"}), media_type=JSON)

    for path in ("/healthz", "/health"):  # /health: the name vLLM, TGI and SGLang answer on
        app.add_api_route(path, healthz, methods=["GET"], response_model=Health,
                          summary="Liveness: the process serves HTTP", operation_id=f"health{path.replace('/', '_')}")
        # Some load balancers probe with HEAD: the same answer, without a body (uvicorn drops it).
        app.add_api_route(path, healthz, methods=["HEAD"], include_in_schema=False)

    @app.get(
        "/readyz",
        response_model=Readiness,
        summary="Readiness: model loaded, workers alive, a real scoring pass succeeded",
        responses={503: {"model": Readiness, "description": "not ready, with the reason", "headers": _RETRY_AFTER}},
    )
    async def readyz() -> Response:
        ready, status = await service.readiness()
        if ready:
            # "model" and "limits": the first (or only) model's; "model_limits": every served model's
            body = {"status": "ready", "model": service.served_name, "models": list(service.models),
                    "limits": service.limits.as_dict(),
                    "model_limits": {name: m.limits.as_dict() for name, m in service.models.items()}}
            return Response(encode_json(body), media_type=JSON)
        message = f"Not ready: {status.replace('_', ' ')}."
        if status == "restart_failed":  # why (paths, hashes) is in the log and in /score's answer, behind the key
            message = "Not ready: the scoring workers could not restart; /score's 503 and the log say why."
        elif status == "probe_failed" and (failed := service.probe_failed_models()):
            message = f"Not ready: the readiness pass failed for {_probe_failures(failed)}; the log says more."
        elif status == "awaiting_weights":  # the paths, as above, only behind the key
            message = f"Not ready: {describe_withheld(service.withheld, full=False)}; /score's 503 and the log say more."
        error = {"type": "not_ready", "message": message, "param": None}
        headers = _NOT_READY_HEADERS.get(status, {"Retry-After": "5"})
        if status == "restart_failed":  # when the pools next try, as /score's 503 says: not ready before then
            headers = {"Retry-After": str(service.restart_retry_after_s())}
        return Response(encode_json({"status": status, "error": error}), status_code=503, media_type=JSON,
                        headers=headers)

    app.add_api_route("/readyz", readyz, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response, responses=_errors(401, 403))
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=metrics_module.CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, summary="The served models", responses=_errors(401, 403, 503))
    async def models() -> Response:
        if service.phase in ("loading", "failed") or not service.models:
            raise not_ready(service)
        cards = [_model_card(m, service.withheld.get(m.name)) for m in list(service.models.values())]
        return Response(encode_json({"data": cards}), media_type=JSON)

    for path, endpoint in (("/metrics", metrics), ("/v1/models", models)):  # HEAD answers as GET does, bodiless
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)

    if service.settings.weights_root is not None:
        _add_weights_route(app, service, service.settings.weights_root)


def _model_card(model: ServedModel, withheld: Withheld | None) -> dict:
    info = model.backend.info
    card = {
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
    if withheld is not None:  # an optional field: weights_version is loaded, but scores nothing yet
        card["awaiting_weights"] = withheld.card()
    return card


def _add_weights_route(app: FastAPI, service: Service, root) -> None:
    @app.post(
        WEIGHTS_ROUTE,
        summary="Serve a new checkpoint of a model (loaded from under --weights-root, swapped between forwards)",
        response_class=Response,
        responses={200: {"model": WeightsResponse, "description": "the new version serves"},
                   **_errors(400, 401, 403, 404, 409, 413, 422, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            JSON: {"schema": {"$ref": "#/components/schemas/WeightsRequest"}},
            MSGPACK: {"schema": {"$ref": "#/components/schemas/WeightsRequest"}}}}},
    )
    async def weights(request: Request) -> Response:
        try:
            if service.phase not in ("ready", "awaiting_weights"):  # a withheld model waits for just this
                raise not_ready(service)
            encoding = request_encoding(request.headers.get("content-type"), request.headers.get("content-encoding"))
            limit = min(1 << 20, service.limits.max_request_bytes) if service.limits is not None else 1 << 20
            body = decode_body(await read_body(request, limit, service, "the lower of 1 MiB and max_request_bytes",
                                               "a weights request holds a model, a path and a version"), encoding)
        except ApiError as exc:  # an update refused before its body names a model is a failed update too
            service.metrics.weights_updates.labels(model="", outcome=exc.type).inc()
            raise
        answer = await update_weights(service, body, root)
        return Response(encode_json(answer), media_type=JSON)


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
    for operations in schema["paths"].values():  # every answer names its request (_Gate)
        for operation in operations.values():
            for answer in operation.get("responses", {}).values():
                answer["headers"] = {**answer.get("headers", {}), "X-Request-Id": _REQUEST_ID_DOC}
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
    # every name a request may give: a served name, or the exact --model directory (Service.aliases)
    request["model"] = {"anyOf": [{"type": "string", "enum": [*service.models, *service.aliases]}, {"type": "null"}],
                        "default": None, "description": request["model"].get("description", "")}
