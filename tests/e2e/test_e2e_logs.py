"""The server's log as an operator reads it, on a real server (the app, uvicorn and the protocol
over FakeBackend): every line on standard error in one format naming its request, one traceback for
an unhandled error, and one line for each answer the protocol sends itself (400, 408, 503) and each
send timeout, WARNINGs up to a budget."""

from __future__ import annotations

import json
import re
import signal
import socket
import ssl
import threading
import time

import httpx
import pytest

from tests.e2e.helpers import SplitStreamsServer, queued_sequences, read_until_closed, stalled_answer

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


_SLOW_BODY = (b"POST /score HTTP/1.1\r\nHost: x\r\nX-Request-Id: slow-body-7\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{")


@pytest.mark.parametrize("sent, status, why", [
    (b"BAD BAD BAD\r\n\r\n", 400, "not valid HTTP/1.1: illegal request line"),
    (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "not valid HTTP/1.1: bad Content-Length"),
    (_SLOW_BODY, 408, "the body of POST /score did not arrive within 1 s"),
    (b"POST /sco", 408, "a request's headers did not arrive within 1 s"),
], ids=["garbage", "content-length", "body", "headers"])
def test_an_answer_the_protocol_sends_itself_is_logged_once_naming_its_id(server, sent, status, why):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        peer = "%s:%d" % sock.getsockname()
        sock.sendall(sent)
        data, _ = read_until_closed(sock, 6)
    assert data.startswith(b"HTTP/1.1 %d " % status), data
    rid = re.search(rb"\r\nx-request-id: (\S+)\r\n", data, re.IGNORECASE).group(1).decode()
    assert sent is not _SLOW_BODY or rid == "slow-body-7", data
    named = _wait_for(server, lambda records: [r for r in records if r[2] == rid])
    assert len(named) == 1, server.log()
    level, logger, _, text = named[0]
    assert (level, logger) == ("WARNING", "service.http.protocol"), text
    assert f"answered {status} to {peer}: {why}" in text and "\n" not in text, text  # no traceback
    assert not any("Invalid HTTP request received" in r[3] for r in _records(server)), server.log()


def test_the_connection_caps_503_is_logged_naming_its_id_and_the_access_log_waits_for_debug(tmp_path):
    # One connection allowed, busy with a slow forward: a second one is refused by the protocol.
    server = SplitStreamsServer(tmp_path, "--log-level", "info", "--max-connections", "1",
                                env={"FAKE_SECONDS_PER_TOKEN": "0.5"})
    try:
        server.wait_ready()
        body = json.dumps(_BODY).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as busy:
            busy.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"\r\n%s" % (len(body), body))
            time.sleep(0.5)  # read and admitted: a forward of 2 s (4 tokens) holds it
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                peer = "%s:%d" % sock.getsockname()
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                data, _ = read_until_closed(sock, 5)
            answered = busy.recv(65536)
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as gone:  # a 499: no access line either
            gone.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            time.sleep(0.3)
        gone_counted = 'packscore_requests_total{route="/score",status="499"} 1.0'
        deadline = time.monotonic() + 10
        while gone_counted not in (metrics := httpx.get(server.url + "/metrics", timeout=10).text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
        records = _records(server)
    finally:
        server.stop()
    assert answered.startswith(b"HTTP/1.1 200 "), answered
    assert data.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in data, data
    rid = re.search(rb"\r\nx-request-id: (\S+)\r\n", data, re.IGNORECASE).group(1).decode()
    named = [r for r in records if r[2] == rid]
    assert len(named) == 1 and named[0][:2] == ("WARNING", "service.http.protocol"), server.log()
    assert f"answered 503 to {peer}: " in named[0][3] and "max_connections 1" in named[0][3], named
    # --log-level info: no access line (docs/cli.md: debug adds them)
    assert not any(r[1] == "uvicorn.access" for r in records) and server.log_path.read_text() == "", server.log()


def test_a_client_gone_before_its_answer_gets_one_access_line_with_499(tmp_path):
    # Counted as 499 in the metrics, it is in the log too: an operator greps a timed-out trainer's request ids
    server = SplitStreamsServer(tmp_path, "--log-level", "debug", env={"FAKE_SECONDS_PER_TOKEN": "0.01"})
    stamp = time.monotonic_ns()
    ids = {"mid-body": f"gone-mid-body-{stamp}", "mid-forward": f"gone-mid-forward-{stamp}"}
    peers = {}
    try:
        server.wait_ready()
        head = "POST /score HTTP/1.1\r\nHost: x\r\nX-Request-Id: {}\r\nContent-Type: application/json\r\n" \
               "Content-Length: {}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # half its body, then gone
            peers["mid-body"] = "%s:%d" % sock.getsockname()
            sock.sendall(head.format(ids["mid-body"], 200).encode() + b'{"sequences": ')
            time.sleep(0.3)  # its handler is reading the body
        body = json.dumps({"sequences": [{"input_ids": [1] * 300}]}).encode()  # a forward of 3 s
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # all of it, gone mid-forward
            peers["mid-forward"] = "%s:%d" % sock.getsockname()
            sock.sendall(head.format(ids["mid-forward"], len(body)).encode() + body)
            deadline = time.monotonic() + 10
            while queued_sequences(server.url) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert _wait_for(server, lambda records: [r for r in records if r[2] == ids["mid-forward"]
                                                  and r[1] == "uvicorn.access"]), server.log()
        deadline = time.monotonic() + 10
        while queued_sequences(server.url) > 0 and time.monotonic() < deadline:  # its forward ends: nothing more for it
            time.sleep(0.05)
        time.sleep(0.3)
        records = _records(server)
    finally:
        server.stop()
    for where, rid in ids.items():
        lines = [r[3] for r in records if r[2] == rid and r[1] == "uvicorn.access"]
        access = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO uvicorn\.access: request_id=" + re.escape(rid)
                            + " " + re.escape(peers[where]) + r' - "POST /score HTTP/1\.1" 499')
        assert len(lines) == 1 and access.fullmatch(lines[0]), (where, server.log())


