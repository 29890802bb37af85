"""The contract's error answers: one exception type, one JSON body, whatever the request's encoding."""

from __future__ import annotations

from typing import Iterable

import orjson

from model_runtime.wording import counted
from service.http.schemas import NOT_UNICODE, ErrorResponse


class ApiError(Exception):
    """An answer other than 200; ``param`` names the offending field in the contract's notation."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return orjson.dumps({"error": {"type": self.type, "message": self.message, "param": self.param}})


class OversizedInt:
    """An integer literal of more digits than any 64-bit integer has, kept as its digit count:
    no field takes one, and converting it could take seconds (Python limits int() to 4300 digits)."""

    __slots__ = ("digits",)

    def __init__(self, literal: str):
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def past_64_bits(value) -> bool:
    """An integer no 64-bit field can hold: an ``OversizedInt``, or the float orjson turns an
    integer literal past 64 bits into (the JSON fast path keeps no exact value for it)."""
    if isinstance(value, OversizedInt):
        return True
    return isinstance(value, float) and value == value and abs(value) >= 2.0**63 and value.is_integer()


def backend_unavailable(message: str, retry_after_s: int) -> ApiError:
    """503 ``backend_unavailable``: no worker can score now; the client retries after the hint."""
    return ApiError(503, "backend_unavailable", message, headers={"Retry-After": str(retry_after_s)})


def restart_failed(backend, what: str | None = None) -> ApiError | None:
    """503 ``backend_unavailable`` while ``backend``'s workers are down and could not restart (the worker
    pool's ``restart_error``), else None: why (after ``what`` failed), and when the pool next tries, one
    figure for the message and Retry-After."""
    failed = getattr(backend, "restart_error", None)
    if not failed:
        return None
    retry = getattr(backend, "restart_retry_after_s", 30)
    why = f"the scoring workers are down and could not restart: {failed}; the next attempt is in {retry}s."
    return backend_unavailable(f"{what}: {why}" if what else why[0].upper() + why[1:], retry_after_s=retry)


def body_too_large(limit: int, named: str, hint: str) -> ApiError:
    """413 ``body_too_large`` with Connection: close, so the rest of the body is dropped, not parsed."""
    return ApiError(413, "body_too_large", f"The body exceeds {limit} bytes ({named}); {hint}.",
                    headers={"Connection": "close"})


def draining_error() -> ApiError:
    """503 ``draining``: SIGTERM came; nothing new is admitted. Connection: close, so that a
    keep-alive client reconnects (to another replica) instead of meeting a closed socket."""
    return ApiError(503, "draining", "The server is shutting down; retry on another replica.",
                    headers={"Retry-After": "1", "Connection": "close"})


def deadline_error() -> ApiError:
    """504 ``deadline_exceeded``: the request's ``deadline_ms`` passed before its result was ready."""
    return ApiError(504, "deadline_exceeded", "deadline_ms passed before the result was ready.", "deadline_ms")


def param_path(loc: Iterable[str | int], *, sourced: bool = True) -> str | None:
    """``("body", "sequences", 3, "input_ids", 17)`` -> ``"sequences[3].input_ids[17]"``.

    FastAPI prefixes where a value came from (body, query, ...; ``sourced``); the contract names
    fields only. A model's own validation has no prefix: there ``path`` is /v1/weights' field.
    """
    parts = list(loc)
    if sourced and parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_reason(error: dict) -> str:
    """A pydantic error's message for people: without the "Value error, " pydantic puts before a
    validator's own ValueError, and without a closing full stop. An object expected is named as
    the wire has it, not as pydantic's "dictionary or instance of <our class>"."""
    if error.get("type") == "model_type":
        return "Input should be an object (a JSON object or msgpack map)"
    return error.get("msg", "invalid value").removeprefix("Value error, ").rstrip(".")


