"""Request ids on a real server (the app, uvicorn and the protocol over FakeBackend): every answer
carries ``X-Request-Id``, a valid incoming one is echoed and an invalid one replaced, and the
server's log lines for a request name it (service/http/request_id.py)."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from packscore_client import ScoreClient, ScoreError
from tests.e2e.helpers import API_KEY, AUTH, fake_server, read_until_closed

_MADE = re.compile(r"[0-9a-f]{32}")  # an id the server made
_BODY = {"sequences": [{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """With an API key, the access log (debug) and small limits to reach the 413 and the 408."""
    tmp = tmp_path_factory.mktemp("request-id")
    server = fake_server(tmp, "--log-level", "debug", "--max-request-bytes", "4096", "--request-read-timeout-s", "1",
                         env={"PACKSCORE_API_KEY": API_KEY})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _post(server, path="/score", *, json=_BODY, headers=AUTH, content=None) -> httpx.Response:
    return httpx.post(server.url + path, json=None if content is not None else json, content=content,
                      headers={"Content-Type": "application/json", **headers}, timeout=30)


@pytest.mark.parametrize("case", ["200", "422", "404", "405", "401", "413", "healthz", "metrics"])
def test_every_answer_carries_a_request_id(server, case):
    answers = {
        "200": lambda: _post(server),
        "422": lambda: _post(server, json={"sequences": [{"input_ids": [1, 2], "score_from": 9}]}),
        "404": lambda: _post(server, "/nowhere"),
        "405": lambda: httpx.get(server.url + "/score", headers=AUTH, timeout=30),
        "401": lambda: _post(server, headers={}),
        "413": lambda: _post(server, content=b"{" + b" " * 8192 + b"}"),
        "healthz": lambda: httpx.get(server.url + "/healthz", timeout=30),
        "metrics": lambda: httpx.get(server.url + "/metrics", headers=AUTH, timeout=30),
    }
    response = answers[case]()
    status = {"healthz": 200, "metrics": 200}.get(case, int(case) if case.isdigit() else 0)
    assert response.status_code == status, response.text
    assert _MADE.fullmatch(response.headers.get("x-request-id", "")), response.headers


@pytest.mark.parametrize("given", ["trainer-7/step-120:batch-3", "x", "~" * 128, '"quoted",{id}'])
def test_a_valid_incoming_id_is_echoed_on_success_and_on_refusal(server, given):
    for response in (_post(server, headers={**AUTH, "X-Request-Id": given}),
                     _post(server, headers={"X-Request-Id": given})):  # the 401 too
        assert response.headers["x-request-id"] == given, (response.status_code, response.headers)


@pytest.mark.parametrize("given", ["a" * 129, "has space", "tab\there", "", "caf\u00e9"],
                         ids=["too-long", "space", "tab", "empty", "non-ascii"])
def test_an_invalid_incoming_id_is_replaced_not_refused(server, given):
    response = _post(server, headers={**AUTH, "X-Request-Id": given.encode("utf-8")})
    assert response.status_code == 200, response.text
    got = response.headers["x-request-id"]
    assert got != given and _MADE.fullmatch(got), got


def test_the_access_log_line_names_the_request(server):
    given = f"log-check-{time.monotonic_ns()}"
    assert _post(server, headers={**AUTH, "X-Request-Id": given}).status_code == 200
    made = _post(server, "/nowhere").headers["x-request-id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(i in server.log_path.read_text() for i in (given, made)):
        time.sleep(0.05)
    lines = server.log_path.read_text().splitlines()
    named = [line for line in lines if f"request_id={given}" in line]
    assert any('"POST /score HTTP/1.1" 200' in line for line in named), server.log()
    assert any('"POST /nowhere HTTP/1.1" 404' in line for line in lines if f"request_id={made}" in line), server.log()


def test_the_protocols_408_names_the_request_whose_body_did_not_arrive(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nX-Request-Id: slow-body-1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        data, _ = read_until_closed(sock, 6)
    head = data.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert head[0].startswith(b"http/1.1 408") and b"x-request-id: slow-body-1" in head, data


@pytest.mark.parametrize("pause_s", [0, 0.5], ids=["with-its-headers", "after-its-handler-started"])
def test_the_protocols_400_names_the_request_whose_chunked_body_broke(server, pause_s):
    # h11 refused a chunk of /score's body (before its handler ran, or while it read the body): the 400
    # and its log line are that request's, as the request's own count is.
    given = f"broken-chunk-{time.monotonic_ns()}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() + b"\r\nX-Request-Id: "
                     + given.encode() + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"5\r\n{\"seq\r\n" + (b"" if pause_s else b"ZZ\r\nabc\r\n"))
        if pause_s:
            time.sleep(pause_s)
            sock.sendall(b"ZZ\r\nabc\r\n")
        data, _ = read_until_closed(sock, 6)
    head = data.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert head[0].startswith(b"http/1.1 400") and f"x-request-id: {given}".encode() in head, data
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "answered 400" not in _lines_naming(server, given):
        time.sleep(0.05)
    assert "answered 400" in _lines_naming(server, given), server.log()


def _lines_naming(server, rid: str) -> str:
    return "\n".join(line for line in server.log_path.read_text().splitlines() if f"request_id={rid} " in line)


def test_the_clients_score_error_names_the_failed_requests_id(server):
    with ScoreClient(server.url, api_key=API_KEY, encoding="json") as client:
        with pytest.raises(ScoreError) as failed:
            client.score([{"input_ids": [1, 2], "score_from": 9}])
    assert failed.value.status == 422 and _MADE.fullmatch(failed.value.request_id or ""), failed.value
    assert f"(request_id: {failed.value.request_id})" in str(failed.value)


def test_a_protocol_error_behind_a_pipelined_request_does_not_log_under_that_requests_id(server):
    # The next pipelined request is parsed from the finished one's task: its 400 is no request's but its own.
    given = f"pipelined-first-{time.monotonic_ns()}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + given.encode() + b"\r\n\r\nBAD BAD BAD\r\n\r\n")
        data, _ = read_until_closed(sock, 5)
    assert data.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400 Bad Request" in data, data
    refused = re.search(rb"HTTP/1.1 400 Bad Request\r\n.*?x-request-id: (\S+)\r\n", data, re.DOTALL | re.IGNORECASE)
    rid = refused.group(1).decode()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and rid not in server.log_path.read_text():
        time.sleep(0.05)
    invalid = [line for line in server.log_path.read_text().splitlines() if "answered 400" in line]
    assert any(f"request_id={rid} " in line for line in invalid), server.log()
    assert not any(given in line for line in invalid), server.log()
