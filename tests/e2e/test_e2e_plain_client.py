"""API.md as a client on Python's standard library sees it (``urllib.request``, ``http.client``):
such a client sends the whole body before it reads any answer, so an answer the server gives
before the body has arrived (413, 401, 400) must still reach it."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.helpers import fake_server, read_until_closed

LIMIT = 4096
BIG = 48 << 20  # far past what the kernel's socket buffers hold: the client is still sending at the answer
JSON_H = {"Content-Type": "application/json"}


def _chunks(body: bytes, size: int = 1 << 20):
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _urllib(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    """urllib.request's answer (it sends ``Connection: close``, so the server closes after answering)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as answer:
        return answer.code, json.loads(answer.read())
    except urllib.error.URLError as exc:
        raise AssertionError(f"urllib met {exc.reason!r} instead of an answer") from None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = fake_server(tmp_path_factory.mktemp("plain"), "--max-request-bytes", str(LIMIT), "--api-key", "sk")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def big() -> bytes:
    return b'{"sequences": [{"id": "' + b"x" * BIG + b'", "input_ids": [1, 2]}]}'


def test_answers_given_before_a_large_body_arrived_reach_urllib(server, big):
    """API.md: 413 for a body too large, 401 without the key, 400 for a wrong content type. Each is
    answered before the body has arrived and, urllib asking for it, the connection closed: closed at
    once, the unread rest of the body made the kernel reset it, and urllib met that reset, never
    the answer."""
    key = {"Authorization": "Bearer sk"}
    cases = {"body_too_large": (413, {**JSON_H, **key}), "unauthorized": (401, JSON_H),
             "unsupported_content_type": (400, {"Content-Type": "text/plain", **key})}
    for kind, (status, headers) in cases.items():
        got = _urllib(server.url + "/score", big, headers)
        assert got[0] == status and got[1]["error"]["type"] == kind, (kind, got)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_past_max_request_bytes_gets_its_413_through_http_client(server, big, framing):
    """The same through http.client, which keeps the connection when it may: with the declared length
    and chunked, the 413 arrives, and the next request then gets its answer."""
    small = json.dumps({"sequences": [{"id": "a", "input_ids": [1, 2, 3]}]}).encode()
    headers = {**JSON_H, "Authorization": "Bearer sk"}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        if framing == "chunked":
            conn.request("POST", "/score", body=_chunks(big), headers=headers, encode_chunked=True)
        else:
            conn.request("POST", "/score", body=big, headers=headers)
        answer = conn.getresponse()
        status, error = answer.status, json.loads(answer.read())["error"]
        conn.request("POST", "/score", body=small, headers=headers)
        again = conn.getresponse()
        again_status, again_body = again.status, json.loads(again.read())
    except (ConnectionError, http.client.HTTPException) as exc:
        raise AssertionError(f"{framing}: http.client met {exc!r} instead of the 413") from None
    finally:
        conn.close()
    assert status == 413 and error["type"] == "body_too_large", (status, error)
    assert again_status == 200 and again_body["results"][0]["id"] == "a", (again_status, again_body)


def test_a_lingering_close_ends_at_the_read_timeout_when_the_body_never_ends(tmp_path):
    """The rest of an answered body is read only within the read timeout: a client that stops
    sending holds its connection no longer than one that never finished its headers."""
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--api-key", "sk").wait_ready()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b"1" * 50_000)
            data, closed_after = read_until_closed(sock, 1 + 5)
    finally:
        server.stop()
    assert data.startswith(b"HTTP/1.1 401 ") and data.count(b"HTTP/1.1 ") == 1, data[:300]
    assert closed_after < 1 + 5, f"still open {closed_after:.1f} s after the answer"


def test_the_drains_503_reaches_a_client_still_sending_its_body(tmp_path):
    """API.md: a 503 while draining carries Connection: close. Given to a body still arriving at
    SIGTERM, it must reach http.client, which reads only once its body is sent: the exit cut the
    lingering close off, the kernel reset the connection and the client met a broken pipe. Once
    the client has its answer and closes, the server exits without waiting out the drain timeout."""
    drain_timeout_s, mib = 20, 24
    server = fake_server(tmp_path, "--drain-timeout-s", str(drain_timeout_s),
                         "--max-request-bytes", str(64 << 20)).wait_ready()
    signalled = []

    def body():
        for i in range(mib):
            if i == 2:  # the headers and a part of the body have arrived
                server.proc.send_signal(signal.SIGTERM)
                signalled.append(time.monotonic())
            yield b"1" * (1 << 20)
            time.sleep(0.02)  # a client uploading at about 50 MiB/s

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", "/score", body=body(), headers={**JSON_H, "Content-Length": str(mib << 20)})
        answer = conn.getresponse()
        status, connection, error = answer.status, answer.getheader("connection"), json.loads(answer.read())["error"]
    except (ConnectionError, http.client.HTTPException) as exc:
        raise AssertionError(f"http.client met {exc!r} instead of the drain's 503") from None
    finally:
        conn.close()
        code = server.proc.wait(timeout=drain_timeout_s + 10)
        exited_after = time.monotonic() - signalled[0]
        server.stop()
    assert status == 503 and error["type"] == "draining" and connection == "close", (status, connection, error)
    assert code == 0, server.log()
    assert exited_after < drain_timeout_s / 2, f"exited {exited_after:.1f} s after SIGTERM: waited for the drain timeout"


