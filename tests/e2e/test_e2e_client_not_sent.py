"""A request the client never sent, against a real server: every connection of its pool busy with a
slow /score for longer than timeout_s (httpx's PoolTimeout). The error says it was not sent (an
update did not run and is safe to send again), and nothing is retried behind the caller's back."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from packscore_client import ScoreClient, ScoreError
from tests.e2e.helpers import fake_server, queued_sequences, served_version


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("not-sent")
    (root / "step-1").mkdir()  # FakeBackend takes any directory as a checkpoint
    server = fake_server(root, "--weights-root", str(root), env={"FAKE_SECONDS_PER_TOKEN": "0.01"})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_a_pool_timeout_says_the_request_was_not_sent_and_the_update_did_not_run(server):
    before = served_version(server.url)
    transport = httpx.HTTPTransport(limits=httpx.Limits(max_connections=1))
    client = ScoreClient(server.url, transport=transport, timeout_s=0.5, connect_retry_s=5.0)
    client.ready()  # the limits known: score sends its /score at once
    busy = httpx.Client(base_url=server.url, transport=transport, timeout=60)
    slow = threading.Thread(target=lambda: busy.post("/score", json={"sequences": [{"input_ids": [1] * 400}]}))
    slow.start()  # 400 tokens at 10 ms: the pool's one connection is busy for seconds
    try:
        end = time.monotonic() + 30
        while queued_sequences(server.url) == 0:
            assert time.monotonic() < end, server.log()
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(ScoreError) as update:
            client.update_weights(None, "step-1", version="step-1")
        u = update.value
        assert (u.status, u.type) == (0, "connection_error") and "may have run" not in str(u), u
        assert "POST /v1/weights" in str(u) and "was not sent" in str(u) and "sending it again is safe" in str(u), u
        assert "pool" in str(u) and "timeout_s" in str(u), u
        assert served_version(server.url) == before  # the update never reached the server
        with pytest.raises(ScoreError) as score:  # not retried for connect_retry_s as a server not reached
            client.score([[1, 2, 3]])
        s = score.value
        assert (s.status, s.type) == (0, "connection_error") and "was not sent" in str(s) and "pool" in str(s), s
        assert time.monotonic() - t0 < 3.0, "a pool timeout was waited out again instead of raised at once"
    finally:
        slow.join(timeout=60)
    # once the connection is free, sending the same update again serves it
    assert client.update_weights(None, "step-1", version="step-1").weights_version == "step-1"
    assert served_version(server.url) == "step-1"
    busy.close()
    client.close()
