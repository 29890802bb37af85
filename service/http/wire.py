"""HTTP/1.1 below the protocol class (service/http/protocol.py): the major-version check h11 lacks,
which part of a request h11 refused (its head or its chunked body), the bytes of an answer the protocol writes itself, what of a refused header line may be logged, and
the body length a request declares."""

from __future__ import annotations

import ast
import re

import h11
import orjson

_REFUSED_HEADER = re.compile(r"illegal header line: (?:bytearray\()?(b'.*'|b\".*\")\)?", re.DOTALL)  # h11's quote


class UnsupportedVersion(h11.RemoteProtocolError):
    """A request whose HTTP major version is not 1: raised where uvicorn catches h11's refusals, answered 400."""

    def __init__(self, request: h11.Request):
        self.version = request.http_version.decode("ascii")
        self.headers = [(name.lower(), value) for name, value in request.headers]
        super().__init__(f"HTTP/{self.version} is not HTTP/1.x")


# What a 400 tells the client for each part h11 may refuse, in the terms of a client's own code.
HEAD_REFUSED = "The request is not valid HTTP/1.1 (request line, headers or Content-Length)."
BODY_REFUSED = ("The request's chunked body is not valid HTTP/1.1 framing (a chunk-size line that is not hex, "
                "a chunk's data not followed by CRLF, or a bad trailer).")


class BrokenBody(h11.RemoteProtocolError):
    """h11 refused bytes of a request's body, its head parsed: only chunked framing can break there."""


class VersionCheckedConnection(h11.Connection):
    """h11's server side, refusing a request line of another major version once it is parsed, and telling a
    refused body (``BrokenBody``) from a refused head: the class given to the connection uvicorn built (no
    state of its own)."""

    def next_event(self):
        in_body = self.their_state is h11.SEND_BODY
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as refused:
            if in_body:
                raise BrokenBody(str(refused), error_status_hint=refused.error_status_hint) from refused
            raise
        if isinstance(event, h11.Request) and not event.http_version.startswith(b"1."):
            raise UnsupportedVersion(event)
        return event


def error_bytes(status: int, reason: str, type: str, message: str, extra_headers: str = "", *,
                request_id: str) -> bytes:
    """A complete HTTP/1.1 answer with the contract's JSON error body that closes the connection."""
    body = orjson.dumps({"error": {"type": type, "message": message, "param": None}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\nx-request-id: {request_id}\r\n{extra_headers}\r\n"
    )
    return head.encode("ascii") + body


def without_header_value(refused: str) -> str:
    """h11's reason for refusing bytes, a header line it quotes cut to that header's name: its value
    may be a key (``Authorization: Bearer <key>\\r`` from a key file with a CRLF ending)."""
    if not refused.startswith("illegal header line"):
        return refused
    quoted = _REFUSED_HEADER.fullmatch(refused)
    if quoted is None:  # a quote of another form: nothing of it is logged
        return "illegal header line (not quoted: it may hold a key)"
    line = ast.literal_eval(quoted.group(1))
    if b":" not in line:
        return "illegal header line (no ':'; not quoted, it may hold a key)"
    name = (line.split(b":", 1)[0].split() or [b""])[0][:64].decode("latin-1")
    return f"illegal header line {name!r} (its value is not logged)"


def declared_length(scope: dict) -> int | None:
    """The body length an ASGI request's Content-Length declares; None without one (chunked) or for
    one that is not a number (h11 refuses those before the app sees them)."""
    value = dict(scope["headers"]).get(b"content-length", b"")
    return int(value) if value.isdigit() else None