@pytest.mark.parametrize("upgrade", ["h2c", "websocket"])
def test_an_upgrade_header_is_served_over_http_1_1_without_a_warning(server, upgrade):
    # curl --http2 on an http:// URL asks for h2c on every request: uvicorn warned twice each time,
    # once to install a websocket library this service has no use for
    given = f"upgrade-{upgrade}-{time.monotonic_ns()}"
    answer = httpx.post(server.url + "/score", json=_BODY, timeout=30,
                        headers={"Connection": "Upgrade, HTTP2-Settings", "Upgrade": upgrade, "HTTP2-Settings": "",
                                 "X-Request-Id": given})
    assert answer.status_code == 200, answer.text
    assert _wait_for(server, lambda records: [r for r in records if r[2] == given and r[1] == "uvicorn.access"]), \
        server.log()
    noisy = [r[3] for r in _records(server) if r[0] == "WARNING" and ("upgrade" in r[3].lower() or "WebSocket" in r[3])]
    assert not noisy, noisy


def test_a_tls_handshake_on_the_plain_port_says_the_client_uses_https(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        peer = "%s:%d" % sock.getsockname()
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with pytest.raises(ssl.SSLError):
            context.wrap_socket(sock, server_hostname="127.0.0.1")  # as curl https:// sends it
    named = _wait_for(server, lambda records: [r for r in records if f"answered 400 to {peer}: " in r[3]])
    assert len(named) == 1 and named[0][0] == "WARNING", server.log()
    assert named[0][3].endswith("not valid HTTP/1.1: illegal request line (a TLS handshake: the client uses https:// "
                                "on this plain-HTTP port)"), named
@pytest.mark.parametrize("line, said", [
    (b"Authorization: Bearer %s\r", "'Authorization' (its value is not logged)"),  # a key file's CRLF, via curl -H
    (b"Authorization: Bearer %s\x00", "'Authorization' (its value is not logged)"),
    (b"Authorization : Bearer %s", "'Authorization' (its value is not logged)"),
    (b"X-Api-Key\x01: %s", "'X-Api-Key\\x01' (its value is not logged)"),
    (b"Authorization Bearer %s", "(no ':'; not quoted, it may hold a key)"),
], ids=["carriage-return", "nul", "space-before-colon", "bad-name", "no-colon"])
def test_a_refused_header_line_is_named_without_its_value(tmp_path, line, said):
    # h11 quotes the header line it refuses: the 400's line must not write a key into the log
    key = f"refused-key-{time.monotonic_ns()}"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    server = SplitStreamsServer(tmp_path, "--api-key-file", str(key_file))
    try:
        server.wait_ready()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n" + line % key.encode() + b"\r\nContent-Length: 0\r\n\r\n")
            data, _ = read_until_closed(sock, 6)
        rid = re.search(rb"\r\nx-request-id: (\S+)\r\n", data, re.IGNORECASE).group(1).decode()
        named = _wait_for(server, lambda records: [r for r in records if r[2] == rid])
    finally:
        server.stop()
    assert data.startswith(b"HTTP/1.1 400 ") and key.encode() not in data, data
    assert len(named) == 1 and named[0][:2] == ("WARNING", "service.http.protocol"), server.log()
    assert f"not valid HTTP/1.1: illegal header line {said}" in named[0][3], named
    assert key not in server.err_path.read_text() + server.log_path.read_text(), server.log()


def test_a_flood_of_bad_requests_writes_a_few_warnings_not_one_each(tmp_path):
    # A client retrying https:// against this http port: 1,000 refused requests, not 1,000 WARNING lines
    server = SplitStreamsServer(tmp_path, "--log-level", "info")
    try:
        server.wait_ready()
        ids = []
        for _ in range(1000):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")
                data, _ = read_until_closed(sock, 6)
            assert data.startswith(b"HTTP/1.1 400 "), data
            ids.append(re.search(rb"\r\nx-request-id: (\S+)\r\n", data, re.IGNORECASE).group(1).decode())
        counted = httpx.get(server.url + "/metrics", timeout=30).text
        time.sleep(0.3)
        records = _records(server)
    finally:
        server.stop()
    assert 'packscore_requests_total{route="other",status="400"} 1000.0' in counted
    warnings = [r for r in records if r[0] in ("WARNING", "ERROR")]
    assert [r[2] for r in warnings[:10]] == ids[:10] and all("answered 400" in r[3] for r in warnings[:10]), warnings
    assert len(warnings) == 11 and warnings[10][2] is None, warnings
    assert "more than 10 of the protocol's own lines (its answers 400, 408, 503 and its send timeouts) within 60 s" \
        in warnings[10][3], warnings


def test_clients_that_read_none_of_their_answers_write_a_few_warnings_not_one_each(tmp_path):
    # A WARNING for each send timeout would give 1,000 stalled readers 1,000 lines. They spend the budget
    # of the protocol's answers: two 400s, then 24 answers of about 11 MB (past the kernel's buffers) nobody reads.
    stalled = 24
    server = SplitStreamsServer(tmp_path, "--log-level", "debug", "--send-timeout-s", "1")
    socks: list[socket.socket] = []
    try:
        server.wait_ready()
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")
                assert read_until_closed(sock, 6)[0].startswith(b"HTTP/1.1 400 ")
        readers = [threading.Thread(target=lambda: socks.append(stalled_answer(server, 16)[0])) for _ in range(stalled)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=60)
        assert len(socks) == stalled, server.log()
        closed = f"packscore_send_timeouts_total {stalled}.0"
        deadline = time.monotonic() + 30
        while closed not in (metrics := httpx.get(server.url + "/metrics", timeout=30).text):
            assert time.monotonic() < deadline, (metrics, server.log())
            time.sleep(0.1)
        time.sleep(0.3)
        records = _records(server)
    finally:
        for sock in socks:
            sock.close()
        server.stop()
    timeouts = [r for r in records if "send timeout: closed a connection to 127.0.0.1:" in r[3]]
    assert len(timeouts) == stalled and all(r[2] for r in timeouts), timeouts  # each names its request
    assert [r[0] for r in timeouts] == ["WARNING"] * 8 + ["DEBUG"] * (stalled - 8), [r[0] for r in timeouts]
    warnings = [r for r in records if r[0] in ("WARNING", "ERROR")]
    assert len(warnings) == 11 and warnings[10][2] is None, warnings
    assert sum("answered 400" in r[3] for r in warnings) == 2, warnings
    assert "more than 10 of the protocol's own lines" in warnings[10][3], warnings


@pytest.mark.parametrize("stop, options, expected", [
    (["SIGINT"], [], 130),
    (["SIGTERM", "SIGTERM"], [], -15),  # the second without a drain: its pending work answered 503 at once
    (["SIGTERM"], ["--drain-timeout-s", "0.5"], 0),  # the drain's timeout ends the pass: drained, 0
], ids=["sigint", "second-sigterm", "drain-timeout"])
def test_a_first_readiness_pass_the_shutdown_cuts_off_is_logged_as_cancelled_not_as_a_failed_start(tmp_path, stop,
                                                                                                    options, expected):
    # A stop during the first readiness pass closes the scheduler under it: that failed its ticket, which the pass
    # logged as an ERROR "readiness pass of fake-model failed: The server is shutting down; retry.", and the start as
    # failed ("startup failed", and after a drain's timeout exit 1 with "could not start").
    # 0.5 s a token: the pass (8 tokens) runs 4 s, over the signals.
    server = SplitStreamsServer(tmp_path, "--log-level", "info", *options, env={"FAKE_SECONDS_PER_TOKEN": "0.5"})
    try:
        assert _wait_for(server, lambda records: any("warm-up of fake-model took" in r[3] for r in records), 60), \
            server.log()
        time.sleep(0.3)  # the pass is queued and its forward under way
        for sig in stop:
            server.proc.send_signal(getattr(signal, sig))
            time.sleep(0.3)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    records = _records(server)
    passes = [r for r in records if "readiness pass of fake-model" in r[3]]
    assert code == expected and [r[:2] for r in passes] == [("INFO", "service.runtime")], server.log()
    assert "cancelled: the server is" in passes[0][3] and "\n" not in passes[0][3], server.log()
    assert not any(r[0] == "ERROR" for r in records) and "could not start" not in server.log(), server.log()
    # the pass's ticket is the server's own: the drain timeout's and a stop's lines counted it, with an empty id
    assert not any("unfinished request" in r[3] for r in records), server.log()
