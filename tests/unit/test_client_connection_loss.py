"""The client when the connection fails: a read timeout, a server not reached, a request lost with
its connection (sent once more: scoring has no side effects)."""

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError

BASE = "http://packscore.test"


@contextlib.contextmanager
def _silent_server():
    """``(url, accepted)``: a listener that accepts every connection and never reads or answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []

    def accept_and_never_answer():
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_and_never_answer, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


def test_a_read_timeout_is_not_sent_again():
    """A server that took the request and has not answered within timeout_s is still scoring it:
    sending it again would score it twice on a server already too slow."""
    with _silent_server() as (url, accepted):
        with ScoreClient(url, timeout_s=0.5, connect_retry_s=10) as client, pytest.raises(ScoreError) as failed:
            client.score([[1, 2, 3]])
        assert failed.value.status == 0 and failed.value.type == "read_timeout", failed.value
        # /readyz (the limits) and /score: one connection each at most, the score never resent
        assert len(accepted) <= 2, f"{len(accepted)} connections"


def test_an_unreachable_server_is_retried_for_the_whole_connect_window():
    from tests.ports import held_port

    with held_port() as port:  # nothing listens there
        started = time.monotonic()
        with ScoreClient(f"http://127.0.0.1:{port}", connect_retry_s=1.5) as client, pytest.raises(ScoreError):
            client.score([[1, 2, 3]])
    elapsed = time.monotonic() - started
    assert 1.48 <= elapsed < 1.5 + 2, f"gave up after {elapsed:.2f} s of a 1.5 s connect_retry_s"


def test_a_connect_window_cut_short_by_the_calls_retry_budget_says_so(caplog):
    """retry_timeout_s bounds every retry of a call, those of a server not reached too: where it ends
    before connect_retry_s, the warning names it and when it ends, not the connect window it cuts short."""
    from tests.ports import held_port

    with held_port() as port, caplog.at_level("WARNING", logger="packscore_client"):  # nothing listens there
        started = time.monotonic()
        with ScoreClient(f"http://127.0.0.1:{port}", retry_timeout_s=1.0, connect_retry_s=30) as client:
            with pytest.raises(ScoreError) as failed:
                client.score([[1, 2, 3]])
    elapsed = time.monotonic() - started
    assert failed.value.type == "connection_error" and elapsed < 1.0 + 2, f"gave up after {elapsed:.2f} s"
    warnings = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert warnings and all("gives up 1s after the call started: retry_timeout_s" in w for w in warnings), warnings


def test_deadline_ms_ends_the_retries_of_an_unreachable_server_in_time(monkeypatch):
    """deadline_ms bounds the call, its retries included: a back-off that would end past it raises 504
    at once (as a 429's Retry-After does), not once it has been slept through."""
    from tests.ports import held_port

    monkeypatch.setattr("packscore_client.protocol.random.random", lambda: 1.0)  # back-offs of 0.25, 0.5, 1, 2 s
    with held_port() as port:  # nothing listens there
        with ScoreClient(f"http://127.0.0.1:{port}", connect_retry_s=30) as client, pytest.raises(ScoreError) as failed:
            started = time.monotonic()
            client.score([[1, 2, 3]], deadline_ms=1000)
    elapsed = time.monotonic() - started
    assert (failed.value.status, failed.value.type) == (504, "deadline_exceeded"), failed.value
    assert "could not reach" in failed.value.message, failed.value.message
    assert elapsed < 1.0 + 0.2, f"raised {elapsed:.2f} s into a call of deadline_ms=1000"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_deadline_ms_bounds_a_first_calls_wait_for_the_limits(blocking):
    """The GET /readyz a new client's first call sends for the server's limits is part of the call:
    a server that does not answer it is waited for until deadline_ms at most, then 504."""

    async def awaited(url):
        async with AsyncScoreClient(url, timeout_s=30) as client:
            await client.score([[1, 2, 3]], deadline_ms=1000)

    with _silent_server() as (url, _):
        started = time.monotonic()
        with pytest.raises(ScoreError) as failed:
            if blocking:
                with ScoreClient(url, timeout_s=30) as client:
                    client.score([[1, 2, 3]], deadline_ms=1000)
            else:
                asyncio.run(awaited(url))
        elapsed = time.monotonic() - started
    assert (failed.value.status, failed.value.type) == (504, "deadline_exceeded"), failed.value
    assert elapsed < 1.0 + 0.5, f"raised {elapsed:.2f} s into a call of deadline_ms=1000"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("failure", [httpx.RemoteProtocolError, httpx.ReadError])
def test_a_request_lost_with_its_connection_is_sent_once_more(failure, blocking):
    """A kept-alive connection the server closed as the request left (idle, or restarting): the
    request is sent once more and answered; lost twice in a row, the call raises."""
    sent, losses = [], {"in_a_row": 1}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        sent.append(request.url.path)
        if len(sent) <= losses["in_a_row"]:
            raise failure("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [-0.5, -0.25]}], "usage": {"input_tokens": 3, "scored_tokens": 2}})

    ids = [[1, 2, 3]]
    if blocking:
        with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
            (result,) = client.score(ids, return_entropy=False)
    else:
        async def call():
            async with AsyncScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
                return await client.score(ids, return_entropy=False)
        (result,) = asyncio.run(call())
    assert sent == ["/score", "/score"], sent
    assert result.logprobs.tolist() == [-0.5, -0.25], result

    sent.clear()
    losses["in_a_row"] = 2
    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(ScoreError) as failed:
            client.score(ids, return_entropy=False)
    assert failed.value.type == "connection_error" and "twice in a row" in failed.value.message, failed.value
    assert sent == ["/score", "/score"], sent


def test_losses_with_an_answer_between_them_are_not_twice_in_a_row():
    outcomes = iter(["lost", 429, "lost", 200])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        outcome = next(outcomes)
        if outcome == "lost":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if outcome == 429:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {
                "type": "queue_full", "message": "full", "param": None}})
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [-0.5, -0.25]}], "usage": {"input_tokens": 3, "scored_tokens": 2}})

    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
        (result,) = client.score([[1, 2, 3]], return_entropy=False)
    assert result.logprobs.tolist() == [-0.5, -0.25], result


