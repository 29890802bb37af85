"""uvicorn's h11 protocol, hardened against slow and hostile clients.

uvicorn bounds only the idle time between keep-alive requests. This subclass adds:

- a read timeout: a request's headers and body must arrive within ``read_timeout_s`` of its
  first byte (of the connection, for the first request; for a pipelined one, of the answer
  before it); else it is answered 408 (when no answer has started) and the connection is closed;
- a cap on open connections, below the process's descriptor limit: a new connection over the
  cap evicts the connection whose request has been arriving the longest, else an idle
  keep-alive one; when every connection is busy answering, the new one gets 503 and is
  closed. The server so never runs out of descriptors to accept with;
- the contract's JSON error body on the protocol errors uvicorn answers itself (a garbage
  request line, a bad Content-Length, oversized headers), instead of plain text.
"""

from __future__ import annotations

import logging
import os
import resource
import time

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_DESCRIPTOR_RESERVE = 64  # for model files, logs, worker pipes and the event loop itself
_DONE_STATES = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
# Set in a request's ASGI scope when the read timeout cut its body off: its handler counts the 408 sent, not a 499.
READ_TIMED_OUT = "packscore.read_timed_out"


def error_bytes(status: int, reason: str, type: str, message: str, extra_headers: str = "") -> bytes:
    """A complete HTTP/1.1 answer with the contract's JSON error body that closes the connection."""
    body = orjson.dumps({"error": {"type": type, "message": message, "param": None}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra_headers}\r\n"
    )
    return head.encode("ascii") + body


def default_max_connections() -> int:
    """The descriptor limit less the descriptors already open and a reserve (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, soft - in_use - _DESCRIPTOR_RESERVE)


class _Registry:
    """The connections of one server whose request is still arriving, oldest first."""

    def __init__(self, read_timeout_s: float, max_connections: int):
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.reading: dict["GuardedH11Protocol", float] = {}  # insertion order is arrival order
        self.evicted = 0
        self.timed_out = 0
        self.refused = 0


def guarded_protocol(read_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for one server (uvicorn.Config(http=...))."""
    registry = _Registry(read_timeout_s, max_connections)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"registry": registry})


class GuardedH11Protocol(H11Protocol):
    registry: _Registry  # set per server by guarded_protocol()

    _read_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.registry.max_connections and not self._evict_one():
            self.registry.refused += 1
            log.warning("%d connections open: refusing a new one", len(self.connections))
            transport.write(error_bytes(503, "Service Unavailable", "too_many_connections",
                                        "The server has too many open connections; retry.", "retry-after: 1\r\n"))
            transport.close()
            return
        self._start_reading()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and not self.transport.is_closing():
            self._start_reading()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state in _DONE_STATES:
            self._stop_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request that came in behind this one is read only now (h11 held its bytes, and
        # data_received saw the connection done): time it from here, as one arriving now would be.
        if (self._read_timer is None and not self.transport.is_closing() and self.conn.their_state not in _DONE_STATES
                and (self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0])):
            self._start_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reading()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # h11 refused the bytes (request line, headers, Content-Length): answer in the contract's shape.
        self._stop_reading()
        self.transport.write(error_bytes(400, "Bad Request", "malformed_request",
                                         "The request is not valid HTTP/1.1 (request line, headers or Content-Length)."))
        self.transport.close()

    # ---- the read timeout -------------------------------------------------------------------

    def _start_reading(self) -> None:
        self.registry.reading[self] = time.monotonic()
        self._read_timer = self.loop.call_later(self.registry.read_timeout_s, self._read_timed_out)

    def _stop_reading(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self.registry.reading.pop(self, None)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        self.registry.reading.pop(self, None)
        if self.transport.is_closing():
            return
        self.registry.timed_out += 1
        cycle = self.cycle
        # 408 for a request not yet answered (or the next one's headers), never for the rest of a
        # body already answered (a 401 or 404 sent before it was read)
        send_408 = (cycle is None or not cycle.response_started
                    or (cycle.response_complete and self.conn.their_state is not h11.SEND_BODY))
        if send_408:
            message = f"The request did not arrive within {self.registry.read_timeout_s:g} s (request_read_timeout_s)."
            self.transport.write(error_bytes(408, "Request Timeout", "request_timeout", message))
            if cycle is not None and not cycle.response_complete:
                cycle.scope[READ_TIMED_OUT] = True  # type: ignore[literal-required]
        self._close()

    def _close(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()  # a handler reading the body sees the disconnect
        self.transport.close()

    # ---- the connection cap ------------------------------------------------------------------

    def _evict_one(self) -> bool:
        """Closes the connection whose request has been arriving the longest, else an idle one."""
        victim = next((c for c in self.registry.reading if c is not self), None)
        if victim is None:
            victim = next((c for c in self.connections
                           if c is not self and isinstance(c, GuardedH11Protocol) and c._idle()), None)
        if victim is None:
            return False
        self.registry.evicted += 1
        if self.registry.evicted in (1, 10, 100) or self.registry.evicted % 1000 == 0:
            log.warning("connection cap (%d) reached: closed the oldest unfinished or idle connection (%d so far)",
                        self.registry.max_connections, self.registry.evicted)
        victim._stop_reading()
        victim._close()
        return True

    def _idle(self) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        return self not in self.registry.reading and (self.cycle is None or self.cycle.response_complete)
