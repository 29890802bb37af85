"""Series a real server exports at 0 before their first event (``rate()`` and ``increase()`` miss the
first event of a series that appears with it): a model's scoring series from when it is loaded, not
from its warm-up; every weight-update outcome; and the connections the HTTP protocol layer closes
itself (service/http/protocol.py), counted by reason; every reason of a rejection, those only
POST /v1/weights answers where it is served."""

from __future__ import annotations

import json
import socket
import time

import httpx
import orjson

import pytest

from service.http.metrics import (
    CONNECTION_CLOSE_REASONS,
    REJECTION_REASONS,
    UNNAMED_UPDATE_OUTCOMES,
    UPDATE_OUTCOMES,
    WEIGHTS_REJECTION_REASONS,
)
from service.local_server import LocalServer
from tests.e2e.helpers import fake_server, read_until_closed, wait_status
from tests.live_metrics import Scrape

SCORING_SERIES = ("packscore_tokens_scored_total", "packscore_prefix_tokens_saved_total",
                  "packscore_queue_wait_seconds_count", "packscore_forward_seconds_count",
                  "packscore_batch_tokens_count", "packscore_batch_fill_ratio_count")


def _scrape(server: LocalServer) -> Scrape:
    answer = httpx.get(server.url + "/metrics", timeout=30)
    assert answer.status_code == 200, answer.text
    return Scrape(answer.text)


def _connect(server: LocalServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _closed(scrape: Scrape) -> dict[str, float | None]:
    return {reason: scrape.value("packscore_connections_closed_total", reason=reason)
            for reason in CONNECTION_CLOSE_REASONS}


def _status(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(body)["error"]["type"]


def test_a_model_awaiting_weights_has_its_scoring_and_update_series_at_zero(tmp_path):
    """Its recorded checkpoint is gone: the server waits for an update, never warms up, and a
    dashboard or rate() must still find the model's series (and every outcome of its update)."""
    (tmp_path / "root").mkdir()
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"format": 1, "models": {"fake-model": {
        "model": "tiny", "path": "gone", "version": "v-gone", "files": []}}}))
    server = fake_server(tmp_path, "--weights-root", str(tmp_path / "root"), "--weights-record", str(record))
    try:
        wait_status(server, "awaiting_weights", timeout=60)
        at_start = _scrape(server)
    finally:
        server.stop()
    assert at_start.value("packscore_weights_awaited", model="fake-model") == 1.0, at_start.text
    absent = [name for name in SCORING_SERIES if at_start.value(name, model="fake-model") != 0.0]
    assert not absent, f"not at 0 for a loaded model before its warm-up: {absent}"
    absent = [o for o in UPDATE_OUTCOMES if at_start.value("packscore_weights_updates_total", model="fake-model",
                                                           outcome=o) != 0.0]
    absent += [f'model="" {o}' for o in UNNAMED_UPDATE_OUTCOMES
               if at_start.value("packscore_weights_updates_total", model="", outcome=o) != 0.0]
    assert not absent, f"weight-update outcomes not at 0 from the start: {absent}"


@pytest.mark.parametrize("weights_root", [False, True], ids=["scoring-only", "weights-root"])
def test_every_rejection_reason_the_server_can_answer_is_at_zero_from_the_start(tmp_path, weights_root):
    """tests/unit/test_metrics_rejection_series.py checks that the two lists hold every reason the code
    answers; here a real server's /metrics has each at 0, the weights route's only where it is served."""
    (tmp_path / "root").mkdir()
    args = ("--weights-root", str(tmp_path / "root")) if weights_root else ()
    server = fake_server(tmp_path, *args).wait_ready()
    try:
        at_start = _scrape(server)
    finally:
        server.stop()
    expected = (*REJECTION_REASONS, *WEIGHTS_REJECTION_REASONS) if weights_root else REJECTION_REASONS
    values = {r: at_start.value("packscore_rejections_total", reason=r) for r in expected}
    wrong = {r: v for r, v in values.items() if v != 0.0}
    assert not wrong, f"not at 0 from the start (None: absent): {wrong}"
    exported = {s.labels["reason"] for f in at_start.families() for s in f.samples
                if s.name == "packscore_rejections_total"}
    assert exported == set(expected), sorted(exported ^ set(expected))


def test_the_protocol_layers_own_answers_are_counted_by_reason(tmp_path):
    """A 400 for bytes that are not HTTP and the read timeout's 408 (headers, then a body, too slow)
    pass no route: packscore_connections_closed_total counts each, from 0. So does the read timeout's
    end of a lingering close (the rest of a body answered 413 still not arrived): a body too slow too."""
    server = fake_server(tmp_path, "--request-read-timeout-s", "1", "--max-request-bytes", "4096").wait_ready()
    try:
        at_start = _closed(_scrape(server))
        answers = []
        for sent in (b"GARBAGE\x01 / HTTP/9\r\n\r\n", b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Ty",
                     b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"sequences\": [",
                     b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"sequences\": ["):
            with _connect(server) as sock:
                sock.sendall(sent)
                answers.append(_status(read_until_closed(sock, 10)[0]))
                if answers[-1][0] == 413:  # its FIN is only a half-close: kept open, it lingers to the read timeout
                    time.sleep(2)
        after = _scrape(server)
    finally:
        server.stop()
    assert at_start == dict.fromkeys(CONNECTION_CLOSE_REASONS, 0.0), at_start
    assert answers == [(400, "malformed_request"), (408, "request_timeout"), (408, "request_timeout"),
                       (413, "body_too_large")], answers
    want = {"too_many_connections": 0.0, "evicted": 0.0, "malformed_request": 1.0, "http_version_not_supported": 0.0,
            "request_timeout": 3.0}
    assert _closed(after) == want, after.text
    # the body's 408 has a route, and is counted under it too; the headers' has none
    assert after.value("packscore_requests_total", route="/score", status="408") == 1.0, after.text


def test_the_connection_caps_refusals_and_evictions_are_counted(tmp_path):
    """With --max-connections 1: a second connection while the first is busy answering is refused
    (503), and a third once the first is idle evicts it."""
    body = orjson.dumps({"sequences": [{"input_ids": list(range(1, 201))}]})  # 2 s of fake forward
    request = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (len(body), body))
    server = fake_server(tmp_path, "--max-connections", "1", "--request-read-timeout-s", "60",
                         env={"FAKE_SECONDS_PER_TOKEN": "0.01"}).wait_ready()
    try:
        with _connect(server) as busy:
            busy.sendall(request)
            time.sleep(0.5)  # its body read, its forward running: not evictable
            with _connect(server) as refused:
                refusal = _status(read_until_closed(refused, 10)[0])
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                answer += busy.recv(65536)
            with _connect(server) as third:  # the first is idle now: evicted for this one
                third.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                metrics = read_until_closed(third, 10)[0]
    finally:
        server.stop()
    assert refusal == (503, "too_many_connections"), refusal
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    head, _, text = metrics.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), metrics[:300]
    want = {"too_many_connections": 1.0, "evicted": 1.0, "malformed_request": 0.0, "http_version_not_supported": 0.0,
            "request_timeout": 0.0}
    assert _closed(Scrape(text.decode())) == want, text.decode()