def test_a_proxys_502_or_504_page_is_waited_out_as_an_unreachable_server():
    """A gateway's own answer (an HTML page, not the server's JSON) while the server behind it
    restarts: retried for connect_retry_s, like a refused connection, then raised."""
    answers = iter([502, 504, 200])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        status = next(answers, 502)
        if status != 200:
            return httpx.Response(status, html="<html><body>Bad Gateway</body></html>")
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [-0.5, -0.25]}], "usage": {"input_tokens": 3, "scored_tokens": 2}})

    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler), connect_retry_s=10) as client:
        (result,) = client.score([[1, 2, 3]], return_entropy=False)
    assert result.logprobs.tolist() == [-0.5, -0.25], result
    started = time.monotonic()
    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler), connect_retry_s=0.5) as client:
        with pytest.raises(ScoreError) as failed:
            client.score([[1, 2, 3]], return_entropy=False)
    assert failed.value.type == "connection_error" and "502" in failed.value.message, failed.value
    assert time.monotonic() - started < 0.5 + 2, time.monotonic() - started


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_server_that_died_mid_request_is_waited_out_not_lost_twice_at_once(blocking):
    """A server killed mid-request closes its other kept-alive connections too; a resend at once can
    take one before its close is seen and be lost again, raising "twice in a row" instead of
    waiting out the restart for connect_retry_s."""
    sent: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        sent.append(time.monotonic())
        if len(sent) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if sent[-1] - sent[0] < 0.1:  # a pooled connection of the dead server, its close not yet seen
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [-0.5, -0.25]}], "usage": {"input_tokens": 3, "scored_tokens": 2}})

    kw = dict(encoding="json", transport=httpx.MockTransport(handler), connect_retry_s=30)
    if blocking:
        with ScoreClient(BASE, **kw) as client:
            (result,) = client.score([[1, 2, 3]], return_entropy=False)
    else:
        async def call():
            async with AsyncScoreClient(BASE, **kw) as client:
                return await client.score([[1, 2, 3]], return_entropy=False)
        (result,) = asyncio.run(call())
    assert len(sent) == 2 and result.logprobs.tolist() == [-0.5, -0.25], (sent, result)


def test_an_update_to_a_url_without_a_scheme_says_it_was_not_sent():
    # "localhost:8000" reads as the scheme "localhost": nothing was sent, yet the update "may have run"
    with ScoreClient("localhost:8000", connect_retry_s=0.1) as client, pytest.raises(ScoreError) as failed:
        client.update_weights("policy", "step-1")
    e = failed.value
    assert (e.status, e.type) == (0, "connection_error") and "may have run" not in str(e), e
    assert "was not sent" in str(e) and "UnsupportedProtocol" in str(e) and "sending it again is safe" in str(e), e
