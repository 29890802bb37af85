"""uvicorn's h11 protocol, hardened against slow and hostile clients.

uvicorn bounds only the idle time between keep-alive requests. This subclass adds:

- a read timeout: a request's headers and body must arrive within ``read_timeout_s`` of its
  first byte (of the connection, for the first request; for a pipelined one, of the answer
  before it); else it is answered 408 (when no answer has started) and the connection is closed;
- a cap on open connections, below the process's descriptor limit: a new connection over the
  cap evicts the connection whose request has been arriving the longest, else an idle
  keep-alive one; when every connection is busy answering (an answer still being written
  included), the new one gets 503 and is closed. The server so never runs out of descriptors to accept with;
- a send timeout: an answer whose bytes stop draining (the client reads none of what is left,
  in this process's buffer or the kernel's) for ``send_timeout_s`` is dropped and its
  connection reset, as nginx's ``send_timeout`` does; progress of any size restarts the clock;
- the contract's JSON error body on the protocol errors uvicorn answers itself (a garbage
  request line, a bad Content-Length, oversized headers, a chunked body whose framing breaks),
  instead of plain text, its message naming the part that broke (the head or the chunked body);
- 400 ``http_version_not_supported`` for a request line of another major version (``HTTP/2.0`` as an
  h2 client's prior-knowledge preface sends it, ``HTTP/3.0``, ``HTTP/0.9``), which h11 parses and uvicorn
  would serve as HTTP/1.1: a 400, not RFC 9110's 505, as the contract (docs/api.md) allows no 5xx but
  503 and 504; a higher 1.x minor is HTTP/1.1's (RFC 9112, 2.3), and an ``Upgrade`` header is ignored;
- a lingering close (RFC 9112, 9.6): a connection closed after its answer while the client may
  still be sending (the request's body still arriving, as at a 413 or at a 401 to a client that
  sent ``Connection: close``, or at a 400 for bytes h11 refused before the request's end; or bytes
  behind the request, pipelined, still unread in h11's buffer or the kernel's) first half-closes,
  then reads and drops the rest until the client closes or the read timeout (of the request, else
  from the close). Closed at once, the unread bytes would make the kernel reset it, and a client
  that reads its answer only once it has sent everything (Python's urllib) would meet that reset
  instead. Closes made on purpose (read timeout, eviction, send timeout, shutdown) never linger.
  A body past ``max_body_bytes`` still arriving after an answer that kept the connection (a GET
  route reads none, a 401) is closed the same way, not parsed by h11 to its end for a next request.

Each answer the protocol sends itself (400, 408, 503) logs one line naming its request id, its
status, the peer and why (a refused header line by its name alone: its value may be a key), without a
traceback: these answers pass no access log. Those lines and the send timeout's share one budget: a
WARNING up to ``_ANSWER_WARNINGS`` a window, past them DEBUG, counted in one WARNING at the window's
end. Each answer is counted once in ``packscore_requests_total`` and timed once in
``packscore_request_latency_seconds``: by the gate (service/http/app.py) under its route where a
request it runs has not answered yet (the protocol marks its scope, ``PROTOCOL_ANSWER``), else by
``on_answered`` (no request's path was read, or its answer was already out), timed from the
request's first byte as the read timeout is. Each connection it closes itself, answered or evicted,
is counted by reason (``on_closed``: the reasons of ``packscore_connections_closed_total``,
service/http/metrics.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import socket
import struct
import sys
import termios
import time
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.http.request_id import SCOPE_KEY, for_request, from_headers, new_id, outside_request
from service.http.wire import (BODY_REFUSED, HEAD_REFUSED, BrokenBody, UnsupportedVersion, VersionCheckedConnection,
                               declared_length, error_bytes, without_header_value)

log = logging.getLogger(__name__)

_DESCRIPTOR_RESERVE = 64  # for model files, logs, worker pipes and the event loop itself
# a request asking for an Upgrade has all arrived in MIGHT_SWITCH_PROTOCOL (h11 leaves it once the answer is not a 101)
_DONE_STATES = (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
# The protocol's own lines (answers, send timeouts) logged at WARNING per window; the rest at DEBUG, then counted.
_ANSWER_WARNINGS, _ANSWER_WINDOW_S = 10, 60.0
# Set in a request's ASGI scope to the status the protocol answered it (408: its body did not arrive in time; 400:
# its body's framing broke): what the gate counts for it, and a 408's handler counts request_timeout, not a 499.
PROTOCOL_ANSWER = "packscore.protocol_answer"
# What the protocol answers itself: the statuses on_answered is called with.
PROTOCOL_STATUSES = (400, 408, 503)


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
    """One server's guard: its limits and counts, and its connections whose request is still arriving."""

    def __init__(self, read_timeout_s: float, max_connections: int, send_timeout_s: float,
                 on_send_timeout: Callable[[], None] | None, on_closed: Callable[[str], None] | None,
                 max_body_bytes: int | None = None, on_answered: Callable[[int, float], None] | None = None):
        self.read_timeout_s = read_timeout_s
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.send_timeout_s = send_timeout_s
        # How often a stalled answer is looked at: it is dropped at most a quarter (1 s) past the timeout.
        self.send_poll_s = min(send_timeout_s / 4, 1.0)
        self.on_send_timeout = on_send_timeout or (lambda: None)
        self.on_closed = on_closed or (lambda reason: None)
        self.on_answered = on_answered or (lambda status, seconds: None)
        self.reading: dict["GuardedH11Protocol", float] = {}  # insertion order is arrival order
        self.evicted = 0
        self.timed_out = 0
        self.refused = 0
        self.send_timed_out = 0
        self._window_start = -_ANSWER_WINDOW_S
        self._warned = self._quieted = self._quieted_sends = 0

    def answer_level(self, send_timeout: bool = False) -> int:
        """WARNING for the first lines of the protocol's own in a window (an answer it sends itself, or
        a send timeout's close), DEBUG past them: a client sending garbage in a loop, or many clients
        that read none of their answers, write a few lines a minute, not one each."""
        now = time.monotonic()
        if not self._quieted and now - self._window_start >= _ANSWER_WINDOW_S:
            self._window_start, self._warned = now, 0
        if self._warned < _ANSWER_WARNINGS:
            self._warned += 1
            return logging.WARNING
        if not self._quieted:
            outside_request().run(  # a line about many requests names none
                log.warning, "more than %d of the protocol's own lines (its answers 400, 408, 503 and its send "
                "timeouts) within %g s: the rest of this window's are logged at DEBUG (--log-level debug shows each), "
                "then counted in one line",
                _ANSWER_WARNINGS, _ANSWER_WINDOW_S)
            asyncio.get_running_loop().call_later(self._window_start + _ANSWER_WINDOW_S - now, self._end_quiet,
                                                  context=outside_request())
        self._quieted += 1
        self._quieted_sends += int(send_timeout)
        return logging.DEBUG

    def _end_quiet(self) -> None:
        sends = self._quieted_sends
        log.warning("%d more of the protocol's own lines in the last %g s were logged at DEBUG only: %d of its answers "
                    "(400, 408, 503), counted by status in packscore_requests_total, and %d send timeouts, counted in "
                    "packscore_send_timeouts_total", self._quieted, _ANSWER_WINDOW_S, self._quieted - sends, sends)
        self._window_start, self._warned, self._quieted, self._quieted_sends = time.monotonic(), 0, 0, 0


