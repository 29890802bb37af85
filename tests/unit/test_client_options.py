"""A call's options are checked before anything is sent: a cast would turn what the server refuses
(422) into another request, top_k=2.5 into top_k=2 and return_entropy="no" into True."""

import asyncio
import inspect
import json

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient

BASE = "http://packscore.test"
IDS = np.array([[5, 6, 7, 8]])
ATTN = np.ones((1, 4), np.int64)
RESP = np.array([[0, 1, 1]])


def _nothing_sent(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"{request.url.path} was sent, though the options were refused before sending")


BAD = [
    (dict(top_k=2.5), r"top_k must be an int, got 2\.5"),
    (dict(top_k=True), r"top_k must be an int, got True"),
    (dict(top_k="3"), r"top_k must be an int, got '3'"),
    (dict(return_entropy="no"), r"return_entropy must be True or False, got 'no'"),
    (dict(temperature=True), r"temperature must be a number, got True"),
    (dict(temperature="1.0"), r"temperature must be a number, got '1\.0'"),
    (dict(deadline_ms="500"), r"deadline_ms must be a number of milliseconds or None, got '500'"),
    (dict(model=1), r"model must be a str or None, got 1"),
    (dict(weights_version=7), r"weights_version must be a str or None, got 7"),
]


@pytest.mark.parametrize("kw,named", BAD, ids=[str(kw) for kw, _ in BAD])
def test_an_option_the_server_would_refuse_is_refused_before_sending(kw, named):
    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        with pytest.raises(TypeError, match=named):
            client.score([[1, 2, 3]], **kw)
        padded = {k: v for k, v in kw.items() if k != "top_k"}
        if padded:  # also when no row has a response token, so nothing would be sent anyway
            with pytest.raises(TypeError, match=named):
                client.score_padded(IDS, ATTN, RESP, **padded)
            with pytest.raises(TypeError, match=named):
                client.score_padded(IDS, ATTN, np.zeros_like(RESP), **padded)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
            with pytest.raises(TypeError, match=named):
                await client.score([[1, 2, 3]], **kw)
            if padded:
                with pytest.raises(TypeError, match=named):
                    await client.score_padded(IDS, ATTN, RESP, **padded)

    asyncio.run(main())


