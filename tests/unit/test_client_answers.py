"""A 200 that is not packscore's answer (another server's or a proxy's page at the URL), or a body
that cannot be decoded, raises ScoreError naming the route, not a raw KeyError, JSON or httpx error."""

import asyncio
import socket

import httpx
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError, UpdateEverywhereError

BASE = "http://packscore.test"
PAGE = "<html><body>Welcome to nginx!</body></html>"


def _page(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text=PAGE, headers={"content-type": "text/html", "x-request-id": "rid-7"})


@pytest.mark.parametrize("call,route", [
    (lambda c: c.score([[1, 2, 3]]), "POST /score"),
    (lambda c: c.models(), "GET /v1/models"),
    (lambda c: c.update_weights("policy", "step-1"), "POST /v1/weights"),
], ids=["score", "models", "update_weights"])
def test_a_page_that_is_not_packscores_answer_raises_score_error(call, route):
    with ScoreClient(BASE, transport=httpx.MockTransport(_page)) as client:
        with pytest.raises(ScoreError) as caught:
            call(client)
    e = caught.value
    assert (e.status, e.type, e.request_id) == (200, "invalid_response", "rid-7"), e
    assert e.message.startswith(f"{route} was answered 200 with a body that is not packscore's"), e

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_page)) as client:
            with pytest.raises(ScoreError) as caught:
                await call(client)
        return caught.value

    assert str(asyncio.run(main())) == str(e)


def test_a_page_from_one_pod_fails_that_pod_alone(monkeypatch):
    # a raw KeyError there lost the answers of every other pod, which had taken the update
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.7", "10.0.0.8")
    ] if host == "pods.test" else real(host, port, *a, **kw))

    def pods(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.8":
            return _page(request)
        return httpx.Response(200, json={"model": "policy", "weights_version": "step-1", "previous_version": "v0",
                                         "load_s": 0.1, "swap_ms": 1.0})

    with ScoreClient("http://pods.test", transport=httpx.MockTransport(pods)) as client:
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere("policy", "step-1")
    e = caught.value
    assert list(e.updated) == ["10.0.0.7"] and e.failed["10.0.0.8"].type == "invalid_response", e
    assert "the update may have run" in str(e), e


def test_a_body_that_cannot_be_decoded_is_a_score_error():
    def garbled(request: httpx.Request) -> httpx.Response:  # a proxy's gzip header on a body that is not gzip
        return httpx.Response(200, content=b"not gzip at all", headers={"content-encoding": "gzip"})

    with ScoreClient(BASE, transport=httpx.MockTransport(garbled), connect_retry_s=0.1) as client:
        with pytest.raises(ScoreError) as scored:
            client.score([[1, 2, 3]])
        with pytest.raises(ScoreError) as updated:
            client.update_weights("policy", "step-1")
    assert scored.value.type == "connection_error" and "DecodingError" in str(scored.value), scored.value
    assert updated.value.type == "connection_error" and "may have run" in str(updated.value), updated.value

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(garbled), connect_retry_s=0.1) as client:
            with pytest.raises(ScoreError) as scored:
                await client.score([[1, 2, 3]])
        return scored.value

    assert str(asyncio.run(main())) == str(scored.value)


@pytest.mark.parametrize("readyz", [[], {"status": "ready", "limits": []}], ids=["a-list", "limits-a-list"])
def test_a_readyz_that_is_not_the_contracts_object_leaves_the_limits_to_the_defaults(readyz):
    # the first call's discovery must not raise a raw AttributeError before anything is scored
    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200, json=readyz)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [{"logprobs": [-1.0]}]})

    with ScoreClient(BASE, transport=httpx.MockTransport(server), encoding="json") as client:
        assert client.score([[1, 2]])[0].logprobs.tolist() == [-1.0]
        client.ready()
    assert not client._p.limits_known


def _short_answer(drop: str):
    """A 200 in the contract's shape whose results are out of step with the request's sequences."""
    import json

    def answer(request: httpx.Request) -> httpx.Response:
        if request.method != "POST":  # the client's look at /readyz for the limits
            return httpx.Response(404)
        sequences = json.loads(request.content)["sequences"]
        results = [{"id": s.get("id"), "logprobs": [-1.0] * (len(s["input_ids"]) - s.get("score_from", 1))}
                   for s in sequences]
        if drop == "result":
            results = results[:-1]
        else:
            results[-1]["logprobs"] = results[-1]["logprobs"][:-1]
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": results,
                                         "usage": {"input_tokens": 0, "scored_tokens": 0}})
    return answer


@pytest.mark.parametrize("drop,why", [("result", "2 results for 3 sequences"),
                                      ("position", "result 2 holds 3 log-probs for 4 scored positions")])
def test_results_out_of_step_with_the_sequences_raise_score_error(drop, why):
    # silently shorter results would pair one trajectory's scores with another's in a trainer's batch
    sequences = [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]]
    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(_short_answer(drop))) as client:
        with pytest.raises(ScoreError) as caught:
            client.score(sequences)
    e = caught.value
    assert (e.status, e.type) == (200, "invalid_response") and why in e.message, e

    async def main():
        async with AsyncScoreClient(BASE, encoding="json", transport=httpx.MockTransport(_short_answer(drop))) as client:
            with pytest.raises(ScoreError) as caught:
                await client.score(sequences)
        return caught.value

    assert str(asyncio.run(main())) == str(e)


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateways_page_for_an_update_says_it_may_have_run_and_is_not_sent_again(status):
    # an ingress whose read timeout is shorter than a checkpoint's load gives up while the server loads on
    sent = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(status, text="<html><body>An error occurred.</body></html>",
                              headers={"content-type": "text/html"})

    with ScoreClient(BASE, transport=httpx.MockTransport(gateway), connect_retry_s=0.5) as client:
        with pytest.raises(ScoreError) as caught:
            client.update_weights("policy", "step-1")
    e = caught.value
    assert (e.status, e.type) == (status, "http_error") and "An error occurred." in e.message, e
    assert "the update may have run: /v1/models names the version served" in e.message, e
    assert sent == ["/v1/weights"], sent

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(gateway), connect_retry_s=0.5) as client:
            with pytest.raises(ScoreError) as caught:
                await client.update_weights("policy", "step-1")
        return caught.value

    assert str(asyncio.run(main())) == str(e)
