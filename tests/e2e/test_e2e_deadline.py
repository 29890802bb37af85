"""deadline_ms against a real server: it counts from the request's arrival, so a body still arriving
over a slow link spends the request's time (API.md: 504 if the result is not ready after that many ms)."""

from __future__ import annotations

import json
import socket
import time

import orjson
import pytest

from tests.e2e.helpers import fake_server, read_until_closed

_SLOW_LINK_S = 1.5  # the body's second half arrives this long after the headers: well past the 504 case's deadline_ms


def _trickled(port: int, body: bytes) -> tuple[int, dict, float]:
    """Sends the headers and half the body, the rest ``_SLOW_LINK_S`` later; the status, the JSON answer
    and the seconds from the first byte sent to the answer."""
    head = (f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        t0 = time.monotonic()
        sock.sendall(head + body[:len(body) // 2])
        time.sleep(_SLOW_LINK_S)
        sock.sendall(body[len(body) // 2:])
        data, _ = read_until_closed(sock, 30)
        took = time.monotonic() - t0
    answer_head, _, answer = data.partition(b"\r\n\r\n")
    return int(answer_head.split(b" ", 2)[1]), orjson.loads(answer), took


@pytest.mark.parametrize("deadline_ms, status", [(500, 504), (0, 504), (20_000, 200)],
                         ids=["passed-while-the-body-arrived", "zero", "not-passed"])
def test_deadline_ms_counts_from_the_requests_arrival_not_from_its_body(tmp_path, deadline_ms, status):
    """A body that takes longer to arrive than deadline_ms gets 504 once read: counted from the parsed
    body, a fast server would answer 200 well past the trainer's deadline."""
    server = fake_server(tmp_path).wait_ready()
    try:
        body = json.dumps({"sequences": [{"input_ids": list(range(1, 400))}], "deadline_ms": deadline_ms}).encode()
        got, answer, took = _trickled(server.port, body)
    finally:
        server.stop()
    assert got == status, (f"deadline_ms {deadline_ms} with the body {_SLOW_LINK_S} s on its way: {got} after "
                           f"{took:.2f} s: {answer}")
    if status == 504:
        assert answer["error"]["type"] == "deadline_exceeded", answer