def guarded_protocol(read_timeout_s: float, max_connections: int, send_timeout_s: float = 60.0,
                     on_send_timeout: Callable[[], None] | None = None,
                     on_closed: Callable[[str], None] | None = None,
                     max_body_bytes: int | None = None,
                     on_answered: Callable[[int, float], None] | None = None) -> type[H11Protocol]:
    """The protocol class for one server (uvicorn.Config(http=...)); ``on_send_timeout`` counts a
    connection closed by the send timeout, ``on_closed(reason)`` one closed by the cap, a protocol
    error, another HTTP version or the read timeout (reason: too_many_connections, evicted, malformed_request,
    http_version_not_supported, request_timeout);
    ``on_answered(status, seconds)`` an answer of the protocol's own (PROTOCOL_STATUSES) that no request's
    gate counts, and the seconds from its request's first byte (its read clock's start) to it (0 for the
    cap's 503, refused as it connects); ``max_body_bytes`` (--max-request-bytes): past it, the rest of an
    answered body is not parsed."""
    registry = _Registry(read_timeout_s, max_connections, send_timeout_s, on_send_timeout, on_closed, max_body_bytes,
                         on_answered)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"registry": registry})


class _LingeringTransport:
    """A connection's transport whose ``close()`` lingers while the client may still be sending
    (the module's docstring says why); every other call goes to the transport itself."""

    lingering = False

    def __init__(self, transport, protocol: "GuardedH11Protocol"):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering or self._transport.is_closing() or not self._protocol._may_be_sending():
            self._transport.close()
            return
        self.lingering = True
        if self._protocol._read_timer is None:  # its request had all arrived: the rest is timed from the close
            self._protocol._start_reading()
        if self._transport.can_write_eof():
            self._transport.write_eof()  # the answer, then FIN: the client knows no more comes
        self._transport.resume_reading()  # paused while the handler held its body back

    def close_now(self) -> None:
        self._transport.close()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()


