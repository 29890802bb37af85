"""Request ids: every answer carries ``X-Request-Id``, and every log line written while a request is
handled names it, so a trainer's error and the server's log can be matched.

An incoming ``X-Request-Id`` (the first, if several) is kept when it is 1 to 128 characters of
visible ASCII (0x21-0x7E: no space, control or non-ASCII byte), so a trainer or a proxy can choose
it; any other value is replaced by one the server makes (32 hex digits), never refused.

The id lives in a context variable that ``_Gate`` sets at the start of each request and resets at
its end (uvicorn runs each request in a task of its own, so it is that request's for everything the
task and the threads it starts with ``asyncio.to_thread`` log). ``RequestIdFilter`` copies it onto
log records; a record may name a request itself with ``extra=for_request(request_id)`` (a scheduler
line about one sequence, written outside the request's task, or the protocol's own 400, 408 and 503),
and an exception that left a request carries its id (``tag``) for uvicorn's line about it.

Every line, uvicorn's access log included, goes to one stream (standard error) in one format,
``LOG_FORMAT``: ``configure_logging`` sets up the root logger and ``uvicorn_log_config`` sends
uvicorn's loggers to it.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import uuid
from collections.abc import Iterable
from contextvars import ContextVar

HEADER = b"x-request-id"  # ASGI header names are lower case
MAX_LENGTH = 128
SCOPE_KEY = "packscore.request_id"  # in the ASGI scope: the protocol's own 408 or 400 for the request names it
# Before the message, so that a traceback or a message ending in a newline does not push it to another line.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s:%(request_tag)s %(message)s"
_EXCEPTION_ID = "packscore_request_id"  # on an exception that left a request: that request's id
_EXCEPTION_LOGGED = "packscore_logged"  # on an exception whose traceback the gate logged
# uvicorn's lines that this server's own replace or that mislead: the protocol's own line names a 400
# with its id, status, peer and reason; an Upgrade header (curl --http2's h2c, a websocket) is ignored
# as RFC 9110 allows, and the request served over HTTP/1.1, so no library is missing.
_DROPPED = frozenset({
    "Invalid HTTP request received.",
    "Unsupported upgrade request.",
    "No supported WebSocket library detected. Please use \"pip install 'uvicorn[standard]'\", or install 'websockets' "
    "or 'wsproto' manually.",
})

current: ContextVar[str | None] = ContextVar("packscore_request_id", default=None)

_VALID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LENGTH)


def new_id() -> str:
    return uuid.uuid4().hex


def from_headers(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id: its own ``X-Request-Id`` where that is valid, else a new one."""
    for name, value in headers:
        if name == HEADER:
            return value.decode("ascii") if _VALID.fullmatch(value) else new_id()
    return new_id()


def outside_request() -> contextvars.Context:
    """A copy of the current context naming no request: for a task or callback started from a
    request's task that is no request's work (the shared readiness pass, the next pipelined request,
    the drain), which would otherwise inherit that request's id."""
    context = contextvars.copy_context()
    context.run(current.set, None)
    return context


def for_request(request_id: str | None) -> dict:
    """``extra=`` for a log call about one request, made outside that request's task."""
    return {"request_id": request_id}


def of_many(ids: Iterable[str | None], most: int = 8) -> str:
    """The distinct ids of the requests a log line about a whole row concerns: ``a, b`` or ``a, b and 3 more``."""
    distinct = list(dict.fromkeys(i for i in ids if i))
    return ", ".join(distinct[:most]) + (f" and {len(distinct) - most} more" if len(distinct) > most else "")


def tag(exc: BaseException, request_id: str, *, logged: bool = False) -> None:
    """Marks an exception leaving a request: uvicorn's line about it names that request, and is
    dropped where ``logged`` (the gate wrote its traceback already)."""
    try:
        setattr(exc, _EXCEPTION_ID, request_id)
        if logged:
            setattr(exc, _EXCEPTION_LOGGED, True)
    except AttributeError:  # an exception class with __slots__: its line names no request
        pass


def _exception(record: logging.LogRecord) -> BaseException | None:
    return record.exc_info[1] if record.exc_info else None


class RequestIdFilter(logging.Filter):
    """Gives every record ``request_id`` (the request's id, or None outside a request) and
    ``request_tag`` (`` request_id=<id>``, or empty) for the format to show."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = (getattr(record, "request_id", None) or current.get()
               or getattr(_exception(record), _EXCEPTION_ID, None))
        record.request_id = rid
        record.request_tag = f" request_id={rid}" if rid else ""
        return True


class UvicornDuplicates(logging.Filter):
    """Drops uvicorn's lines that repeat one of this server's own or mislead: "Exception in ASGI
    application" for an exception whose traceback the gate logged, "Invalid HTTP request received.",
    which the protocol's own line about its 400 replaces, and the two warnings about an ignored
    Upgrade header (the second asks to install a websocket library this service has no use for)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in _DROPPED:
            return False
        return not getattr(_exception(record), _EXCEPTION_LOGGED, False)


_UVICORN_DUPLICATES = UvicornDuplicates()  # one instance: uvicorn applies the configuration at every Config()


def configure_logging(level: str) -> None:
    """The process's log: standard error, ``LOG_FORMAT``, each line naming its request (if any)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, handlers=[handler])


def uvicorn_log_config() -> dict:
    """uvicorn's logging configuration: its loggers, the access log's included, write nothing
    themselves and pass their lines to the root logger's handler (``configure_logging``), so that
    every line goes to one stream in one format naming its request. Levels are uvicorn's: its
    ``log_level`` sets those of ``uvicorn.error`` and ``uvicorn.access``, and ``access_log=False``
    silences the latter."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"duplicates": {"()": lambda: _UVICORN_DUPLICATES}},
        "loggers": {
            "uvicorn": {"handlers": [], "propagate": True, "level": "INFO"},
            "uvicorn.error": {"handlers": [], "propagate": True, "filters": ["duplicates"]},
            "uvicorn.access": {"handlers": [], "propagate": True, "level": "INFO"},
        },
    }
