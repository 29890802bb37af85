"""The client over a link too slow for the server's read timeout: a body that does not arrive in
time gets 408 and nothing is scored, so the client sends it again in halves until each part
arrives in time; one sequence that cannot arrive in time raises the 408."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from packscore_client import ScoreClient, ScoreError
from tests.e2e.helpers import fake_server

RATE = 60_000  # bytes/s the upload is held to
READ_TIMEOUT_S = 1


class SlowUpload(httpx.HTTPTransport):
    """Sends each request's body at RATE bytes/s, as a slow link between trainer and server would."""

    def __init__(self):
        super().__init__()
        self.bodies: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        if request.method == "POST":
            self.bodies.append(len(body))

        def trickle():
            for i in range(0, len(body), 6000):
                time.sleep(6000 / RATE)
                yield body[i : i + 6000]

        slow = httpx.Request(request.method, request.url, headers=request.headers, content=trickle() if body else b"",
                             extensions=request.extensions)
        return super().handle_request(slow)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = fake_server(tmp_path_factory.mktemp("slow-link"), "--request-read-timeout-s", str(READ_TIMEOUT_S))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_a_batch_too_slow_to_arrive_whole_is_sent_in_halves_and_scored_in_order(server, caplog):
    # 8 x 2500 tokens of JSON, about 80 kB: more than a second at 60 kB/s; a half arrives in time.
    seqs = [[(7 * i + j) % 999 + 1 for j in range(2500)] for i in range(8)]
    transport = SlowUpload()
    with caplog.at_level(logging.WARNING, logger="packscore_client"):
        with ScoreClient(server.url, encoding="json", transport=transport, max_concurrency=1) as client:
            got = client.score(seqs, return_entropy=False)
    with ScoreClient(server.url, encoding="json") as client:
        fast = client.score(seqs, return_entropy=False)
    assert len(got) == len(seqs)
    for i, (a, b) in enumerate(zip(got, fast)):
        assert (a.logprobs == b.logprobs).all(), f"sequence {i}: sent in parts, its scores differ from the whole's"
    assert transport.bodies[0] > READ_TIMEOUT_S * RATE and len(transport.bodies) >= 3, transport.bodies
    assert "sending it in halves" in caplog.text, caplog.text


def test_one_sequence_too_slow_to_arrive_raises_the_408(server):
    with ScoreClient(server.url, encoding="json", transport=SlowUpload()) as client:
        with pytest.raises(ScoreError) as refused:
            client.score([[5] * 30_000], return_entropy=False)
    assert (refused.value.status, refused.value.type) == (408, "request_timeout"), refused.value