def test_a_lingering_client_holds_the_exit_no_longer_than_the_drain_timeout(tmp_path):
    """The drain waits for a lingering close, but a client that never closes holds the exit only until
    --drain-timeout-s (its read timeout here is longer), and the exit is still the drain's 0."""
    drain_timeout_s = 2
    server = fake_server(tmp_path, "--drain-timeout-s", str(drain_timeout_s), "--request-read-timeout-s", "60",
                         "--max-request-bytes", str(LIMIT)).wait_ready()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000\r\n\r\n" + b"1" * 1000)
            assert sock.recv(12) == b"HTTP/1.1 413"
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=drain_timeout_s + 10)
            exited_after = time.monotonic() - signalled
    finally:
        server.stop()
    assert code == 0, server.log()
    # uvicorn's own shutdown and the interpreter's exit come after the drain's end
    assert exited_after < drain_timeout_s + 3, f"exited {exited_after:.1f} s after SIGTERM"


def _closed_count(server, reason: str) -> float:
    asked = urllib.request.Request(server.url + "/metrics", headers={"Authorization": "Bearer sk"})
    metrics = urllib.request.urlopen(asked, timeout=30).read().decode()
    line = f'packscore_connections_closed_total{{reason="{reason}"}} '
    return float(next(row for row in metrics.splitlines() if row.startswith(line)).split()[-1])


def _send_all_then_read(server, first: bytes, rest: bytes) -> bytes:
    """What a client that reads only once it has sent everything gets (``first`` in one segment)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        try:
            sock.sendall(first)
            sock.sendall(rest)
        except OSError as exc:
            raise AssertionError(f"the client met {exc!r} while sending, instead of an answer") from None
        return read_until_closed(sock, 30)[0]


def test_a_400_for_bad_chunk_framing_reaches_a_client_still_sending(server):
    """A chunk size h11 refuses mid-body is answered 400 by the protocol itself: closed at once, the
    rest of the body still coming made the kernel reset the connection, and the client met that reset
    instead of the 400. Counted once, as a malformed request, never also as a read timeout."""
    before = _closed_count(server, "malformed_request"), _closed_count(server, "request_timeout")
    head = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer sk\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"sequences\": []\r\nzz\r\n")
    data = _send_all_then_read(server, head, b"1" * (16 << 20))
    after = _closed_count(server, "malformed_request"), _closed_count(server, "request_timeout")
    assert data.startswith(b"HTTP/1.1 400 ") and b'"malformed_request"' in data, data[:300]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0), (before, after)


def test_a_413_reaches_a_client_still_sending_requests_pipelined_behind_its_body(server):
    """A body past the limit that has all arrived, with megabytes of requests pipelined behind it: the
    413 closes the connection while those bytes are unread, and closed at once the kernel reset it
    under the client still sending them."""
    before = _closed_count(server, "request_timeout")
    over = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer sk\r\n"
    over += b"Content-Length: %d\r\n\r\n%s" % (LIMIT + 1000, b"1" * (LIMIT + 1000))
    behind = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer sk\r\n"
    behind += b"Content-Length: %d\r\n\r\n" % (32 << 20)
    data = _send_all_then_read(server, over + behind, b"1" * (32 << 20))
    assert data.startswith(b"HTTP/1.1 413 ") and data.count(b"HTTP/1.1 ") == 1, data[:300]
    assert _closed_count(server, "request_timeout") == before  # the client closed: nothing timed out


@pytest.mark.parametrize("sent, status, counts", [
    (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", b"400", (1, 0)),
    (b"Content-Length: 5000\r\n\r\n" + b"1" * 5000 + b"POST /score HTTP/1.1\r\nHost: x\r\n", b"413", (0, 1)),
], ids=["400-mid-body", "413-then-pipelined"])
def test_a_lingering_close_after_a_protocol_error_or_before_pipelined_bytes_ends_at_the_read_timeout(
        tmp_path, sent, status, counts):
    """Lingering after a 400 for bytes h11 refused, or after an answer with pipelined bytes unread, is
    bounded by the read timeout like any other (from the close, when the request had all arrived).
    Each connection is counted once: the 400's as the malformed request it was, the 413's end as a
    read timeout, as a lingering body's is."""
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--api-key", "sk",
                         "--max-request-bytes", str(LIMIT)).wait_ready()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk\r\n"
                         b"Content-Type: application/json\r\n" + sent)
            sent_at = time.monotonic()
            data = read_until_closed(sock, 5)[0]  # the answer and the half-close
            closed_after = None
            while closed_after is None and time.monotonic() - sent_at < 1 + 5:
                try:  # dropped while the server lingers; reset once it has closed
                    sock.sendall(b"1" * 1000)
                    time.sleep(0.05)
                except OSError:
                    closed_after = time.monotonic() - sent_at
        got = _closed_count(server, "malformed_request"), _closed_count(server, "request_timeout")
    finally:
        server.stop()
    assert data.startswith(b"HTTP/1.1 " + status + b" "), data[:300]
    assert closed_after is not None and 0.5 < closed_after < 1 + 5, f"closed {closed_after} s after the request"
    assert got == counts, got
