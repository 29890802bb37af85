"""Careless and hostile clients against a real server: half-sent requests, descriptor exhaustion,
huge bodies, protocol garbage, and a drain that must end on time (docs/admission.md)."""

from __future__ import annotations

import contextlib
import email.utils
import resource
import selectors
import signal
import socket
import subprocess
import threading
import time

import httpx
import orjson
import pytest

from service.local_server import LocalServer
from tests.e2e.helpers import FAKE, fake_server, read_head, read_until_closed, score_request, stalled_answer


def _connect(server: LocalServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), raw[:300]
    return status, orjson.loads(body)["error"]


@pytest.mark.parametrize("sent", [b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Ty",
                                  b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 1000\r\n\r\n{\"sequences\": [",
                                  b"POST http://x/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 1000\r\n\r\n{\"sequences\": ["],
                         ids=["half-headers", "half-body", "half-body-absolute-form"])
def test_a_half_sent_request_is_closed_within_the_read_timeout(tmp_path, sent):
    server = fake_server(tmp_path, "--request-read-timeout-s", "1").wait_ready()
    try:
        with _connect(server) as sock:
            sock.sendall(sent)
            data, closed_after = read_until_closed(sock, 1 + 5)
        # the metrics say what the client was told: 408, not 499 (a client that went away itself)
        counted = 'packscore_requests_total{route="/score",status="408"} 1.0' if b"Content-Length" in sent else None
        metrics = _metrics_once(server, counted)
    finally:
        server.stop()
    assert closed_after < 1 + 5, f"still open after {closed_after:.1f} s"
    status, error = _json_error(data)
    assert status == 408 and error["type"] == "request_timeout", data
    assert 'status="499"' not in metrics and (counted is None or counted in metrics), metrics


@pytest.mark.parametrize("line, status, route", [(b"POST /v1/weights", 408, "/v1/weights"), (b"POST /nowhere", 404, "other"),
                                                 (b"GET /score", 405, "/score")], ids=["weights", "unknown-route", "wrong-method"])
def test_a_trickled_body_is_cut_off_at_the_read_timeout_on_every_route(tmp_path, line, status, route):
    # A byte every 0.2 s never finishes the body: closed at the read timeout, counted as answered
    # (a route that answers without reading the body has answered at once, and gets no second answer).
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--weights-root", str(tmp_path)).wait_ready()
    try:
        with _connect(server) as sock:
            sock.sendall(line + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            sock.settimeout(0.2)
            t0, data = time.monotonic(), b""
            while time.monotonic() - t0 < 6:
                try:
                    if not (chunk := sock.recv(65536)):
                        break
                    data += chunk
                except TimeoutError:
                    sock.sendall(b" ")
                except ConnectionResetError:
                    break
            closed_after = time.monotonic() - t0
        counted = f'packscore_requests_total{{route="{route}",status="{status}"}} 1.0'
        metrics = _metrics_once(server, counted)
    finally:
        server.stop()
    assert closed_after < 1 + 1, f"still open after {closed_after:.1f} s"
    assert data.count(b"HTTP/1.1 ") == 1 and _json_error(data)[0] == status, data
    assert counted in metrics, [m for m in metrics.splitlines() if m.startswith("packscore_requests_total")]


def _metrics_once(server: LocalServer, line: str | None, limit_s: float = 5.0) -> str:
    """/metrics once it holds ``line`` (a handler counts its request as it ends), or after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        if line is None or line in metrics or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


@pytest.mark.parametrize("second", [b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Ty",
                                    b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    b"Content-Length: 1000\r\n\r\n{\"sequences\": ["], ids=["half-headers", "half-body"])
def test_a_half_sent_pipelined_request_is_closed_within_the_read_timeout(tmp_path, second):
    # Bytes that came in behind a request are read only once its answer is out: they are timed too.
    first = b'{"sequences": [{"input_ids": [1, 2, 3]}]}'
    server = fake_server(tmp_path, "--request-read-timeout-s", "1").wait_ready()
    try:
        with _connect(server) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s%s" % (len(first), first, second))
            data, closed_after = read_until_closed(sock, 1 + 5)
    finally:
        server.stop()
    assert closed_after < 1 + 5, f"still open after {closed_after:.1f} s"
    assert data.startswith(b"HTTP/1.1 200 "), data[:300]
    status, error = _json_error(data[data.index(b"HTTP/1.1 ", 1):])
    assert status == 408 and error["type"] == "request_timeout", data


def test_a_request_answered_before_its_body_arrived_gets_no_second_answer_at_the_read_timeout(tmp_path):
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--api-key", "sk").wait_ready()
    try:
        with _connect(server) as sock:  # no key: 401 at once, while 28 bytes of the body never come
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 38\r\n\r\n{\"sequenc")
            data, closed_after = read_until_closed(sock, 1 + 5)
    finally:
        server.stop()
    assert closed_after < 1 + 5, f"still open after {closed_after:.1f} s"
    assert data.count(b"HTTP/1.1 ") == 1, data
    status, error = _json_error(data)
    assert status == 401, data


def test_a_body_completed_after_its_early_answer_leaves_an_idle_kept_alive_connection(tmp_path):
    # The read timer of a request answered before its body arrived (a 401) stops with that answer:
    # left running, it would give the idle kept-alive connection an unasked-for 408 at the read timeout,
    # and uvicorn's keep-alive timer, cancelled by the body's last bytes, must be armed again.
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--keep-alive-timeout-s", "3",
                         "--api-key", "sk").wait_ready()
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 38\r\n\r\n"
    body = b'{"sequences": [{"input_ids": [1, 2]}]}'
    try:
        answers, idle = [], []
        for then_ask in (True, False):
            with _connect(server) as sock:
                sock.sendall(head + body[:9])
                early, rest, length = read_head(sock)
                while len(rest) < length:
                    rest += sock.recv(65536)
                sock.sendall(body[9:])
                if then_ask:  # past the read timeout, the connection is still there for the next request
                    time.sleep(1.5)
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    answers.append((early, sock.recv(65536)))
                else:  # and an idle one closes at the keep-alive timeout, with nothing sent
                    idle.append(read_until_closed(sock, 3 + 5))
    finally:
        server.stop()
    early, again = answers[0]
    assert early.startswith(b"HTTP/1.1 401 "), early
    assert again.startswith(b"HTTP/1.1 200 "), again[:300]
    data, closed_after = idle[0]
    assert data == b"" and closed_after < 3 + 5, (data[:300], closed_after)


def test_protocol_errors_are_answered_with_the_json_error_body(tmp_path):
    server = fake_server(tmp_path).wait_ready()
    try:
        answers = []
        for raw in (b"GARBAGE\x01 / HTTP/9\r\n\r\n",
                    b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n"):
            with _connect(server) as sock:
                sock.sendall(raw)
                answers.append(read_until_closed(sock, 10)[0])
    finally:
        server.stop()
    for data in answers:
        status, error = _json_error(data)
        assert status == 400 and error["type"] == "malformed_request" and error["param"] is None, data


def test_a_client_gone_mid_body_is_counted_as_499_and_logged_as_no_error(tmp_path):
    # A body whose chunked framing breaks gets the protocol's 400: counted as that, not as a client gone.
    server = fake_server(tmp_path).wait_ready()
    try:
        with _connect(server) as sock:  # half a body, then the client goes away
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 200\r\n\r\n{\"sequences\": ")
            time.sleep(0.3)
        with _connect(server) as sock:  # a chunked body that is not: the protocol answers 400
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n")
            status, _ = _json_error(read_until_closed(sock, 10)[0])
        deadline = time.monotonic() + 10
        while True:
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            counted = [f'packscore_requests_total{{route="/score",status="{s}"}} 1.0' for s in (499, 400)]
            if all(line in metrics for line in counted) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        server.stop()
    assert status == 400
    assert 'packscore_requests_total{route="/score",status="499"} 1.0' in metrics, metrics
    assert 'packscore_requests_total{route="/score",status="400"} 1.0' in metrics, metrics
    assert 'packscore_requests_total{route="/score",status="500"} 0.0' in metrics, metrics  # at 0 from the start
    assert "unhandled error" not in server.log(), server.log()


def test_a_normal_request_is_answered_after_600_half_open_connections_at_512_descriptors(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:  # this process holds the 600 connections
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    limited = ["bash", "-c", 'ulimit -n 512 && exec "$0" "$@"', *FAKE]
    # Without the cap, descriptors free up only at this read timeout: the answer's bound stays far below it.
    read_timeout_s, bound_s = 600, 60
    server = fake_server(tmp_path, "--request-read-timeout-s", str(read_timeout_s), program=limited).wait_ready()
    held: list[socket.socket] = []
    try:
        with selectors.DefaultSelector() as connecting:
            for _ in range(600):
                sock = socket.socket()
                sock.setblocking(False)
                try:
                    sock.connect(("127.0.0.1", server.port))
                except BlockingIOError:
                    pass
                held.append(sock)
                connecting.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + 30
            while connecting.get_map() and time.monotonic() < deadline:  # each connect done, so each send lands
                for key, _ in connecting.select(timeout=1):
                    connecting.unregister(key.fileobj)
        for sock in held:
            try:
                sock.send(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            except OSError:
                pass  # already evicted
        t0 = time.monotonic()
        response = httpx.post(server.url + "/score", json={"sequences": [{"input_ids": [1, 2, 3]}]}, timeout=bound_s)
        answered_after = time.monotonic() - t0
        alive = server.proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        server.stop()
    assert alive, server.log()
    assert response.status_code == 200 and answered_after < bound_s, (response.status_code, answered_after)


def test_healthz_answers_within_1s_during_four_concurrent_60_mib_bodies(tmp_path):
    server = fake_server(tmp_path).wait_ready()
    chunk = b"[" + b"123456," * ((1 << 20) // 7)
    size = 60 << 20
    answers: list[int] = []

    def body():  # streamed (chunked), so the server must count what arrives
        sent = 0
        yield b'{"sequences": [{"input_ids": '
        while sent < size:
            yield chunk
            sent += len(chunk)

    def send(i: int) -> None:
        try:
            if i % 2:
                r = httpx.post(server.url + "/score", content=body(), timeout=60,
                               headers={"Content-Type": "application/json"})
            else:
                r = httpx.post(server.url + "/score", content=b"".join(body()), timeout=60,
                               headers={"Content-Type": "application/json"})
            answers.append(r.status_code)
        except httpx.HTTPError:
            answers.append(0)  # the server closed a connection whose body it refused

    try:
        senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in senders:
            t.start()
        worst = 0.0
        while any(t.is_alive() for t in senders):
            t0 = time.monotonic()
            assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        for t in senders:
            t.join()
    finally:
        server.stop()
    assert worst < 1.0, f"/healthz took {worst:.2f} s"
    assert all(code in (413, 0) for code in answers), answers


def test_sigterm_during_a_long_forward_exits_0_at_the_drain_timeout(tmp_path):
    # One 1000-token sequence at 30 ms per token: a 30 s forward.
    server = fake_server(tmp_path, "--drain-timeout-s", "2", env={"FAKE_SECONDS_PER_TOKEN": "0.03"}).wait_ready()
    answers: dict[str, httpx.Response] = {}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as keep_alive:
            assert keep_alive.get("/healthz").status_code == 200  # a kept-alive connection
            long = threading.Thread(target=lambda: answers.update(
                long=httpx.post(server.url + "/score", json={"sequences": [{"input_ids": [1] * 1000}]}, timeout=30)))
            long.start()
            time.sleep(1.0)  # its forward is running
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            time.sleep(0.3)
            late = keep_alive.post("/score", json={"sequences": [{"input_ids": [1, 2]}]})
            code = server.proc.wait(timeout=30)
            exited_after = time.monotonic() - t0
            long.join(timeout=10)
    finally:
        server.stop()
    assert code == 0 and exited_after < 7, (code, exited_after, server.log())
    assert late.status_code == 503 and late.headers.get("connection") == "close", late.headers
    assert late.json()["error"]["type"] == "draining"
    cut = answers["long"]  # admitted, cut off by the drain timeout
    assert cut.status_code == 503 and cut.headers.get("connection") == "close", cut.headers


def test_an_idle_kept_alive_connection_closes_at_the_keep_alive_timeout_not_before(tmp_path):
    server = fake_server(tmp_path, "--keep-alive-timeout-s", "1.5").wait_ready()
    try:
        with _connect(server) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            data, closed_after = read_until_closed(sock, 1.5 + 5)
    finally:
        server.stop()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert 1.0 <= closed_after < 1.5 + 5, f"the idle connection closed after {closed_after:.1f} s, not about 1.5 s"


def test_a_request_asking_for_an_upgrade_leaves_an_idle_kept_alive_connection(tmp_path):
    # curl --http2 on an http:// URL asks for h2c: h11 holds such a request in MIGHT_SWITCH_PROTOCOL, not DONE,
    # and its read timer, left running, gave the idle connection an unasked-for 408 at the read timeout.
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--keep-alive-timeout-s", "3").wait_ready()
    try:
        with _connect(server) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                         b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
            data, closed_after = read_until_closed(sock, 3 + 5)
        closed = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.1 ") == 1, data
    assert 2.5 <= closed_after < 3 + 5, f"the idle connection closed after {closed_after:.1f} s, not about 3 s"
    assert 'packscore_connections_closed_total{reason="request_timeout"} 0.0' in closed, closed


def test_idle_connections_outlive_a_proxys_idle_timeout_by_default():
    """A proxy (ingress-nginx, AWS ALB: 60 s) reusing a connection the server closes at that moment
    returns 502 to the trainer: the server must keep idle connections longer than the proxy does."""
    from service.http.app import create_app
    from service.http.server import uvicorn_config
    from service.settings import Settings
    from service.testing import FakeBackend

    settings = Settings()
    assert settings.keep_alive_timeout_s > 60, settings.keep_alive_timeout_s
    shorter = settings.model_copy(update={"keep_alive_timeout_s": 12.5})
    config = uvicorn_config(create_app(shorter, {"tiny": FakeBackend()}), shorter)
    assert config.timeout_keep_alive == 12.5, config.timeout_keep_alive


def test_an_answer_still_being_read_when_draining_begins_arrives_whole(tmp_path):
    # About 10 MiB of msgpack, read at 2 MB/s: the drain must not exit under a reader slower than loopback.
    server = fake_server(tmp_path, "--drain-timeout-s", "30").wait_ready()
    body = orjson.dumps({"sequences": [{"input_ids": [i % 1000 for i in range(4000)]} for _ in range(16)], "top_k": 20})
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Accept: application/msgpack\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            head, _, answer = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")))
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while len(answer) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
                time.sleep(max(0.0, len(answer) / 2e6 - (time.monotonic() - t0)))
        code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert len(answer) == length, f"{len(answer)} of {length} bytes arrived before the server exited"
    assert code == 0, server.log()


def test_an_answer_the_client_stops_reading_is_dropped_at_the_send_timeout(tmp_path):
    # About 10 MiB of answer that the client never reads: it held the server's memory and a
    # connection (counted against --max-connections) until the client closed.
    server = fake_server(tmp_path, "--send-timeout-s", "1").wait_ready()
    try:
        sock, length = stalled_answer(server, 16)
        with sock:
            t0 = time.monotonic()
            metrics = _metrics_once(server, "packscore_send_timeouts_total 1.0", limit_s=1 + 5)
            dropped_after = time.monotonic() - t0
            sock.settimeout(10)
            got = 0
            try:  # the server reset the connection: what the kernel still held is gone too
                while chunk := sock.recv(1 << 20):
                    got += len(chunk)
            except (ConnectionResetError, TimeoutError):
                pass
        t1 = time.monotonic()
        next_one = httpx.post(server.url + "/score", json={"sequences": [{"input_ids": [1, 2, 3]}]}, timeout=10)
        next_after = time.monotonic() - t1
    finally:
        server.stop()
    assert "packscore_send_timeouts_total 1.0" in metrics, metrics
    assert dropped_after < 1 + 2, f"dropped {dropped_after:.1f} s after the client stopped reading"
    assert got < length, f"all {length} bytes arrived: nothing was dropped"
    assert next_one.status_code == 200 and next_after < 2, (next_one.status_code, next_after)
    closed = [line for line in server.log().splitlines() if "send timeout: closed a connection to 127.0.0.1:" in line]
    assert len(closed) == 1 and " request_id=" in closed[0], server.log()  # the request whose answer it was
    assert 'packscore_requests_total{route="/score",status="200"} 1.0' in metrics, metrics  # counted as answered


def test_a_slow_but_steady_reader_gets_its_whole_answer_while_a_stalled_one_is_dropped(tmp_path):
    # About 10 MiB read at 200 KB/s for 4 s: the kernel takes more of it from the server only once a
    # third of its send buffer (MiBs on loopback) has drained, seconds apart at that pace, so the
    # server's own buffer alone looks stalled. Forwards of 1.3 s, longer than the send timeout: an
    # answer still being computed is not stalled; nor is the connection idle afterwards.
    server = fake_server(tmp_path, "--send-timeout-s", "1", env={"FAKE_SECONDS_PER_TOKEN": "0.00002"}).wait_ready()
    results: dict[str, object] = {}

    def stalled() -> None:
        sock, _ = stalled_answer(server, 16)
        results["stalled"] = sock

    try:
        staller = threading.Thread(target=stalled)
        staller.start()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", server.port))
            request = score_request(16)
            sock.sendall(request)
            head, answer, length = read_head(sock)
            t0, start = time.monotonic(), len(answer)
            while len(answer) < length:
                chunk = sock.recv(min(16384, length - len(answer)))
                if not chunk:
                    break
                answer += chunk
                if time.monotonic() - t0 < 4:  # then as fast as it comes, to keep the test short
                    time.sleep(max(0.0, (len(answer) - start) / 200e3 - (time.monotonic() - t0)))
            read_for = time.monotonic() - t0
            time.sleep(1.5)  # idle on a kept-alive connection past the send timeout, then a second request
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            again = sock.recv(65536)
        staller.join(timeout=30)
        metrics = _metrics_once(server, "packscore_send_timeouts_total 1.0", limit_s=5)
        whole = httpx.post(server.url + "/score", content=request.partition(b"\r\n\r\n")[2], timeout=30,
                           headers={"Content-Type": "application/json", "Accept": "application/msgpack"})
    finally:
        if isinstance(results.get("stalled"), socket.socket):
            results["stalled"].close()
        server.stop()
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert len(answer) == length and read_for > 4, (len(answer), length, read_for, server.log())
    assert answer == whole.content, "the slowly read answer differs from the same answer read at once"
    assert again.startswith(b"HTTP/1.1 200 "), again[:200]
    assert "packscore_send_timeouts_total 1.0" in metrics, (metrics, server.log())  # the stalled one, only


@contextlib.contextmanager
def _draining_behind_a_stalled_answer(tmp_path, settle_s: float):
    """A server SIGTERMed while an answer waits on a reader that reads nothing, ``settle_s`` later:
    drained, and still up, waiting for that answer."""
    server = fake_server(tmp_path, "--drain-timeout-s", "30").wait_ready()
    try:
        sock, _ = stalled_answer(server, 16)
        with sock:
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(settle_s)
            assert server.proc.poll() is None, "exited under an answer still being written: " + server.log()
            yield server
    finally:
        server.stop()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_second_signal_ends_the_wait_for_an_answer_still_being_written(tmp_path, second):
    # After the drain the server waits for answers still being written, up to the drain timeout; a
    # second SIGTERM (or SIGINT) stops without a drain during that wait too, as it does before it.
    with _draining_behind_a_stalled_answer(tmp_path, 1.0) as server:
        t0 = time.monotonic()
        server.proc.send_signal(second)
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        exited_after = time.monotonic() - t0
    assert exited_after < 10, f"still running {exited_after:.1f} s after a second signal: {server.log()[-2000:]}"


@pytest.mark.parametrize("behind", [b"", b"GET /healthz HTTP/1.1\r\nHo"], ids=["idle", "next_request_arriving"])
def test_a_connection_still_writing_its_answer_is_not_evicted(tmp_path, behind):
    # An answer written out whole but still in the server's buffer (a slow reader) keeps its
    # connection from counting as idle, or, with the start of a pipelined request behind it, as the
    # oldest reading one: "evicted" for a new connection over the cap, it would close only once the
    # buffer drains, and the cap would be exceeded meanwhile (by one descriptor per such answer).
    server = fake_server(tmp_path, "--max-connections", "1", "--request-read-timeout-s", "60").wait_ready()
    served = None
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(score_request(16) + behind)
            head, answer, length = read_head(sock)
            time.sleep(0.5)  # the answer is complete, most of it still in the server's buffer
            with _connect(server) as second:
                second.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                refused, _ = read_until_closed(second, 5)
            while len(answer) < length and (chunk := sock.recv(1 << 20)):
                answer += chunk
            if not behind:
                with _connect(server) as third:  # the first is idle now: evicted for this one
                    third.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                    served = third.recv(65536)
    finally:
        server.stop()
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert refused.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in refused, refused[:300]
    assert len(answer) == length, f"{len(answer)} of {length} bytes of the answer being written arrived"
    assert behind or served.startswith(b"HTTP/1.1 200 "), served[:300]


def test_answers_while_the_drain_waits_for_a_slow_reader_carry_the_current_date(tmp_path):
    # uvicorn refreshes its Date header in the main loop's tick, which the wait after the drain
    # replaced: /healthz and /readyz answered meanwhile carried the time the drain ended.
    with _draining_behind_a_stalled_answer(tmp_path, 4.0) as server:
        answer = httpx.get(server.url + "/healthz", timeout=10)
        now = time.time()
    dated = email.utils.parsedate_to_datetime(answer.headers["date"]).timestamp()
    assert answer.status_code == 200 and now - dated < 2.5, f"Date {answer.headers['date']} is {now - dated:.1f} s old"
