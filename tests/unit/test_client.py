"""The Python client against the app in-process (fake backend): splitting, retries, encodings."""

import asyncio
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from model_runtime.types import SequenceInput
from service.client import AsyncScoreClient, Limits, ScoreError, _as_seq, _Protocol, _retry_after
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, expected_scores, running_app, wait_until

BASE = "http://packscore.test"


def test_the_client_imports_no_torch():
    code = "import sys, service.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _protocol(**knobs):
    return _Protocol(BASE, None, "msgpack", 10.0, knobs.get("seqs"), knobs.get("tokens"), knobs.get("bytes"))


def test_chunks_respect_every_limit_and_keep_order():
    p = _protocol(seqs=3, tokens=100, bytes=10_000)
    seqs = [_as_seq(np.ones(n, dtype=np.int64)) for n in (10, 20, 30, 40, 150, 5, 5, 5, 5)]
    parts = p.chunks(seqs, parallel=1)
    assert [i for part in parts for i in part] == list(range(len(seqs)))
    for part in parts:
        tokens = sum(seqs[i].ids.size for i in part)
        assert len(part) <= 3 and (tokens <= 100 or len(part) == 1)
    assert [4] in parts  # longer than the token share: alone


def test_limits_learned_from_headers_are_capped_by_knobs():
    p = _protocol(seqs=10)
    p.learn(httpx.Headers({"X-Packscore-Max-Sequences-Per-Request": "64", "X-Packscore-Max-Request-Tokens": "5000",
                           "X-Packscore-Max-Request-Bytes": "100000"}))
    assert p.limits == Limits(max_sequences_per_request=10, max_request_tokens=5000, max_request_bytes=100000)
    assert p.limits_known


def test_inputs_are_checked_before_sending():
    with pytest.raises(ValueError, match="2\\*\\*31"):
        _as_seq([1, 2**40])  # would wrap around in int32
    with pytest.raises(TypeError):
        _as_seq([1.5, 2.0])
    seq = _as_seq({"input_ids": [1, 2, 3], "score_from": 2, "id": "x"})
    assert (seq.score_from, seq.id, seq.ids.tolist()) == (2, "x", [1, 2, 3])


def test_retry_after_prefers_the_header():
    response = httpx.Response(429, headers={"Retry-After": "3"})
    assert _retry_after(response, attempt=0) == 3.0
    assert 0 < _retry_after(httpx.Response(503), attempt=2) <= 10


def _expected(seq, **options):
    return expected_scores(SequenceInput(np.asarray(seq["input_ids"]), seq.get("score_from", 1), **options))


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_async_client_splits_a_huge_batch_under_the_server_limits(encoding):
    rng = np.random.default_rng(0)
    seqs = [{"id": f"s{i}", "input_ids": rng.integers(0, 1000, rng.integers(2, 40)), "score_from": 2}
            for i in range(200)]

    async def main():
        backend = FakeBackend()
        settings = Settings(max_sequences_per_request=16, max_queued_tokens=400, max_batch_tokens=100)
        app = create_app(settings, backend)
        async with running_app(app):
            transport = httpx.ASGITransport(app=app)
            async with AsyncScoreClient(BASE, encoding=encoding, transport=transport) as client:
                out = await client.score(seqs, top_k=2, temperature=0.5)
                return out, client.limits

    out, limits = asyncio.run(main())
    assert limits.max_sequences_per_request == 16 and limits.max_request_tokens == 400
    assert [r.id for r in out] == [s["id"] for s in seqs]
    for seq, got in zip(seqs, out):
        want = _expected(seq, temperature=0.5, top_k=2)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.entropy, want.entropy)
        np.testing.assert_array_equal(got.top_k_ids, want.top_k_ids)
        assert got.logprobs.dtype == np.float32 and got.top_k_ids.dtype == np.int32
        assert got.model == "fake-model" and got.weights_version == "fake#1"


def test_async_client_resplits_on_413_when_its_knobs_exceed_the_server():
    seqs = [{"input_ids": [1, 2, 3]} for _ in range(40)]

    async def main():
        app = create_app(Settings(max_sequences_per_request=8), FakeBackend())
        async with running_app(app):
            transport = httpx.ASGITransport(app=app)
            client = AsyncScoreClient(BASE, transport=transport, max_sequences_per_request=100)
            client._p.limits_known = True  # skip discovery: the first request is too big for the server
            client._p.limits = Limits(100, 10_000, 1 << 20)
            out = await client.score(seqs, return_entropy=False)
            await client.aclose()
            return out, client.limits

    out, limits = asyncio.run(main())
    assert len(out) == 40 and all(r.entropy is None for r in out)
    assert limits.max_sequences_per_request == 8


def test_async_client_retries_429_until_admitted():
    async def main():
        gate = threading.Event()
        backend = FakeBackend()
        app = create_app(Settings(max_queued_tokens=10, max_batch_tokens=10, max_wait_ms=0), backend)
        async with running_app(app) as raw:
            backend.gate = gate
            blocker = asyncio.ensure_future(raw.post("/score", json={"sequences": [{"input_ids": [1] * 10}]}))
            await wait_until(lambda: app.state.service.scheduler.queued_tokens == 10)
            client = AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app), retry_timeout_s=20)
            pending = asyncio.ensure_future(client.score([[5, 6, 7]]))
            await wait_until(lambda: app.state.service.metrics.rejections.labels(reason="queue_full")._value.get() >= 1)
            gate.set()
            out = await pending
            await blocker
            await client.aclose()
            return out

    (result,) = asyncio.run(main())
    np.testing.assert_array_equal(result.logprobs, _expected({"input_ids": [5, 6, 7]}).logprobs)


def test_async_client_gives_up_after_its_time_bound_and_raises_errors_as_score_error():
    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app):
            app.state.service.begin_drain()  # every /score now answers 503 with Retry-After: 1
            client = AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app), retry_timeout_s=0.5)
            client._p.limits_known = True
            with pytest.raises(ScoreError) as drained:
                await client.score([[1, 2]])
            await client.aclose()
        app = create_app(Settings(), FakeBackend(vocab_size=10))
        async with running_app(app):
            client = AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app))
            with pytest.raises(ScoreError) as invalid:
                await client.score([[1, 2, 30]])
            await client.aclose()
        return drained.value, invalid.value

    drained, invalid = asyncio.run(main())
    assert drained.status == 503 and drained.type == "draining"
    assert (invalid.status, invalid.type, invalid.param) == (422, "invalid_value", "sequences[0].input_ids[2]")
