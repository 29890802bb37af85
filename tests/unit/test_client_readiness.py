"""The client's readiness calls, ready() and wait_ready(), against the app in-process and
against answers a proxy in front of a starting server gives."""

import asyncio
import threading
import time

import httpx
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

BASE = "http://packscore.test"


def test_wait_ready_polls_readyz_until_the_first_scoring_pass_succeeds(monkeypatch):
    from packscore_client import protocol

    monkeypatch.setattr(protocol, "READY_POLL_S", 0.02)
    gate = threading.Event()  # holds the server's readiness probe, so /readyz answers 503 until set

    async def main():
        app = create_app(Settings(max_queued_tokens=400), FakeBackend(gate=gate))
        async with running_app(app, ready=False):
            async with AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app)) as client:
                waiting = await client.ready()
                with pytest.raises(ScoreError) as late:
                    await client.wait_ready(timeout_s=0.2)
                waiter = asyncio.ensure_future(client.wait_ready(timeout_s=10))
                await asyncio.sleep(0.1)
                assert not waiter.done()
                gate.set()
                return waiting, late.value, await waiter, client.limits

    waiting, late, ready, limits = asyncio.run(main())
    assert waiting["status"] != "ready" and waiting["error"]["type"] == "not_ready", waiting
    # the client gave up, not the server: status 0, the last status named
    assert late.status == 0 and late.type == "not_ready" and "(last: probing)" in str(late), late
    assert ready["status"] == "ready" and ready["limits"]["max_request_tokens"] == 400, ready
    assert limits.max_request_tokens == 400  # learned from the ready answer, as before a first score


def test_wait_ready_waits_through_no_server_and_a_proxys_pages_and_stops_at_a_lasting_failure(monkeypatch):
    from packscore_client import protocol

    monkeypatch.setattr(protocol, "READY_POLL_S", 0.01)
    answers = [httpx.ConnectError("refused"), httpx.Response(502, text="<html>bad gateway</html>"),
               httpx.Response(503, text="<html>starting</html>"),
               httpx.Response(503, json={"status": "loading", "error": {"type": "not_ready", "message": "x"}}),
               httpx.Response(200, json={"status": "ready", "limits": {"max_request_tokens": 77}})]

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with ScoreClient(BASE, transport=httpx.MockTransport(handler)) as client:
        assert client.wait_ready(timeout_s=10)["status"] == "ready" and not answers
        assert client.limits.max_request_tokens == 77
        answers[:] = [httpx.Response(503, text="<html>down</html>")]
        assert client.ready() == {"status": "http_503"}  # a page that is not the server's JSON
        answers[:] = [httpx.Response(503, json={"status": "restart_failed"})]
        with pytest.raises(ScoreError) as lasting:
            client.wait_ready(timeout_s=10)
    assert lasting.value.status == 503 and "restart_failed" in str(lasting.value), lasting.value


def test_wait_ready_counts_an_unreachable_server_as_not_ready():
    from tests.ports import held_port

    with held_port() as port, ScoreClient(f"http://127.0.0.1:{port}", connect_retry_s=0.2) as client:
        with pytest.raises(ScoreError) as unreachable:
            client.ready()
        with pytest.raises(ScoreError) as late:
            client.wait_ready(timeout_s=0.3)
    assert unreachable.value.type == "connection_error" and unreachable.value.status == 0
    assert late.value.status == 0 and late.value.type == "not_ready" and "ConnectError" in str(late.value), late.value


@pytest.mark.parametrize("timeout_s,kind", [(float("nan"), ValueError), (-1, ValueError), ("30", TypeError), (None, TypeError)])
def test_wait_ready_refuses_a_timeout_that_is_not_a_number_of_seconds_before_polling(timeout_s, kind):
    # a NaN never ended the wait for a server that does not come; "30" failed adding it to a float
    def nothing_sent(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"{request.url.path} was sent")

    with ScoreClient(BASE, transport=httpx.MockTransport(nothing_sent)) as client:
        with pytest.raises(kind, match="^timeout_s must be"):
            client.wait_ready(timeout_s=timeout_s)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(nothing_sent)) as client:
            with pytest.raises(kind, match="^timeout_s must be"):
                await client.wait_ready(timeout_s=timeout_s)

    asyncio.run(main())


def test_concurrent_first_calls_share_one_readyz_which_failed_is_not_sent_again_in_turn():
    """Each first call sent its own GET /readyz; with a lock alone, one that failed would be sent again
    by each waiting call in turn, each waiting out its own."""
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == "/readyz":
            time.sleep(0.3)
            return httpx.Response(404)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [{"logprobs": [-1.0]}]})

    with ScoreClient(BASE, encoding="json", max_concurrency=8, transport=httpx.MockTransport(answer)) as client:
        start = threading.Barrier(8)

        def first_call():
            start.wait()
            client.score([[1, 2]])

        began = time.monotonic()
        callers = [threading.Thread(target=first_call) for _ in range(8)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
        took = time.monotonic() - began
        assert sent.count("/readyz") == 1 and sent.count("/score") == 8, sent
        assert took < 1.5, f"{took:.2f}s: the 404 was sent again in turn"
        client.score([[1, 2]])  # a later call still asks: the limits are unknown
        assert sent.count("/readyz") == 2, sent

    async def async_answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == "/readyz":
            await asyncio.sleep(0.3)
            return httpx.Response(404)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [{"logprobs": [-1.0]}]})

    async def main():
        async with AsyncScoreClient(BASE, encoding="json", transport=httpx.MockTransport(async_answer)) as client:
            began = time.monotonic()
            await asyncio.gather(*(client.score([[1, 2]]) for _ in range(8)))
            return time.monotonic() - began

    sent.clear()
    took = asyncio.run(main())
    assert sent.count("/readyz") == 1 and sent.count("/score") == 8, sent
    assert took < 1.5, f"{took:.2f}s: the 404 was sent again in turn"


def test_a_first_call_cancelled_while_its_readyz_is_out_leaves_it_to_the_calls_waiting_on_it():
    """The first call's GET /readyz is cancelled with it (a caller's timeout, say): the next waiting
    call sends one of its own and waits it out from the start."""
    sent = []

    async def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == "/readyz":
            await asyncio.sleep(0.3)
            return httpx.Response(200, json={"status": "ready", "limits": {"max_request_tokens": 77}})
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [{"logprobs": [-1.0]}]})

    async def main():
        async with AsyncScoreClient(BASE, encoding="json", transport=httpx.MockTransport(answer)) as client:
            first = asyncio.ensure_future(client.score([[1, 2]]))
            await asyncio.sleep(0.05)  # its GET /readyz is out
            others = [asyncio.ensure_future(client.score([[1, 2]])) for _ in range(7)]
            await asyncio.sleep(0.05)
            first.cancel()
            await asyncio.gather(*others)
            with pytest.raises(asyncio.CancelledError):
                await first
            return client.limits

    limits = asyncio.run(main())
    assert sent.count("/readyz") == 1 and sent.count("/score") == 7, sent
    assert limits.max_request_tokens == 77  # learned from the one answer the waiting calls took
