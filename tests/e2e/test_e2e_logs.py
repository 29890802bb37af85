"""The server's log as an operator reads it, on a real server (the app, uvicorn and the protocol
over FakeBackend): every line on standard error in one format naming its request, one traceback for
an unhandled error."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.e2e.helpers import SplitStreamsServer

_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+):"
                     r"(?: request_id=(\S+))? ")
_BODY = {"sequences": [{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """With the access log (debug), a short read timeout and a score route that raises on request."""
    server = SplitStreamsServer(tmp_path_factory.mktemp("logs"), "--log-level", "debug", "--request-read-timeout-s", "1",
                                env={"FAKE_BUGS": "1"})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _records(server) -> list[tuple[str, str, str | None, str]]:
    """Standard error's records: (level, logger, request id, text with its continuation lines)."""
    records: list[list] = []
    for line in server.err_path.read_text(errors="replace").splitlines():
        head = _RECORD.match(line)
        if head:
            records.append([*head.groups(), line])
        elif records:
            records[-1][3] += "\n" + line
    return [tuple(r) for r in records]


def _wait_for(server, found, limit_s: float = 10.0):
    deadline = time.monotonic() + limit_s
    while not (got := found(_records(server))) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_every_line_goes_to_standard_error_in_one_format_naming_its_request(server):
    given = f"streams-{time.monotonic_ns()}"
    answer = httpx.post(server.url + "/score", json=_BODY, headers={"X-Request-Id": given}, timeout=30)
    assert answer.status_code == 200, answer.text
    lines = server.err_path.read_text().splitlines()
    access = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO uvicorn\.access: request_id=" + re.escape(given)
                        + r' 127\.0\.0\.1:\d+ - "POST /score HTTP/1\.1" 200')
    assert any(access.fullmatch(line) for line in lines), server.log()
    # uvicorn's own lines and the app's, in the same format
    assert any(_RECORD.match(line) and "INFO uvicorn.error: Started server process" in line for line in lines), lines
    assert any(_RECORD.match(line) and "INFO service.runtime: ready: serving" in line for line in lines), lines
    assert server.log_path.read_text() == "", server.log()


@pytest.mark.parametrize("where", ["before-answer", "mid-answer"])
def test_an_unhandled_error_logs_one_traceback_naming_its_request(server, where):
    given = f"bug-{where}-{time.monotonic_ns()}"
    headers = {"X-Request-Id": given, "X-Fake-Bug": where}
    if where == "before-answer":
        answer = httpx.post(server.url + "/score", json=_BODY, headers=headers, timeout=30)
        assert answer.status_code == 500 and answer.json()["error"]["type"] == "internal_error", answer.text
        assert answer.headers["x-request-id"] == given and answer.headers["connection"] == "close", answer.headers
    else:  # the answer had begun: the connection is closed mid-body
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(server.url + "/score", json=_BODY, headers=headers, timeout=30)
    assert _wait_for(server, lambda records: any(r[2] == given and "unhandled error" in r[3] for r in records)), server.log()
    time.sleep(0.3)  # a second line about it would follow at once
    records = _records(server)
    tracebacks = [r for r in records if "Traceback (most recent call last)" in r[3] and given in r[3] + str(r[2])]
    assert len(tracebacks) == 1, server.log()
    level, logger, rid, text = tracebacks[0]
    assert (level, logger, rid) == ("ERROR", "service.http.app", given) and "RuntimeError: a fake bug" in text, text
    assert not any("Exception in ASGI application" in r[3] for r in records), server.log()
