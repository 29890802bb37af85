"""The wait for a weight update's answer: ``update_timeout_s`` (default the larger of ``timeout_s`` and
UPDATE_TIMEOUT_S) or the call's ``timeout_s=``, in both clients and every per-address client of
``update_weights_everywhere``; checked before anything is sent. tests/e2e/test_e2e_client_update_timeout.py
has the real server."""

import asyncio
import inspect
import math
import socket

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient
from packscore_client.base import UPDATE_TIMEOUT_S
from tests.resolving import resolving

BASE = "http://packscore.test"
NAME = "scorer-pods.rl.svc"


class Seen:
    """A MockTransport that answers /score and /v1/weights and notes each request's read timeout."""

    def __init__(self):
        self.reads: list[tuple[str, float]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.reads.append((request.url.path, request.extensions["timeout"]["read"]))
        if request.url.path == "/v1/weights":
            return httpx.Response(200, json={"model": "policy", "weights_version": "v1", "previous_version": "v0",
                                             "load_s": 0.1, "swap_ms": 1.0})
        return httpx.Response(200, json={"data": [{"id": "policy", "weights_version": "v1"}]})


@pytest.mark.parametrize("knobs,want", [
    (dict(timeout_s=30.0), UPDATE_TIMEOUT_S),  # a short scoring timeout leaves updates their own bound
    (dict(timeout_s=2 * UPDATE_TIMEOUT_S), 2 * UPDATE_TIMEOUT_S),  # never shorter than timeout_s by default
    (dict(timeout_s=30.0, update_timeout_s=120), 120.0),
])
def test_an_update_waits_update_timeout_s_and_other_requests_timeout_s(knobs, want, monkeypatch):
    resolving(monkeypatch, NAME, "10.0.0.7", "10.0.0.8")
    seen = Seen()
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(seen), **knobs) as client:
        client.models()
        client.update_weights("policy", "step-1")
        client.update_weights("policy", "step-1", timeout_s=7)
        client.update_weights_everywhere("policy", "step-1")
        client.update_weights_everywhere("policy", "step-1", timeout_s=9.5)
    assert seen.reads == [("/v1/models", 5.0), ("/v1/weights", want), ("/v1/weights", 7.0),
                          *[("/v1/weights", want)] * 2, *[("/v1/weights", 9.5)] * 2], seen.reads

    async def main():
        async with AsyncScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(seen), **knobs) as client:
            await client.update_weights("policy", "step-1")
            await client.update_weights("policy", "step-1", timeout_s=7)
            await client.update_weights_everywhere("policy", "step-1")
            await client.update_weights_everywhere("policy", "step-1", timeout_s=9.5)

    seen.reads.clear()
    asyncio.run(main())
    assert seen.reads == [("/v1/weights", want), ("/v1/weights", 7.0),
                          *[("/v1/weights", want)] * 2, *[("/v1/weights", 9.5)] * 2], seen.reads


BAD = [("30", TypeError, "a number of seconds"), (True, TypeError, "a number of seconds"),
       (0, ValueError, "finite and > 0"), (-1.0, ValueError, "finite and > 0"),
       (math.nan, ValueError, "finite and > 0"), (math.inf, ValueError, "finite and > 0")]


@pytest.mark.parametrize("value,kind,why", BAD, ids=[repr(v) for v, _, _ in BAD])
def test_a_bound_that_is_not_a_positive_number_of_seconds_is_refused_before_sending(value, kind, why, monkeypatch):
    def nothing_sent(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"{request.url.path} was sent")

    def resolved(*args, **kw):
        raise AssertionError("the name was resolved")

    with pytest.raises(kind, match=f"update_timeout_s must be {why}"):
        ScoreClient(BASE, update_timeout_s=value)
    monkeypatch.setattr(socket, "getaddrinfo", resolved)
    with ScoreClient(BASE, transport=httpx.MockTransport(nothing_sent)) as client:
        with pytest.raises(kind, match=f"^timeout_s must be {why}"):
            client.update_weights("policy", "step-1", timeout_s=value)
        with pytest.raises(kind, match=f"^timeout_s must be {why}"):
            client.update_weights_everywhere("policy", "step-1", timeout_s=value)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(nothing_sent)) as client:
            with pytest.raises(kind, match=f"^timeout_s must be {why}"):
                await client.update_weights("policy", "step-1", timeout_s=value)
            with pytest.raises(kind, match=f"^timeout_s must be {why}"):
                await client.update_weights_everywhere("policy", "step-1", timeout_s=value)

    asyncio.run(main())


OLDER = [("timeout_s", "30", TypeError, "a number of seconds"), ("timeout_s", 0, ValueError, "finite and > 0"),
         ("timeout_s", math.nan, ValueError, "finite and > 0"), ("retry_timeout_s", -1, ValueError, "finite and >= 0"),
         ("retry_timeout_s", math.inf, ValueError, "finite and >= 0"), ("connect_retry_s", None, TypeError,
                                                                        "a number of seconds"),
         ("connect_retry_s", -0.5, ValueError, "finite and >= 0"), ("max_concurrency", 0, ValueError, "an int of at least 1"),
         ("max_concurrency", 2.5, ValueError, "an int of at least 1"),
         # a split cap of 0 meant no cap, -1 or True one sequence a request, 2.5 three; "3" failed comparing
         *[(knob, value, ValueError, "an int of at least 1 or None") for knob in
           ("max_sequences_per_request", "max_request_tokens", "max_request_bytes") for value in (0, -1, 2.5, True, "3")]]


@pytest.mark.parametrize("knob,value,kind,why", OLDER, ids=[f"{k}={v!r}" for k, v, _, _ in OLDER])
def test_the_other_bounds_are_checked_when_the_client_is_built(knob, value, kind, why):
    # a NaN timeout or a negative retry budget failed at the first call, or retried forever
    for cls in (ScoreClient, AsyncScoreClient):
        with pytest.raises(kind, match=f"^{knob} must be {why}"):
            cls(BASE, **{knob: value})
    for zero in ("retry_timeout_s", "connect_retry_s"):  # 0: no retry at all, as before
        ScoreClient(BASE, **{zero: 0}).close()


def test_a_split_cap_read_from_a_config_as_a_numpy_int_is_taken_as_an_int():
    with ScoreClient(BASE, max_sequences_per_request=np.int64(3), max_request_tokens=None) as client:
        assert client.limits.max_sequences_per_request == 3 and type(client.limits.max_sequences_per_request) is int


def test_both_clients_take_the_same_update_arguments():
    for method in ("update_weights", "update_weights_everywhere"):
        blocking, awaited = (inspect.signature(getattr(c, method)) for c in (ScoreClient, AsyncScoreClient))
        assert blocking == awaited, (method, blocking, awaited)
