"""What the scoring series of a real server's GET /metrics count, against requests of known sizes:
tokens returned, prefix tokens not run, the tokens a forward ran and its fill of --max-batch-tokens,
one queue wait per sequence (the wait for room included), one latency per answer, and the queue
gauges back at 0 once idle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.e2e.helpers import ServerProcess, post
from tests.live_metrics import Scrape, scrape

BUDGET = 512
MODEL = {"model": "tiny"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("metrics-values"), "--model", "tiny", "--prefix-sharing",
                           "--max-batch-tokens", str(BUDGET), "--max-wait-ms", "50")
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        assert server.stop() == 0, server.log()


def moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return (after.value(name, **labels) or 0.0) - (before.value(name, **labels) or 0.0)


def scored(server, sequences: list[dict]) -> tuple[Scrape, Scrape]:
    before = scrape(server.url)
    answer = post(server.url, {"sequences": sequences})
    assert answer.status_code == 200, answer.text
    return before, scrape(server.url)


def test_tokens_scored_forward_and_queue_series_count_what_the_requests_sent(server):
    sequences = [{"input_ids": list(range(1, 11)), "score_from": 2}, {"input_ids": list(range(20, 40)), "score_from": 5},
                 {"input_ids": list(range(50, 80))}]  # 10 + 20 + 30 tokens, 8 + 15 + 29 scored, one row
    before, after = scored(server, sequences)
    assert moved(before, after, "packscore_tokens_scored_total", **MODEL) == 52
    assert moved(before, after, "packscore_batch_tokens_count", **MODEL) == 1
    assert moved(before, after, "packscore_batch_tokens_sum", **MODEL) == 60
    assert moved(before, after, "packscore_batch_fill_ratio_sum", **MODEL) == pytest.approx(60 / BUDGET)
    assert moved(before, after, "packscore_queue_wait_seconds_count", **MODEL) == 3
    assert moved(before, after, "packscore_prefix_tokens_saved_total", **MODEL) == 0
    # Seconds, not milliseconds: a forward of 60 tokens of the tiny model and a 50 ms wait.
    assert 0 < moved(before, after, "packscore_forward_seconds_sum", **MODEL) < 5
    assert 0 < moved(before, after, "packscore_queue_wait_seconds_sum", **MODEL) / 3 < 5
    route = {"route": "/score"}
    assert moved(before, after, "packscore_requests_total", status="200", **route) == 1
    assert moved(before, after, "packscore_request_latency_seconds_count", **route) == 1
    assert 0 < moved(before, after, "packscore_request_latency_seconds_sum", **route) < 5
    assert after.value("packscore_queued_tokens") == 0 and after.value("packscore_queued_sequences") == 0


def test_a_shared_prompt_counts_once_in_the_forwards_tokens_and_fill(server):
    """A GRPO group of 4 members, a 200-token prompt and 40 tokens each: the row shares 192 prompt
    tokens (199 rounded down to 64s), so it runs 192 + 4 x 48 = 384 of its 960 admitted tokens and
    saves 3 x 192. The forward's tokens and fill are the 384 the budget counted, not the 960: a row
    of 512 that shares does not read as an oversize sequence (fill above 1)."""
    prompt = [(7 * i) % 500 + 1 for i in range(200)]
    group = [{"input_ids": prompt + [(13 * m + j) % 500 + 1 for j in range(40)], "score_from": 200} for m in range(4)]
    before, after = scored(server, group)
    assert moved(before, after, "packscore_tokens_scored_total", **MODEL) == 4 * 40
    assert moved(before, after, "packscore_prefix_tokens_saved_total", **MODEL) == 3 * 192
    assert moved(before, after, "packscore_batch_tokens_count", **MODEL) == 1
    assert moved(before, after, "packscore_batch_tokens_sum", **MODEL) == 192 + 4 * 48
    assert moved(before, after, "packscore_batch_fill_ratio_sum", **MODEL) == pytest.approx(384 / BUDGET)
    assert moved(before, after, "packscore_batch_fill_ratio_bucket", le="1.0", **MODEL) == 1
    assert moved(before, after, "packscore_queue_wait_seconds_count", **MODEL) == 4


def test_queue_wait_includes_the_wait_for_room_in_the_admission_bound(tmp_path):
    """8 one-row requests at once against a bound of 3 rows (its floor): 5 wait for room before they
    are queued. A sequence's queue wait runs from its request asking for room, so the queue waits
    and the forwards add up to the requests' latencies (less decoding and encoding): an overloaded
    server's waiting shows in the series PackscoreQueueWaitHigh reads, not only in 429s."""
    server = ServerProcess(tmp_path, "--model", "tiny", "--max-batch-tokens", "2048", "--queue-seconds", "0.1",
                           "--max-wait-ms", "2")
    try:
        server.wait_ready(timeout=240)
        rng = np.random.default_rng(5)
        bodies = [{"sequences": [{"input_ids": rng.integers(0, 500, 2000).tolist()}]} for _ in range(8)]
        before = scrape(server.url)
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda body: post(server.url, body), bodies))
        assert [a.status_code for a in answers] == [200] * len(bodies), [a.text[:200] for a in answers]
        after = scrape(server.url)
        assert moved(before, after, "packscore_queue_wait_seconds_count", **MODEL) == len(bodies)
        latency = moved(before, after, "packscore_request_latency_seconds_sum", route="/score")
        forwards = moved(before, after, "packscore_forward_seconds_sum", **MODEL)
        waited = moved(before, after, "packscore_queue_wait_seconds_sum", **MODEL)
        assert waited <= latency - forwards
        assert waited >= 0.85 * (latency - forwards), (waited, latency, forwards)
    finally:
        assert server.stop() == 0, server.log()
