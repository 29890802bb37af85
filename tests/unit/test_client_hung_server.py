"""deadline_ms against a server that takes the request and never answers (a hung forward, a stuck
proxy): each request's wait is bounded by what is left of the deadline and a grace for the server's
own 504, so the call raises 504 ``deadline_exceeded`` about then, not after ``timeout_s``."""

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
from packscore_client.protocol import DEADLINE_GRACE_S

_LIMITS = {"max_sequences_per_request": 256, "max_request_tokens": 65536, "max_request_bytes": 8 << 20}


def _read_request(conn: socket.socket) -> tuple[str, bytes] | None:
    """``(request line, body)`` of the next request on ``conn``; None once it closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (chunk := conn.recv(65536)):
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                   if k.strip().lower() == "content-length"), 0)
    while len(body) < length:
        if not (chunk := conn.recv(65536)):
            return None
        body += chunk
    return lines[0], body


@contextlib.contextmanager
def _server(answer):
    """A raw HTTP/1.1 server on loopback: ``answer(request_line, body)`` gives ``(status, json)``, or None to
    read the request and never answer it (the connection stays open)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    conns = []

    def serve(conn):
        with contextlib.suppress(OSError):
            while (request := _read_request(conn)) is not None:
                if (got := answer(*request)) is None:
                    while conn.recv(65536):  # hung: holds the connection until the client drops it
                        pass
                    return
                status, obj = got
                body = json.dumps(obj).encode()
                conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                             f"\r\n\r\n".encode() + body)

    def accept():
        while True:
            try:
                conn = listener.accept()[0]
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for conn in conns:
            conn.close()


def _ready_then_hung(line: str, body: bytes):
    """/readyz answers (the limits a first call learns); /score is read and never answered."""
    return (200, {"status": "ready", "limits": _LIMITS}) if line.startswith("GET /readyz") else None


def _call(blocking: bool, url: str, call):
    async def awaited():
        async with AsyncScoreClient(url, timeout_s=5, encoding="json") as client:
            return await call(client)

    if blocking:
        with ScoreClient(url, timeout_s=5, encoding="json") as client:
            return call(client)
    return asyncio.run(awaited())


def _score(deadline_ms):
    return lambda c: c.score([[1, 2, 3]], deadline_ms=deadline_ms)


def _padded(deadline_ms):
    return lambda c: c.score_padded([[1, 2, 3]], [[1, 1, 1]], [[1]], deadline_ms=deadline_ms)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("call,deadline_ms", [(_score, 500), (_padded, 500), (_score, 0)],
                         ids=["score", "score_padded", "score-deadline-0"])
def test_a_hung_server_is_waited_for_until_the_deadline_not_timeout_s(blocking, call, deadline_ms):
    with _server(_ready_then_hung) as url:
        started = time.monotonic()
        with pytest.raises(ScoreError) as failed:
            _call(blocking, url, call(deadline_ms))
        elapsed = time.monotonic() - started
    e = failed.value
    assert (e.status, e.type, e.param) == (504, "deadline_exceeded", "deadline_ms"), e
    due = deadline_ms / 1000 + DEADLINE_GRACE_S
    assert due - 0.05 <= elapsed < due + 1.0, f"raised {elapsed:.2f} s into a call of deadline_ms={deadline_ms}"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_score_padded_s_look_at_v1_models_is_bounded_by_the_deadline_too(blocking):
    """Two parts scored by two versions (an update landed between them): score_padded asks /v1/models
    which one serves now, and a server hung there is waited for until the deadline too."""
    versions = iter(["v1", "v2"])

    def answer(line: str, body: bytes):
        if line.startswith("GET /readyz"):
            return 200, {"status": "ready", "limits": {**_LIMITS, "max_sequences_per_request": 1}}
        if line.startswith("POST /score"):
            n = len(json.loads(body)["sequences"][0]["input_ids"])
            return 200, {"model": "m", "weights_version": next(versions), "usage": {},
                         "results": [{"id": None, "logprobs": [-0.5] * (n - 2), "entropy": [0.1] * (n - 2)}]}
        return None  # GET /v1/models: hung

    def rows(client):
        return client.score_padded([[1, 2, 3], [4, 5, 6]], [[1, 1, 1]] * 2, [[1]] * 2, deadline_ms=500)

    with _server(answer) as url:
        started = time.monotonic()
        with pytest.raises(ScoreError) as failed:
            _call(blocking, url, rows)
        elapsed = time.monotonic() - started
    assert (failed.value.status, failed.value.type) == (504, "deadline_exceeded"), failed.value
    assert elapsed < 0.5 + DEADLINE_GRACE_S + 1.0, f"raised {elapsed:.2f} s into a call of deadline_ms=500"
