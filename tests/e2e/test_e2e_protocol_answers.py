"""The answers the protocol layer writes itself (service/http/protocol.py: the read timeout's 408, a
malformed request's 400, another HTTP major version's 400, the connection cap's 503) are each counted
once in packscore_requests_total, and timed once in packscore_request_latency_seconds, as a real
server's /metrics shows: under route "other" where no request's path was read (timed from the request's
first byte), under the request's route where its handler had not answered yet (docs/deployment.md,
docs/admission.md)."""

from __future__ import annotations

import re
import socket
import time

import httpx
import orjson

from service.local_server import LocalServer
from tests.e2e.helpers import fake_server, read_until_closed
from tests.live_metrics import Scrape

_SCORE_HEAD = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
_BODY = b'{"sequences": [{"input_ids": [1, 2, 3]}]}'


def _connect(server: LocalServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _answered(server: LocalServer) -> dict[tuple[str, str], float]:
    """packscore_requests_total of the real /metrics: (route, status) -> count."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(route, status): float(value) for route, status, value in
            re.findall(r'^packscore_requests_total\{route="([^"]*)",status="(\d+)"\} (\S+)$', text, re.M)}


def _answered_once(server: LocalServer, expected: dict[tuple[str, str], float], limit_s: float = 5.0) -> dict:
    """The counts once they hold ``expected`` (a handler counts its request as it ends), or after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        counted = _answered(server)
        if all(counted.get(key) == value for key, value in expected.items()) or time.monotonic() > deadline:
            return counted
        time.sleep(0.05)


def _timed(server: LocalServer) -> tuple[float, float]:
    """packscore_request_latency_seconds of route "other" in the real /metrics, parsed: (count, sum)."""
    metrics = Scrape(httpx.get(server.url + "/metrics", timeout=10).text)
    return (metrics.value("packscore_request_latency_seconds_count", route="other"),
            metrics.value("packscore_request_latency_seconds_sum", route="other"))


def _moved(before: tuple, after: tuple) -> tuple[float, float]:
    return (after[0] or 0.0) - (before[0] or 0.0), (after[1] or 0.0) - (before[1] or 0.0)


def _answered_under_other(counted: dict[tuple[str, str], float]) -> float:
    return sum(value for (route, _), value in counted.items() if route == "other")


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def test_the_read_timeouts_408_is_counted_once_whether_or_not_a_path_was_read(tmp_path):
    server = fake_server(tmp_path, "--request-read-timeout-s", "1").wait_ready()
    try:
        at_start, timed_at_start = _answered(server), _timed(server)
        with _connect(server) as headers, _connect(server) as body, _connect(server) as pipelined:
            headers.sendall(_SCORE_HEAD + b"Content-Ty")  # no path read: the headers never end
            body.sendall(_SCORE_HEAD + b"Content-Length: 1000\r\n\r\n{")  # /score's handler waits for the body
            # an answered request, then the next one's headers never end
            pipelined.sendall(_SCORE_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY) + _SCORE_HEAD)
            answers = [read_until_closed(sock, 6)[0] for sock in (headers, body, pipelined)]
        counted = _answered_once(server, {("other", "408"): 2.0, ("/score", "408"): 1.0})
        timed = _timed(server)
    finally:
        server.stop()
    assert [_status(a) for a in answers[:2]] == [408, 408], answers
    # one sample each, as counted: the read timeout, from the request's first byte (the pipelined one's: its answer's)
    assert timed_at_start == (0.0, 0.0), timed_at_start  # there before the first, for a dashboard's rate()
    assert timed[0] == _answered_under_other(counted) == 2.0 and 2 * 0.99 <= timed[1] < 2 * 3, (timed, counted)
    assert answers[2].startswith(b"HTTP/1.1 200 ") and _status(answers[2][answers[2].index(b"HTTP/1.1 ", 1):]) == 408
    assert at_start.get(("other", "408")) == 0.0, at_start  # there before the first, for increase()
    assert counted.get(("other", "408")) == 2.0 and counted.get(("/score", "408")) == 1.0, counted
    assert counted.get(("/score", "200")) == 1.0 and counted.get(("/score", "499"), 0.0) == 0.0, counted


