"""``models()`` (GET /v1/models) waits out what ``score`` waits out: a 429 or 503 (a server loading or
draining) after its Retry-After, a server not reached (a gateway's 502/504 page too) for
``connect_retry_s``, a connection lost before the answer once; a trainer asking right after starting a
server gets the list once it serves, not a 503 or a connection error."""

import asyncio

import httpx
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError

BASE = "http://packscore.test"
MODELS = {"data": [{"id": "tiny", "weights_version": "v1"}]}


def _not_ready(status: int, kind: str) -> httpx.Response:
    error = {"type": kind, "message": "The model is not ready yet (loading).", "param": None}
    return httpx.Response(status, headers={"Retry-After": "0"}, json={"error": error})


def _answers(*outcomes):
    """A transport answering /v1/models with ``outcomes`` in turn (an exception class is raised), then the list."""
    pending, seen = list(outcomes), []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        got = pending.pop(0) if pending else httpx.Response(200, json=MODELS)
        if isinstance(got, type):
            raise got("refused", request=request)
        return got

    return httpx.MockTransport(handler), seen


def _starting_server():
    return _answers(httpx.ConnectError, httpx.Response(502, html="<html>Bad Gateway</html>"),
                    _not_ready(503, "not_ready"), _not_ready(429, "queue_full"), httpx.RemoteProtocolError)


def test_models_waits_for_a_server_that_is_starting():
    transport, seen = _starting_server()
    with ScoreClient(BASE, transport=transport, connect_retry_s=10) as client:
        assert client.models() == MODELS["data"]
    assert seen == ["/v1/models"] * 6, seen

    async def main():
        transport, seen = _starting_server()
        async with AsyncScoreClient(BASE, transport=transport, connect_retry_s=10) as client:
            return await client.models(), seen

    got, seen = asyncio.run(main())
    assert got == MODELS["data"] and seen == ["/v1/models"] * 6, seen


def test_models_with_retry_timeout_s_0_raises_the_503_as_it_came():
    transport, seen = _answers(_not_ready(503, "not_ready"))
    with ScoreClient(BASE, transport=transport, retry_timeout_s=0) as client, pytest.raises(ScoreError) as failed:
        client.models()
    assert (failed.value.status, failed.value.type) == (503, "not_ready"), failed.value
    assert seen == ["/v1/models"], seen
