"""A server with tight limits: a table of bad inputs while a good request is in flight, and overload
(429 with Retry-After, never a 5xx)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.e2e.helpers import AUTH, TINY_VOCAB, ServerProcess, assert_matches, decode, post, random_sequences

MAX_MODEL_LEN, MAX_SEQUENCES, MAX_BYTES, MAX_QUEUED = 32, 8, 50_000, 600


@pytest.fixture(scope="module")
def limits_server(tmp_path_factory):
    server = ServerProcess(
        tmp_path_factory.mktemp("limits"),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-sequences-per-request", str(MAX_SEQUENCES),
        "--max-request-bytes", str(MAX_BYTES), "--max-queued-tokens", str(MAX_QUEUED), "--max-batch-tokens", "128",
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0, server.log()


def _json(body):
    return json.dumps(body).encode(), "application/json"


def _one(**fields):
    return {"sequences": [{"input_ids": [1, 2], **fields.pop("seq", {})}], **fields}


BAD = [
    ("empty-sequences", _json({"sequences": []}), 422, "sequences"),
    ("empty-input-ids", _json(_one(seq={"input_ids": []})), 422, "sequences[0].input_ids"),
    ("negative-id", _json(_one(seq={"input_ids": [1, -5]})), 422, "sequences[0].input_ids[1]"),
    ("out-of-vocab", _json(_one(seq={"input_ids": [1, 2, TINY_VOCAB]})), 422, "sequences[0].input_ids[2]"),
    ("non-integer", _json(_one(seq={"input_ids": [1, 2.5]})), 422, "sequences[0].input_ids[1]"),
    ("boolean-id", _json(_one(seq={"input_ids": [True, 2]})), 422, "sequences[0].input_ids[0]"),
    ("score-from-0", _json(_one(seq={"score_from": 0})), 422, "sequences[0].score_from"),
    ("score-from-past-end", _json(_one(seq={"score_from": 3})), 422, "sequences[0].score_from"),
    ("temperature-0", _json(_one(temperature=0)), 422, "temperature"),
    ("temperature-negative", _json(_one(temperature=-0.5)), 422, "temperature"),
    ("temperature-nan", _json(_one(temperature=float("nan"))), 422, "temperature"),
    ("temperature-infinite", _json(_one(temperature=float("inf"))), 422, "temperature"),
    ("top-k-21", _json(_one(top_k=21)), 422, "top_k"),
    ("top-k-negative", _json(_one(top_k=-1)), 422, "top_k"),
    ("unknown-model", _json(_one(model="gpt-9")), 404, "model"),
    ("too-long", _json(_one(seq={"input_ids": [1] * (MAX_MODEL_LEN + 1)})), 413, "sequences[0].input_ids"),
    ("too-many-sequences", _json({"sequences": [{"input_ids": [1]}] * (MAX_SEQUENCES + 1)}), 413, "sequences"),
    ("too-big", (b'{"sequences": [{"input_ids": [' + b"1," * MAX_BYTES + b"1]}]}", "application/json"), 413, None),
    ("garbage-json", (b'{"sequences": [', "application/json"), 400, None),
    ("garbage-msgpack", (b"\xc1\x92\xff", "application/msgpack"), 400, None),
    ("wrong-content-type", (b'{"sequences": [{"input_ids": [1]}]}', "text/plain"), 400, "Content-Type"),
]


def test_bad_inputs_get_their_status_while_a_good_request_succeeds(limits_server, tiny_scorer):
    good = random_sequences(np.random.default_rng(11), MAX_SEQUENCES, TINY_VOCAB, lengths=(20, MAX_MODEL_LEN + 1))
    result = {}
    in_flight = threading.Thread(target=lambda: result.update(r=post(limits_server.url, {"sequences": good, "top_k": 1})))
    in_flight.start()
    for name, (content, media), status, param in BAD:
        response = httpx.post(limits_server.url + "/score", content=content, headers={**AUTH, "Content-Type": media},
                              timeout=60)
        assert response.status_code == status, (name, response.text)
        assert response.headers["content-type"] == "application/json", name
        error = response.json()["error"]
        assert set(error) == {"type", "message", "param"} and error["message"], name
        assert error["param"] == param, (name, error)
    in_flight.join(timeout=120)
    assert result["r"].status_code == 200, result["r"].text
    assert_matches(decode(result["r"], 1), good, tiny_scorer, top_k=1)


def test_overload_answers_429_with_retry_after_and_never_5xx(limits_server):
    body = {"sequences": [{"input_ids": list(range(1, 31))} for _ in range(MAX_SEQUENCES)]}  # 240 tokens
    statuses: list[int] = []
    retry_after: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 60  # bounded in time as well as in count

    def client(i: int):
        for _ in range(3):
            if time.monotonic() > stop_at:
                return
            response = post(limits_server.url, body, encoding="msgpack" if i % 2 else "json")
            with lock:
                statuses.append(response.status_code)
                if response.status_code == 429:
                    retry_after.append(response.headers.get("retry-after", ""))
                    assert response.json()["error"]["type"] == "queue_full"

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(client, range(16)))
    assert statuses and all(s in (200, 429) for s in statuses), sorted(set(statuses))
    assert 429 in statuses and 200 in statuses
    assert all(v.isdigit() and int(v) >= 1 for v in retry_after), retry_after
    metrics = httpx.get(limits_server.url + "/metrics", headers=AUTH).text
    assert 'packscore_rejections_total{reason="queue_full"}' in metrics
    assert httpx.get(limits_server.url + "/readyz").status_code == 200  # and it keeps serving


def test_the_request_size_413s_say_so_in_one_sentence(tmp_path):
    # API.md: an error's message is "one human sentence"; a client may show it as one line of a report.
    server = ServerProcess(tmp_path, "--max-sequences-per-request", "2", "--max-queued-tokens", "40",
                           "--max-batch-tokens", "64").wait_ready()
    try:
        bodies = {"too_many_sequences": {"sequences": [{"input_ids": [1, 2]}] * 3},
                  "request_too_large": {"sequences": [{"input_ids": list(range(1, 31))}] * 2}}
        errors = {name: post(server.url, body) for name, body in bodies.items()}
    finally:
        assert server.stop() == 0, server.log()
    for name, response in errors.items():
        assert response.status_code == 413, (name, response.text)
        error = response.json()["error"]
        assert error["type"] == name, error
        message = error["message"]
        assert message.endswith(".") and not re.search(r"[.!?]\s+[A-Z]", message), (name, message)