def test_a_malformed_requests_400_is_counted_once_under_the_route_that_was_read(tmp_path):
    server = fake_server(tmp_path).wait_ready()
    try:
        at_start, timed_at_start = _answered(server), _timed(server)
        answers = []
        for raw in (b"GARBAGE\x01 / HTTP/9\r\n\r\n",  # no path read
                    b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",  # h11 refuses the headers
                    # /score's handler waiting for a chunked body whose framing breaks: its route is known
                    _SCORE_HEAD + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n"):
            with _connect(server) as sock:
                sock.sendall(raw)
                answers.append(read_until_closed(sock, 10)[0])
        counted = _answered_once(server, {("other", "400"): 2.0, ("/score", "400"): 1.0})
        timed = _moved(timed_at_start, _timed(server))
    finally:
        server.stop()
    assert [_status(a) for a in answers] == [400, 400, 400], answers
    assert timed[0] == _answered_under_other(counted) == 2.0 and 0.0 < timed[1] < 1.0, (timed, counted)
    assert at_start.get(("other", "400")) == 0.0, at_start
    assert counted.get(("other", "400")) == 2.0 and counted.get(("/score", "400")) == 1.0, counted
    assert counted.get(("/score", "499"), 0.0) == 0.0, counted  # what its handler met was not a client gone


def test_a_broken_chunked_body_is_counted_as_the_400_sent_not_as_a_client_gone(tmp_path):
    # The handler reading the body meets the protocol's 400 (h11 refused a chunk's size): its rejection,
    # and the update it was, count that 400's type, as a 408 there counts request_timeout.
    server = fake_server(tmp_path, "--weights-root", str(tmp_path)).wait_ready()
    try:
        answers = []
        for head in (_SCORE_HEAD, _SCORE_HEAD.replace(b"/score", b"/v1/weights")):
            with _connect(server) as sock:
                sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n")
                answers.append(read_until_closed(sock, 10)[0])
        counted = _answered_once(server, {("/score", "400"): 1.0, ("/v1/weights", "400"): 1.0})
        metrics = Scrape(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        server.stop()
    assert [_status(a) for a in answers] == [400, 400] and all(b"malformed_request" in a for a in answers), answers
    assert counted.get(("/score", "400")) == 1.0 and counted.get(("/v1/weights", "400")) == 1.0, counted
    rejected = {r: metrics.value("packscore_rejections_total", reason=r) for r in ("malformed_request", "client_disconnected")}
    assert rejected == {"malformed_request": 2.0, "client_disconnected": 0.0}, rejected
    updates = {o: metrics.value("packscore_weights_updates_total", model="", outcome=o)
               for o in ("malformed_request", "client_disconnected")}
    assert updates == {"malformed_request": 1.0, "client_disconnected": 0.0}, updates


def test_the_connection_caps_503_is_counted(tmp_path):
    # One connection busy answering a slow forward (never evicted): the next one gets the cap's 503.
    server = fake_server(tmp_path, "--max-connections", "1", env={"FAKE_SECONDS_PER_TOKEN": "0.01"}).wait_ready()
    try:
        at_start, timed_at_start = _answered(server), _timed(server)
        body = b'{"sequences": [{"input_ids": [%s]}]}' % b", ".join(b"1" for _ in range(300))  # about 3 s of forward
        with _connect(server) as busy:
            busy.sendall(_SCORE_HEAD + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            time.sleep(0.5)  # its request has arrived: it is answering
            with _connect(server) as refused:
                refused.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                data, _ = read_until_closed(refused, 10)
            scored, _ = read_until_closed(busy, 30)
        counted = _answered_once(server, {("other", "503"): 1.0})
        timed = _moved(timed_at_start, _timed(server))
    finally:
        server.stop()
    assert timed == (1.0, 0.0) and _answered_under_other(counted) == 1.0, (timed, counted)  # refused as it connects
    assert _status(data) == 503 and b"too_many_connections" in data, data
    assert scored.startswith(b"HTTP/1.1 200 "), scored[:300]
    assert at_start.get(("other", "503")) == 0.0, at_start
    assert counted.get(("other", "503")) == 1.0 and counted.get(("/healthz", "503"), 0.0) == 0.0, counted


def test_a_request_of_another_http_major_version_is_answered_400_counted_and_logged(tmp_path):
    # h11 parses any "HTTP/d.d": uvicorn served HTTP/2.0 (an h2 client's prior-knowledge preface), 3.0 and 0.9 as 1.1;
    # a 400, not RFC 9110's 505: docs/api.md calls any 5xx but 503 and 504 a bug
    other = [b"GET /healthz HTTP/2.0\r\nHost: x\r\nX-Request-Id: asked-for-h2\r\n\r\n",
             b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
             b"GET /readyz HTTP/3.0\r\nHost: x\r\n\r\n",
             b"GET /healthz HTTP/0.9\r\n\r\n",
             b"POST /score HTTP/2.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
             % (len(_BODY), _BODY)]
    served = [b"GET /healthz HTTP/1.0\r\n\r\n", b"GET /healthz HTTP/1.2\r\nHost: x\r\nConnection: close\r\n\r\n",
              b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
              b"HTTP2-Settings: \r\nConnection: close\r\n\r\n"]
    server = fake_server(tmp_path).wait_ready()
    try:
        at_start = Scrape(httpx.get(server.url + "/metrics", timeout=10).text)
        answers, peers = [], []
        for raw in other + served:
            with _connect(server) as sock:
                peers.append("%s:%d" % sock.getsockname())
                sock.sendall(raw)
                answers.append(read_until_closed(sock, 10))
        counted = _answered_once(server, {("other", "400"): 5.0})
        after = Scrape(httpx.get(server.url + "/metrics", timeout=10).text)
        log = server.log()
    finally:
        server.stop()
    refused, kept = answers[:len(other)], answers[len(other):]
    for (data, closed_s), raw in zip(refused, other):
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and closed_s < 5, (raw, data)
        assert b"\r\nconnection: close\r\n" in head + b"\r\n", (raw, data)
        error = orjson.loads(body)["error"]
        assert error["type"] == "http_version_not_supported" and error["param"] is None, (raw, error)
        version = raw.split(b"\r\n")[0].rsplit(b" ", 1)[1].decode()
        assert error["message"].startswith(f"{version} is not supported: this server speaks HTTP/1.1 (and HTTP/1.0) "
                                            "only"), error
    assert b"x-request-id: asked-for-h2\r\n" in refused[0][0], refused[0][0]  # the client's id, as any answer's
    assert [_status(data) for data, _ in kept] == [200, 200, 200], kept
    assert all(data.endswith(b'{"status":"ok"}') for data, _ in kept), kept
    closed = ("packscore_connections_closed_total", {"reason": "http_version_not_supported"})
    assert at_start.value(closed[0], **closed[1]) == 0.0 and after.value(closed[0], **closed[1]) == 5.0, after.text
    malformed = ("packscore_connections_closed_total", {"reason": "malformed_request"})
    assert after.value(malformed[0], **malformed[1]) == 0.0, after.text  # its own reason, not a malformed request's
    assert at_start.value("packscore_requests_total", route="other", status="400") == 0.0, at_start.text
    assert counted.get(("other", "400")) == 5.0 and counted.get(("/healthz", "200")) == 3.0, counted
    assert not [key for key, n in counted.items() if key[1].startswith("5") and n], counted  # no 5xx, 505 included
    assert counted.get(("/score", "200"), 0.0) == 0.0, counted
    for peer, raw in zip(peers, other):
        version = raw.split(b"\r\n")[0].rsplit(b" ", 1)[1].decode()
        said = (r"WARNING service\.http\.protocol: request_id=\S+ answered 400 to " + re.escape(peer) + ": "
                + re.escape(f"{version} is not supported"))
        assert len(re.findall(said, log)) == 1, (said, log)


def test_a_malformed_requests_400_names_the_part_that_broke(tmp_path):
    # A client author reads the message: a broken chunked body is named as that, not as a bad head.
    server = fake_server(tmp_path).wait_ready()
    chunked = _SCORE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    try:
        messages = []
        for raw in (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",  # the head
                    chunked + b"ZZ\r\nabc\r\n0\r\n\r\n",  # a chunk-size line that is not hex
                    chunked + b"3\r\nabcXY\r\n0\r\n\r\n"):  # a chunk's data not ended by CRLF
            with _connect(server) as sock:
                sock.sendall(raw)
                data = read_until_closed(sock, 10)[0]
            assert _status(data) == 400, data
            messages.append(orjson.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"])
    finally:
        server.stop()
    head, size_line, chunk_end = messages
    assert "Content-Length" in head and "chunk" not in head, head
    assert size_line == chunk_end and "chunked body" in size_line and "chunk-size line" in size_line, messages


def test_a_request_with_both_content_length_and_chunked_is_answered_then_its_connection_closed(tmp_path):
    # RFC 9112 6.1: chunked framing wins, and the server must close after answering (a smuggling guard).
    server = fake_server(tmp_path).wait_ready()
    try:
        chunked = f"{len(_BODY):x}\r\n".encode() + _BODY + b"\r\n0\r\n\r\n"
        with _connect(server) as sock:
            sock.sendall(_SCORE_HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
            both, closed_after = read_until_closed(sock, 10)
        with _connect(server) as sock:  # one framing: kept alive as before
            sock.sendall(_SCORE_HEAD + f"Content-Length: {len(_BODY)}\r\n\r\n".encode() + _BODY)
            one, kept_for = read_until_closed(sock, 2)
    finally:
        server.stop()
    assert _status(both) == 200 and b"connection: close" in both.lower() and closed_after < 5, (both, closed_after)
    assert _status(one) == 200 and b"connection: close" not in one.lower() and kept_for >= 1.9, (one, kept_for)