class GuardedH11Protocol(H11Protocol):
    registry: _Registry  # set per server by guarded_protocol()

    _read_timer = None
    _read_started: float | None = None  # when the read timer of the request still arriving started
    _send_timer = None
    _send_left = 0  # bytes of answers not yet acknowledged by the client, at the last look
    _send_progress_at = 0.0
    _shutting_down = False
    _unread = 0  # bytes of the request's body that came after its answer
    _close_counted = False  # on_closed counted this connection (its 400): a lingering close's end is not counted again
    _tls_hello = False  # its first bytes were a TLS handshake record: a client using https:// on this port
    transport: _LingeringTransport

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own connection, as it built it (its limit on a request's head): only the version check is added
        self.conn.__class__ = VersionCheckedConnection

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))
        if len(self.connections) > self.registry.max_connections and not self._evict_one():
            self.registry.refused += 1
            self.registry.on_closed("too_many_connections")
            self.registry.on_answered(503, 0.0)  # before any request: no gate counts it
            rid = new_id()
            self._log_answer(503, rid, f"{len(self.connections) - 1} connections open (max_connections "
                                       f"{self.registry.max_connections}), each busy answering: refused a new one")
            transport.write(error_bytes(503, "Service Unavailable", "too_many_connections",
                                        "The server has too many open connections; retry.", "retry-after: 1\r\n",
                                        request_id=rid))
            transport.close()
            return
        self._start_reading()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # the rest of a body already answered: dropped, never parsed or kept
        answered = self._answered_body_arriving()
        if self._read_timer is None and not self.transport.is_closing():
            self._start_reading()  # the first bytes of the next request on a kept-alive connection
        if self.cycle is None and data.startswith(b"\x16\x03"):
            self._tls_hello = True
        super().data_received(data)
        if self.transport.lingering:
            return  # a 400 for these bytes: the read timer bounds the lingering close
        if answered and self._answered_body_arriving():  # all of it was body: a chunked one shows its size only so
            self._unread += len(data)
            if self.registry.max_body_bytes is not None and self._unread > self.registry.max_body_bytes:
                self._linger_after_answer()
                return
        if self.conn.their_state in _DONE_STATES:
            self._stop_reading()
        elif self._between_requests():
            # The rest of a body answered early (a 401) came: the connection is idle, not reading.
            # uvicorn cancelled its keep-alive timer on these bytes and arms it only as an answer ends.
            self._stop_reading()
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _between_requests(self) -> bool:
        """Whether the connection waits for a next request of which no byte has come."""
        return (not self.transport.is_closing() and self.conn.our_state is h11.IDLE
                and self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0])

    def on_response_complete(self) -> None:
        # An answer under the high-water mark never pauses the transport: what is left of it is watched here.
        self._watch_sending()
        # Called from the finished request's task: what follows (the next pipelined request, its 400, the
        # keep-alive and read timers) is not that request's, and would otherwise log under its id.
        outside_request().run(self._after_response)

    def _after_response(self) -> None:
        self._unread = 0
        if self._answered_body_arriving() and self._declared_past_limit():
            self._linger_after_answer()
        super().on_response_complete()
        # A pipelined request that came in behind this one is read only now (h11 held its bytes, and
        # data_received saw the connection done): time it from here, as one arriving now would be.
        if (self._read_timer is None and not self.transport.is_closing() and self.conn.their_state not in _DONE_STATES
                and (self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0])):
            self._start_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reading()
        self._stop_sending()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self._shutting_down = True  # the server exits: nothing lingers
        if self.transport.lingering:  # its answer is out and h11 already saw the connection closed
            self.transport.close_now()
            return
        super().shutdown()

    def _body_arriving(self) -> bool:
        """Whether a close now would leave the request's body unread; a lingering close waits for it
        within the read timeout (the timer that runs until the request has arrived)."""
        return (self.conn.their_state is h11.SEND_BODY and self._read_timer is not None
                and not self._shutting_down)

    def _may_be_sending(self) -> bool:
        """Whether a close now could leave bytes of the client's unread: a request still arriving (its
        body, or one h11 refused before its end), pipelined bytes h11 holds, or bytes in the kernel."""
        if self._shutting_down:
            return False
        conn = self.conn
        if self._read_timer is not None and conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            return True
        if conn.their_state is not h11.ERROR and conn.trailing_data[0]:
            return True
        return self._kernel_unread() > 0

    def _kernel_unread(self) -> int:
        sock = self.transport.get_extra_info("socket")
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]
        except (OSError, AttributeError, ValueError):
            return 0

    def _answered_body_arriving(self) -> bool:
        """Whether the answer is out, the connection kept, and the request's body still arriving."""
        return (self.conn.our_state is h11.DONE and self._body_arriving() and not self.transport.is_closing())

    def _declared_past_limit(self) -> bool:
        limit, cycle = self.registry.max_body_bytes, self.cycle
        declared = declared_length(cycle.scope) if cycle is not None else None
        return limit is not None and declared is not None and declared > limit

    def _linger_after_answer(self) -> None:
        """Closes a kept connection whose answered body runs past the limit: no next request can come
        before that body's end, and h11 would parse it all; the lingering close only drops it."""
        self._unset_keepalive_if_required()
        self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_sending()

    def send_400_response(self, msg: str) -> None:
        # h11 refused the bytes (request line, headers, Content-Length, chunked framing): answer in the contract's shape.
        if isinstance(unsupported := sys.exc_info()[1], UnsupportedVersion):
            self._answer_unsupported_version(unsupported)
            return
        self.registry.on_closed("malformed_request")
        self._close_counted = True
        self._count_answer(400)
        rid = self._running_id() or new_id()  # a body h11 refused mid-request: that request's id, as its 408's
        # Called from uvicorn's handler of h11's error, which names what is wrong (uvicorn's own line does not).
        refused = without_header_value(str(sys.exc_info()[1] or msg))
        # h11 quotes the offending bytes: a line per client, not a client's 16 KiB of headers
        tls = " (a TLS handshake: the client uses https:// on this plain-HTTP port)" if self._tls_hello else ""
        self._log_answer(400, rid, f"not valid HTTP/1.1: {refused[:200]}{'...' if len(refused) > 200 else ''}{tls}")
        what = BODY_REFUSED if isinstance(sys.exc_info()[1], BrokenBody) else HEAD_REFUSED
        self.transport.write(error_bytes(400, "Bad Request", "malformed_request", what, request_id=rid))
        self.transport.close()
        if not self.transport.lingering:
            self._stop_reading()
        elif self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the handler still reading the body ends now, not at the lingering's end
            self.cycle.message_event.set()

    def _answer_unsupported_version(self, refused: UnsupportedVersion) -> None:
        """400 for a request of another major version, its head parsed (no earlier request's answer is pending:
        h11 reads a next request only then), and close; a body it declared is dropped by the lingering close.
        Not RFC 9110's 505: the contract (docs/api.md) calls any 5xx but 503 and 504 a bug."""
        self.registry.on_closed("http_version_not_supported")
        self._close_counted = True
        self._count_answer(400)
        rid = from_headers(refused.headers)
        self._log_answer(400, rid, f"HTTP/{refused.version} is not supported (this port speaks HTTP/1.1 and 1.0)")
        self.transport.write(error_bytes(
            400, "Bad Request", "http_version_not_supported",
            f"HTTP/{refused.version} is not supported: this server speaks HTTP/1.1 (and HTTP/1.0) only, with no "
            "HTTP/2 or HTTP/3 on this port; send the request as HTTP/1.1.", request_id=rid))
        self.transport.close()
        if not self.transport.lingering:
            self._stop_reading()

    def _count_answer(self, status: int) -> None:
        """Counts and times an answer the protocol wrote, once: a request whose handler has not answered is
        counted by its gate as it ends, under its route; any other (no path read yet, or its answer already
        out) here."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.scope[PROTOCOL_ANSWER] = status  # type: ignore[literal-required]
        else:  # timed as the read timeout is: a 408's sample is that timeout
            started = self._read_started
            self.registry.on_answered(status, 0.0 if started is None else time.monotonic() - started)

    def _running_id(self) -> str | None:
        """The id of the request this connection is still answering; None between requests (a next
        request's bytes refused are no earlier request's). Named here where the gate has not run yet (its
        body came with its headers): the gate then keeps that name."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return None
        if SCOPE_KEY not in cycle.scope:
            cycle.scope[SCOPE_KEY] = from_headers(cycle.scope["headers"])  # type: ignore[literal-required]
        return cycle.scope[SCOPE_KEY]  # type: ignore[literal-required]

    def _log_answer(self, status: int, rid: str, why: str) -> None:
        """One line for an answer the protocol sends itself, passing no access log: no traceback; a
        flood of bad clients writes a few WARNING lines a minute, the rest at DEBUG and counted (``answer_level``)."""
        log.log(self.registry.answer_level(), "answered %d to %s: %s", status, self._peer(), why,
                extra=for_request(rid))

    def _peer(self) -> str:
        return "%s:%d" % tuple(self.client) if self.client else "an unknown peer"

    # ---- the read timeout -------------------------------------------------------------------

    def _start_reading(self) -> None:
        self.registry.reading[self] = self._read_started = time.monotonic()
        self._read_timer = self.loop.call_later(self.registry.read_timeout_s, self._read_timed_out)

    def _stop_reading(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_started = None
        self.registry.reading.pop(self, None)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        self.registry.reading.pop(self, None)
        lingering = self.transport.lingering
        if self.transport.is_closing() and not lingering:
            return
        if not self._close_counted:
            self.registry.timed_out += 1
            self.registry.on_closed("request_timeout")
        if lingering:  # what the client still sent did not end in time: counted as any slow body, unless its 400 was
            self.transport.close_now()
            return
        cycle = self.cycle
        # 408 for a request not yet answered (or the next one's headers), never for the rest of a
        # body already answered (a 401 or 404 sent before it was read)
        send_408 = (cycle is None or not cycle.response_started
                    or (cycle.response_complete and self.conn.their_state is not h11.SEND_BODY))
        if send_408:
            message = f"The request did not arrive within {self.registry.read_timeout_s:g} s (request_read_timeout_s)."
            ongoing = cycle is not None and not cycle.response_complete  # else the 408 is the next request's
            scope = cycle.scope if ongoing else None  # type: ignore[union-attr]
            rid = self._running_id() or new_id()
            what = f"the body of {scope['method']} {scope['path']}" if scope else "a request's headers"
            self._log_answer(408, rid, f"{what} did not arrive within {self.registry.read_timeout_s:g} s "
                                       "(request_read_timeout_s)")
            self.transport.write(error_bytes(408, "Request Timeout", "request_timeout", message, request_id=rid))
            self._count_answer(408)
        self._close()

    def _close(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()  # a handler reading the body sees the disconnect
        self.transport.close_now()
        self._watch_sending()  # close() waits for the buffer to drain: a client reading none of it would hold it

    # ---- the send timeout -------------------------------------------------------------------

    def _watch_sending(self) -> None:
        if self._send_timer is None and self.transport is not None and self.transport.get_write_buffer_size():
            self._send_left = self._unsent()
            self._send_progress_at = self.loop.time()
            self._send_timer = self.loop.call_later(self.registry.send_poll_s, self._check_sending)

    def _stop_sending(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _check_sending(self) -> None:
        self._send_timer = None
        if not self.transport.get_write_buffer_size() and not self.flow.write_paused:
            return  # all handed to the kernel: this process holds nothing (an idle connection is keep-alive's)
        left, now = self._unsent(), self.loop.time()
        if left != self._send_left:  # the client acknowledged some, or the answer grew (written while not paused)
            self._send_left, self._send_progress_at = left, now
        elif now - self._send_progress_at >= self.registry.send_timeout_s:
            self._send_timed_out(left)
            return
        self._send_timer = self.loop.call_later(self.registry.send_poll_s, self._check_sending)

    def _unsent(self) -> int:
        """Bytes written and not yet acknowledged: this process's buffer and the kernel's send queue."""
        left = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # The kernel refills from our buffer only once a third of its own has drained (up to 4 MiB
            # by default): without its queue, a slow but steady reader would look stalled for seconds.
            try:
                left += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
            except (OSError, AttributeError, ValueError):  # not Linux (no TIOCOUTQ on sockets): our buffer alone
                pass
        return left

    def _send_timed_out(self, left: int) -> None:
        self.registry.send_timed_out += 1
        self.registry.on_send_timeout()
        # Scheduled from the answering request's task: the line names that request. Budgeted as the answers are.
        log.log(self.registry.answer_level(send_timeout=True), "send timeout: closed a connection to %s whose answer "
                "did not drain for %g s (send_timeout_s), %d bytes left undelivered", self._peer(),
                self.registry.send_timeout_s, left)
        self._stop_reading()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        sock = self.transport.get_extra_info("socket")
        try:  # a reset, not a FIN behind unread bytes: the kernel drops its copy too (nginx: reset_timedout_connection)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, AttributeError):
            pass
        self.transport.abort()  # close() would wait for the buffer to drain: drop it

    # ---- the connection cap ------------------------------------------------------------------

    def _evict_one(self) -> bool:
        """Closes the connection whose request has been arriving the longest, else an idle one; never
        one still writing an answer (its descriptor would stay until the client read it)."""
        victim = next((c for c in self.registry.reading if c is not self and not c._writing()), None)
        if victim is None:
            victim = next((c for c in self.connections
                           if c is not self and isinstance(c, GuardedH11Protocol) and c._idle()), None)
        if victim is None:
            return False
        self.registry.evicted += 1
        self.registry.on_closed("evicted")
        if self.registry.evicted in (1, 10, 100) or self.registry.evicted % 1000 == 0:
            log.warning("connection cap (%d) reached: closed the oldest unfinished or idle connection (%d so far)",
                        self.registry.max_connections, self.registry.evicted)
        victim._stop_reading()
        victim._close()
        return True

    def _idle(self) -> bool:
        if self.transport is None or self.transport.is_closing():
            return False
        return (self not in self.registry.reading and (self.cycle is None or self.cycle.response_complete)
                and not self._writing())

    def _writing(self) -> bool:
        """Whether an answer is still in this process's buffer: closing waits for it, the descriptor stays."""
        return self.transport is not None and bool(self.transport.get_write_buffer_size())