@pytest.mark.parametrize("deadline_ms", [float("inf"), float("nan"), 1e30, 2**64])
def test_a_deadline_that_is_not_finite_or_past_the_servers_bound_is_refused_naming_it(deadline_ms):
    # inf meant as "no deadline" raised OverflowError and NaN ValueError from a cast, naming nothing;
    # 1e30 failed msgpack's packing (OverflowError) or came back as the server's 422
    named = r"deadline_ms must be finite and below 2\*\*64 \(None: no deadline\)"
    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        with pytest.raises(ValueError, match=named):
            client.score([[1, 2, 3]], deadline_ms=deadline_ms)
        with pytest.raises(ValueError, match=named):
            client.score_padded(IDS, ATTN, RESP, deadline_ms=deadline_ms)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
            with pytest.raises(ValueError, match=named):
                await client.score([[1, 2, 3]], deadline_ms=deadline_ms)
            with pytest.raises(ValueError, match=named):
                await client.score_padded(IDS, ATTN, RESP, deadline_ms=deadline_ms)

    asyncio.run(main())


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_numpy_options_are_sent_as_plain_numbers(encoding):
    """A trainer's config often holds numpy scalars; a deadline of 0 or less is sent as given."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"status": "ready", "limits": {}})
        import msgpack
        sent.append(json.loads(request.content) if encoding == "json" else msgpack.unpackb(request.content))
        return httpx.Response(504, json={"error": {"type": "deadline_exceeded", "message": "late", "param": None}})

    with ScoreClient(BASE, transport=httpx.MockTransport(handler), encoding=encoding) as client:
        with pytest.raises(Exception, match="deadline_exceeded"):
            client.score([[1, 2, 3]], top_k=np.int64(2), temperature=np.float32(0.5), return_entropy=np.bool_(False),
                         deadline_ms=np.int64(0))
    assert len(sent) == 1, sent
    body = sent[0]
    assert (body["top_k"], body["temperature"], body["return_entropy"], body["deadline_ms"]) == (2, 0.5, False, 0), body


@pytest.mark.parametrize("method", ["score", "score_padded"])
def test_both_clients_take_the_same_options_with_the_same_defaults(method):
    """The asyncio twin's options are spelt out as the blocking client's, so its defaults cannot drift."""
    blocking, awaited = (inspect.signature(getattr(cls, method)) for cls in (ScoreClient, AsyncScoreClient))
    assert blocking == awaited, f"ScoreClient.{method}{blocking} != AsyncScoreClient.{method}{awaited}"


@pytest.mark.parametrize("cls", [ScoreClient, AsyncScoreClient], ids=lambda c: c.__name__)
def test_a_misspelt_knob_is_refused_naming_the_client_built(cls):
    """docs/client.md: a misspelt option names what the user called, not the private base class."""
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\.__init__\(\) got an unexpected keyword argument 'tmeout_s'$"):
        cls(BASE, "key", tmeout_s=30)
    cls(BASE, "key", timeout_s=30, admin_key="admin", max_concurrency=2)  # every real knob still passes


def test_a_misspelt_option_is_refused_by_the_method_called():
    """The TypeError names score() or score_padded(), as the user wrote it, not a private helper's."""
    def named(cls: str, method: str) -> str:
        return rf"^{cls}\.{method}\(\) got an unexpected keyword argument 'temprature'$"

    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        with pytest.raises(TypeError, match=named("ScoreClient", "score")):
            client.score([[1, 2, 3]], temprature=0.7)
        with pytest.raises(TypeError, match=named("ScoreClient", "score_padded")):
            client.score_padded(IDS, ATTN, RESP, temprature=0.7)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
            with pytest.raises(TypeError, match=named("AsyncScoreClient", "score")):
                await client.score([[1, 2, 3]], temprature=0.7)
            with pytest.raises(TypeError, match=named("AsyncScoreClient", "score_padded")):
                await client.score_padded(IDS, ATTN, RESP, temprature=0.7)

    asyncio.run(main())


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("deadline_ms", [2**64 - 1, 10**13], ids=["the-servers-bound", "centuries"])
def test_a_deadline_up_to_the_servers_bound_is_sent_within_it(deadline_ms, encoding):
    """A deadline_ms of centuries overflowed the blocking client's lock and wait timeouts, and one at the
    server's bound came out of a float's rounding at 2**64, past it (msgpack's OverflowError, else the server's 422)."""
    import msgpack

    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"status": "ready", "limits": {}})
        body = json.loads(request.content) if encoding == "json" else msgpack.unpackb(request.content)
        sent.append(body["deadline_ms"])
        seq = body["sequences"][0]
        ids = seq["input_ids"]
        n = (len(ids) // 4 if isinstance(ids, bytes) else len(ids)) - (seq["score_from"] or 1)  # msgpack: int32 bytes
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "usage": {},
                                         "results": [{"id": None, "logprobs": [-0.5] * n, "entropy": [0.1] * n}]})

    def transport():
        return httpx.MockTransport(handler)

    with ScoreClient(BASE, transport=transport(), encoding=encoding) as client:
        assert len(client.score([[1, 2, 3]], deadline_ms=deadline_ms)) == 1
        assert client.score_padded(IDS, ATTN, RESP, deadline_ms=deadline_ms).logprobs.shape == (1, 3)

    async def main():
        async with AsyncScoreClient(BASE, transport=transport(), encoding=encoding) as client:
            assert len(await client.score([[1, 2, 3]], deadline_ms=deadline_ms)) == 1
            assert (await client.score_padded(IDS, ATTN, RESP, deadline_ms=deadline_ms)).logprobs.shape == (1, 3)

    asyncio.run(main())
    assert len(sent) == 4 and all(0 < ms <= 2**64 - 1 for ms in sent), sent