def from_validation_errors(errors: list[dict], *, sourced: bool = True) -> ApiError:
    """The first pydantic error as a 422 naming its field; the first is the one a client fixes first.
    ``sourced``: FastAPI's errors, whose locations start with the request part (``param_path``)."""
    # A msgpack map keyed by bin, not str: the body's encoding is wrong, whatever else is (a field
    # under such a key would otherwise be reported missing). Found here, so decoding pays nothing.
    bin_key = next((e["input"] for e in errors if e.get("type") == "invalid_key" and isinstance(e.get("input"), bytes)),
                   None)
    if bin_key is not None:
        return ApiError(400, "malformed_body", f"Every map key of the body must be a msgpack str, got a bin key, "
                        f"{short_repr(bin_key.decode('utf-8', 'replace'))}; pack keys as str, not bytes.")
    first = errors[0]
    param = param_path(first.get("loc", ()), sourced=sourced)
    kind = first.get("type", "")
    if kind == "missing":
        message = f"{param} is required."
    elif kind == "extra_forbidden" and _unfit_for_a_path(first.get("loc", ())):
        param = param_path(first["loc"][:-1], sourced=sourced)  # the object that holds it
        key = first["loc"][-1]
        what = "An empty key" if key == "" else f"The key {short_repr(key)} ({len(key)} characters)"
        message = f"{what} is not a field of {param or 'this request'}."
    elif kind == "extra_forbidden":
        message = f"{param} is not a field of this request."
    elif kind == "string_unicode":  # pydantic's, for a key: the values of Text fields say NOT_UNICODE themselves
        message = f"{param or 'the body'}: a key {NOT_UNICODE}, got {short_repr(first.get('input'))}."
    elif past_64_bits(first.get("input")) and kind.startswith("int"):
        message = f"{param or 'the body'}: integers must fit in 64 bits, got a larger one."
    elif past_64_bits(first.get("input")):
        message = f"{param or 'the body'}: {validation_reason(first)}, got an integer past 64 bits."
    else:
        shown = short_repr(first.get("input"))
        reason = validation_reason(first)
        message = f"{param or 'the body'}: {reason}, got {shown}."
    return ApiError(422, "invalid_value", message, param)


_LONGEST_KEY_IN_A_PATH = 60


def _unfit_for_a_path(loc) -> bool:
    """Whether an unknown key would make a poor ``param``: empty (named "None" or "x."), long
    (a client's 2 MB key is not echoed back), or holding a character that is not printable (a line
    break would forge a line of the server's log, which names a refused weights update's message)."""
    key = tuple(loc)[-1:]
    return bool(key) and isinstance(key[0], str) and (key[0] == "" or len(key[0]) > _LONGEST_KEY_IN_A_PATH
                                                      or not key[0].isprintable())


def short_repr(value, limit: int = 60) -> str:
    """A value as a message shows it: at most ``limit`` characters (a client's 2 MB string is not echoed back)."""
    if isinstance(value, (bytes, bytearray)):
        return counted(len(value), 'byte')
    try:
        text = repr(value)
    except RecursionError:  # a value nested deeper than Python's stack: still a 422 naming the field
        return f"a {type(value).__name__} nested too deep to show"
    return shortened(text, limit)


SHOWN_PATH = 200  # a path is shown whole up to this: a deep checkpoint directory stays recognisable


def shortened(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters, as a message shows a client's string (a route, a method) unquoted;
    a character that is not printable (a NUL, a line break, a right-to-left override) shown escaped, as repr would."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# Documented next to every route that can answer it (the OpenAPI page and schemathesis read these).
ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "malformed body: bad JSON or msgpack, or a wrong content type"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    403: {"model": ErrorResponse, "description": "a key or path not allowed for this route"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    409: {"model": ErrorResponse, "description": "weights version conflict, or an update already running"},
    413: {"model": ErrorResponse, "description": "body, sequence or request too large"},
    422: {"model": ErrorResponse, "description": "well-formed body with invalid values"},
    429: {"model": ErrorResponse, "description": "admission queue full; retry after Retry-After seconds"},
    503: {"model": ErrorResponse, "description": "not ready or draining; retry after Retry-After seconds"},
    504: {"model": ErrorResponse, "description": "deadline_ms passed before the result was ready"},
}


def non_finite_error(index: int, where: str) -> ApiError:
    """422 ``non_finite_scores``: the served weights give this sequence NaN or infinite scores,
    which JSON cannot carry and a trainer must not average in."""
    return ApiError(422, "non_finite_scores", f"The model's scores of sequences[{index}] are not finite at {where}: its "
                    "logits overflow float32 or are NaN, so the served weights cannot score this sequence.",
                    f"sequences[{index}]")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA or not), or a RuntimeError naming memory; no torch import needed."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
