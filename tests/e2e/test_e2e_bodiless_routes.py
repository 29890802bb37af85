"""A body past --max-request-bytes sent to a route that reads none (GET /healthz, /metrics, an
unknown path) against a real server: answered 413 and closed through the lingering close, as
POST /score's oversized body is, never kept alive while h11 parses the rest up to the read timeout
(docs/admission.md, "Body limit"). A small body on /healthz keeps its 200 and its connection."""

from __future__ import annotations

import re
import socket

import httpx
import orjson
import pytest

from tests.e2e.helpers import fake_server

LIMIT = 4096
HUGE = 100_000_000_000  # far past the limit: the client would send it for as long as it is let
FIN_WITHIN_S = 3.0  # the server's FIN comes at once; kept alive, it would come only at the read timeout (60 s)
KEY = b"Authorization: Bearer sk\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = fake_server(tmp_path_factory.mktemp("bodiless"), "--max-request-bytes", str(LIMIT), "--api-key", "sk",
                         "--request-read-timeout-s", "60")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _answer(sock: socket.socket, with_body: bool = True) -> tuple[int, dict, bytes]:
    """One answer: its status, headers and body (a HEAD's has none)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while with_body and len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split(" ")[1]), headers, body


def _closed_within(sock: socket.socket, limit_s: float) -> bool:
    """Whether the server's FIN came within ``limit_s`` (what is left of an answer's body is read past)."""
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    return True


def _send(server, head: bytes, body: bytes = b"x" * 1000) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head + b"Host: x\r\n" + (b"" if b"chunked" in head else b"Content-Length: %d\r\n" % HUGE) + b"\r\n"
                 + body)
    return sock


def _count(server, name: str, labels: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sk"}, timeout=30).text
    found = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("line", [b"GET /healthz", b"HEAD /healthz", b"GET /readyz", b"GET /metrics", b"GET /nope",
                                  b"GET /score"])
def test_a_declared_body_past_the_limit_on_a_route_reading_none_gets_413_and_a_lingering_close(server, line):
    route = line.split(b" ")[1].decode()
    label = f'route="{route if route != "/nope" else "other"}",status="413"'
    before = _count(server, "packscore_requests_total", label)
    rejected = _count(server, "packscore_rejections_total", 'reason="body_too_large"')
    with _send(server, line + b" HTTP/1.1\r\n" + KEY) as sock:
        status, headers, body = _answer(sock, with_body=not line.startswith(b"HEAD"))
        closed = _closed_within(sock, FIN_WITHIN_S)
        sock.sendall(b"x" * 65536)  # the rest of the body is still read and dropped, not met with a reset
    assert status == 413 and headers.get("connection") == "close", (status, headers)
    if not line.startswith(b"HEAD"):
        assert orjson.loads(body)["error"]["type"] == "body_too_large", body
    assert closed, f"{line!r}: the connection was kept parsing the body for {FIN_WITHIN_S} s"
    assert _count(server, "packscore_requests_total", label) == before + 1
    assert _count(server, "packscore_rejections_total", 'reason="body_too_large"') == rejected + 1


def test_an_early_answer_before_a_body_past_the_limit_closes_through_the_lingering_close(server):
    """No key on /metrics: the 401 comes first, as on /score, and the connection is then not kept."""
    with _send(server, b"GET /metrics HTTP/1.1\r\n") as sock:
        status, _, _ = _answer(sock)
        closed = _closed_within(sock, FIN_WITHIN_S)
    assert status == 401 and closed, (status, closed)


def test_a_chunked_body_running_past_the_limit_after_its_answer_is_not_kept_alive(server):
    """Its length shows only as it comes: /healthz answers 200, and once more than the limit has
    come after that answer the connection closes the same way."""
    chunk = b"%x\r\n%s\r\n" % (1000, b"x" * 1000)
    with _send(server, b"GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n", chunk) as sock:
        status, _, _ = _answer(sock)
        assert not _closed_within(sock, 0.2)  # under the limit so far: kept
        sock.sendall(chunk * (LIMIT // 1000 + 1))
        closed = _closed_within(sock, FIN_WITHIN_S)
    assert status == 200 and closed, (status, closed)


def test_healthz_with_a_small_body_answers_200_and_keeps_its_connection(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for body in (b"", b"{}", b"x" * LIMIT):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            status, headers, answer = _answer(sock)
            assert status == 200 and orjson.loads(answer) == {"status": "ok"}, (status, answer)
            assert headers.get("connection") != "close", headers
