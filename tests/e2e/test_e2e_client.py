"""The bundled client against a real server process, where a trainer meets it: keys as they are read
from files, a failed call's leftovers, a close while a call is on the wire, dict keys and score_from values the server would refuse, an
async client run by one asyncio.run per call, max_concurrency shared by the calls at once on one client."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError, UpdateEverywhereError
from tests.e2e.helpers import API_KEY, AUTH, TINY_VOCAB, queued_sequences


def test_a_key_read_from_a_file_with_its_newline_scores_and_a_bad_key_is_never_quoted(tiny_server):
    # open(path).read() keeps the newline; the server strips its own key file the same way
    with ScoreClient(tiny_server.url, API_KEY + "\n", admin_key=" admin\n") as client:
        (result,) = client.score([[1, 2, 3]])
        assert result.logprobs.shape == (2,)
        assert client.models()[0]["id"] == "tiny"
    # refused when the client is built, naming the argument: not an obscure UnicodeEncodeError at a call
    for where in ("api_key", "admin_key"):
        for bad in ("sec\nret", "sec\u00e9ret", "sec\u2028ret", "sec\u00a0ret"):
            with pytest.raises(ValueError, match=where) as refused:
                ScoreClient(tiny_server.url, **{where: bad})
            assert "sec" not in str(refused.value), refused.value


def test_a_sequence_key_the_contract_does_not_name_is_refused_not_dropped(tiny_server):
    with ScoreClient(tiny_server.url, API_KEY) as client:
        with pytest.raises(ValueError, match=r"sequences\[1\]: 'scorefrom' is not a field"):
            client.score([[1, 2, 3], {"input_ids": [1, 2, 3, 4], "scorefrom": 3}])
        # the four it takes, all at once
        (result,) = client.score([{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 3, "rollout_logprobs": [-1.0]}])
        assert (result.id, result.logprobs.shape, sorted(result.mismatch)) == ("a", (1,), ["k3_kl", "max_abs_diff",
                                                                                    "mean_abs_diff"])
    # the same figures whichever encoding carried them (JSON prints float32's short form, msgpack doubles)
    with ScoreClient(tiny_server.url, API_KEY, encoding="json") as client:
        (in_json,) = client.score([{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 3, "rollout_logprobs": [-1.0]}])
    assert in_json.mismatch == result.mismatch and in_json.mismatch["max_abs_diff"] > 0, (in_json.mismatch, result.mismatch)


def test_closing_the_client_after_a_failed_call_blames_no_server(tiny_server, caplog):
    # the call's other parts are still in flight when the with-block closes the client under them
    bad = {"input_ids": [1, 2, TINY_VOCAB]}
    long = np.arange(1, 3001) % TINY_VOCAB  # a forward of seconds: still running at the close
    with caplog.at_level(logging.WARNING, logger="packscore_client"):
        with pytest.raises(ScoreError) as failed:
            with ScoreClient(tiny_server.url, API_KEY, max_sequences_per_request=1, max_concurrency=3) as client:
                client.score([bad, long, long])
        client._pool.shutdown(wait=True)
    assert (failed.value.status, failed.value.param) == (422, "sequences[0].input_ids[2]"), failed.value
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_close_while_a_request_is_on_the_wire_lets_it_end_with_its_answer(tiny_server):
    # closing its socket under the waiting thread failed the call, or, once another connection took
    # the descriptor, left the thread waiting out timeout_s
    client = ScoreClient(tiny_server.url, API_KEY)
    client.ready()  # the limits known: the call sends its one /score at once
    long = np.arange(1, 3001) % TINY_VOCAB  # a forward of seconds: still running at the close
    outcome: dict = {}

    def call():
        try:
            outcome["results"] = client.score([long])
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    end = time.monotonic() + 60
    while queued_sequences(tiny_server.url) == 0 and time.monotonic() < end:
        time.sleep(0.02)
    client.close()
    caller.join(120)
    assert not caller.is_alive() and "error" not in outcome, outcome
    assert [r.logprobs.shape for r in outcome["results"]] == [(2999,)]
    assert client._http.is_closed  # once the last request on the wire ended
    with pytest.raises(RuntimeError, match="closed"):
        client.score([[1, 2, 3]])


def test_an_aclose_from_another_task_lets_the_call_on_the_wire_end_with_its_answer(tiny_server, caplog):
    # closing the connections under the awaiting task failed its call after a false "server closed
    # the connection" warning
    long = np.arange(1, 3001) % TINY_VOCAB  # a forward of seconds: still running at the close

    async def main():
        client = AsyncScoreClient(tiny_server.url, API_KEY)
        await client.ready()  # the limits known: the call sends its one /score at once
        call = asyncio.ensure_future(client.score([long]))
        end = time.monotonic() + 60
        while await asyncio.to_thread(queued_sequences, tiny_server.url) == 0 and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await client.aclose()
        results = await call
        with pytest.raises(RuntimeError, match="closed"):
            await client.score([[1, 2, 3]])
        return client, results

    with caplog.at_level(logging.WARNING, logger="packscore_client"):
        client, results = asyncio.run(main())
    assert [r.logprobs.shape for r in results] == [(2999,)]
    assert client._http.is_closed  # once the last request on the wire ended
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_an_update_everywhere_leaves_the_callers_transport_to_its_call_on_the_wire(tiny_server, caplog):
    # the per-address clients closed the transport given to the client, and the connection under its
    # call in another task: that call failed after a false "server closed the connection" warning
    long = np.arange(1, 3001) % TINY_VOCAB  # a forward of seconds: still running during the update

    async def main():
        async with AsyncScoreClient(tiny_server.url.replace("127.0.0.1", "localhost"), API_KEY,
                                    transport=httpx.AsyncHTTPTransport(), connect_retry_s=0.5) as client:
            await client.ready()  # the limits known: the call sends its one /score at once
            call = asyncio.ensure_future(client.score([long]))
            end = time.monotonic() + 60
            while await asyncio.to_thread(queued_sequences, tiny_server.url) == 0 and time.monotonic() < end:
                await asyncio.sleep(0.02)
            with pytest.raises(UpdateEverywhereError) as refused:  # this server takes no updates: 404
                await client.update_weights_everywhere(None, "step-1")
            return refused.value, await call, await client.score([[1, 2, 3]])

    with caplog.at_level(logging.WARNING, logger="packscore_client"):
        refused, results, after = asyncio.run(main())
    assert refused.failed["127.0.0.1"].status == 404, refused
    assert [r.logprobs.shape for r in results] == [(2999,)] and after[0].logprobs.shape == (2,)
    lost = [r.getMessage() for r in caplog.records if "closed the connection" in r.getMessage()]
    assert not lost, lost  # (an unreachable ::1, where localhost also names it, may warn: not this)


@pytest.mark.parametrize("score_from", [2.5, 2.0, "2", True, None])
def test_a_score_from_the_server_would_refuse_is_refused_not_rounded(tiny_server, score_from):
    with ScoreClient(tiny_server.url, API_KEY) as client:
        with pytest.raises(TypeError, match=r"sequences\[0\]: score_from must be an int"):
            client.score([{"input_ids": [1, 2, 3, 4], "score_from": score_from}])
        (result,) = client.score([{"input_ids": [1, 2, 3, 4], "score_from": np.int64(2)}])
        assert result.logprobs.shape == (2,)


def test_an_async_client_serves_one_asyncio_run_per_call(tiny_server):
    # a synchronous trainer loop that runs each call in its own event loop
    client = AsyncScoreClient(tiny_server.url, API_KEY)
    got = [asyncio.run(client.score([[1, 2, 3]]))[0].logprobs for _ in range(3)]
    asyncio.run(client.aclose())
    assert all(np.array_equal(g, got[0]) for g in got), got


class _Counting:
    """Counts the /score requests on the wire at once (the most seen in ``peak``)."""

    def __init__(self):
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def enter(self, request):
        if request.url.path != "/score":  # each call's first GET /readyz is not a part
            return False
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        return True

    def leave(self, counted):
        with self.lock:
            self.now -= counted


def test_max_concurrency_bounds_the_clients_requests_across_calls_at_once_in_both_clients(tiny_server):
    # AsyncScoreClient bounded each call alone: three gathered calls sent three times max_concurrency
    # requests, overrunning the admission share each part is sized for (429s), unlike ScoreClient's threads
    count = _Counting()

    class Sync(httpx.HTTPTransport):
        def handle_request(self, request):
            counted = count.enter(request)
            try:
                return super().handle_request(request)
            finally:
                count.leave(counted)

    class Async(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request):
            counted = count.enter(request)
            try:
                return await super().handle_async_request(request)
            finally:
                count.leave(counted)

    batch = [{"id": f"s{i}", "input_ids": (np.arange(300) * (i + 1)) % TINY_VOCAB} for i in range(4)]
    knobs = dict(max_concurrency=2, max_sequences_per_request=1)
    with ScoreClient(tiny_server.url, API_KEY, transport=Sync(), **knobs) as client:
        alone = client.score(batch)
        threads = [threading.Thread(target=client.score, args=(batch,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert count.peak <= 2, count.peak

    async def main():
        async with AsyncScoreClient(tiny_server.url, API_KEY, transport=Async(), **knobs) as client:
            return await asyncio.gather(*[client.score(batch) for _ in range(3)])

    count.peak = 0
    for results in asyncio.run(main()):
        assert [(r.id, r.logprobs.tobytes()) for r in results] == [(r.id, r.logprobs.tobytes()) for r in alone]
    assert count.peak <= 2, count.peak


def test_a_call_queued_behind_another_on_the_same_client_raises_at_its_deadline(tiny_server):
    # its part waited for the client's one request (max_concurrency=1) until the other call's forward ended,
    # seconds past deadline_ms, and only then raised the 504
    long = np.arange(1, 3001) % TINY_VOCAB  # a forward of seconds
    with ScoreClient(tiny_server.url, API_KEY, max_concurrency=1) as client:
        client.ready()  # the limits known: each call sends its /score at once
        other = threading.Thread(target=client.score, args=([long],))
        other.start()
        end = time.monotonic() + 60
        while queued_sequences(tiny_server.url) == 0 and time.monotonic() < end:
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(ScoreError) as late:
            client.score([[1, 2, 3]], deadline_ms=300)
        waited = time.monotonic() - t0
        busy = other.is_alive()
        other.join()
    assert (late.value.status, late.value.type, late.value.param) == (504, "deadline_exceeded", "deadline_ms")
    assert waited < 1.0 and busy, (waited, busy)

    async def main():
        async with AsyncScoreClient(tiny_server.url, API_KEY, max_concurrency=1) as client:
            await client.ready()
            other = asyncio.ensure_future(client.score([long]))
            while queued_sequences(tiny_server.url) == 0:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            with pytest.raises(ScoreError) as late:
                await client.score([[1, 2, 3]], deadline_ms=300)
            waited, busy = time.monotonic() - t0, not other.done()
            await other
            return late.value, waited, busy

    error, waited, busy = asyncio.run(main())
    assert (error.status, error.type, error.param) == (504, "deadline_exceeded", "deadline_ms")
    assert waited < 1.0 and busy, (waited, busy)


def _readyz_answered(url: str) -> float:
    """GET /readyz answered so far, every status: ``packscore_requests_total{route="/readyz"}``."""
    lines = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("packscore_requests_total{") and 'route="/readyz"' in line)


def test_concurrent_first_calls_on_a_new_client_learn_its_limits_with_one_readyz(tiny_server):
    # each first call sent its own GET /readyz, eight at once for a trainer's eight threads or tasks
    before = _readyz_answered(tiny_server.url)
    with ScoreClient(tiny_server.url, API_KEY, max_concurrency=8) as client:
        start = threading.Barrier(8)

        def first_call(i: int) -> None:
            start.wait()
            client.score([[1, 2, 3 + i]])

        callers = [threading.Thread(target=first_call, args=(i,)) for i in range(8)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    blocking = _readyz_answered(tiny_server.url) - before

    async def main():
        async with AsyncScoreClient(tiny_server.url, API_KEY, max_concurrency=8) as client:
            await asyncio.gather(*(client.score([[1, 2, 3 + i]]) for i in range(8)))

    asyncio.run(main())
    assert (blocking, _readyz_answered(tiny_server.url) - before - blocking) == (1, 1)
