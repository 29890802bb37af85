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
