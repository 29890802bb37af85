"""The Python client against the app in-process (fake backend): splitting, retries, encodings."""

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from model_runtime.types import SequenceInput
from packscore_client import AsyncScoreClient, Limits, ScoreClient, ScoreError
from packscore_client.protocol import Protocol, as_seq, retry_after
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, expected_scores, running_app, wait_until

BASE = "http://packscore.test"


def test_the_client_imports_no_torch():
    code = "import sys, packscore_client, service.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _protocol(**knobs):
    return Protocol(BASE, None, "msgpack", 10.0, knobs.get("seqs"), knobs.get("tokens"), knobs.get("bytes"))


def test_chunks_respect_every_limit_and_keep_order():
    p = _protocol(seqs=3, tokens=100, bytes=10_000)
    seqs = [as_seq(np.ones(n, dtype=np.int64)) for n in (10, 20, 30, 40, 150, 5, 5, 5, 5)]
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
        as_seq([1, 2**40])  # would wrap around in int32
    with pytest.raises(TypeError):
        as_seq([1.5, 2.0])
    seq = as_seq({"input_ids": [1, 2, 3], "score_from": 2, "id": "x"})
    assert (seq.score_from, seq.id, seq.ids.tolist()) == (2, "x", [1, 2, 3])


def test_retry_after_prefers_the_header():
    response = httpx.Response(429, headers={"Retry-After": "3"})
    assert retry_after(response, attempt=0) == 3.0
    assert 0 < retry_after(httpx.Response(503), attempt=2) <= 10


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

    sent = []

    class Counted(httpx.ASGITransport):
        async def handle_async_request(self, request):
            sent.append(request.url.path)
            return await super().handle_async_request(request)

    async def main():
        app = create_app(Settings(max_sequences_per_request=8), FakeBackend())
        async with running_app(app):
            client = AsyncScoreClient(BASE, transport=Counted(app=app), max_sequences_per_request=100)
            client._p.limits_known = True  # skip discovery: the first request is too big for the server
            client._p.limits = Limits(100, 10_000, 1 << 20)
            out = await client.score(seqs, return_entropy=False)
            await client.aclose()
            return out, client.limits

    out, limits = asyncio.run(main())
    assert len(out) == 40 and all(r.entropy is None for r in out)
    assert limits.max_sequences_per_request == 8
    assert sent.count("/score") == 1 + 5, f"{sent.count('/score')} requests: the 413, then 40 / 8 parts"


@pytest.mark.parametrize("split_by", ["client", "server"])
def test_an_error_names_the_sequence_by_its_place_in_the_callers_list(split_by):
    """The client splits a batch into requests (by its limits, or halves after a 413); the server
    numbers each request's sequences from 0, the error raised numbers the caller's list."""
    seqs = [{"input_ids": [1, 2, 3]} for _ in range(10)] + [{"input_ids": [1, 30, 2]}]

    async def main():
        app = create_app(Settings(max_sequences_per_request=8), FakeBackend(vocab_size=10))
        async with running_app(app):
            knobs = {"max_sequences_per_request": 100} if split_by == "server" else {}
            client = AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app), **knobs)
            if split_by == "server":
                client._p.limits_known = True  # the first request is too big for the server: 413, halves
                client._p.limits = Limits(100, 10_000, 1 << 20)
            with pytest.raises(ScoreError) as caught:
                await client.score(seqs)
            await client.aclose()
        return caught.value

    error = asyncio.run(main())
    assert (error.status, error.param) == (422, "sequences[10].input_ids[1]"), error


def test_async_client_retries_429_until_admitted():
    async def main():
        gate = threading.Event()
        backend = FakeBackend()
        app = create_app(Settings(max_queued_tokens=10, max_batch_tokens=10, max_wait_ms=0, max_admission_wait_s=0), backend)
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


def _padded_batch(rng, vocab=1000):
    """Four rows as verl / OpenRLHF pad them: left-padded prompts, right-padded responses, one row
    with a hole in its response mask and one with no response at all."""
    prompts, responses = [5, 1, 3, 2], [4, 6, 1, 0]
    P, R = max(prompts), max(responses)
    ids = np.full((4, P + R), 999_999, dtype=np.int64)  # pads hold an id the server would refuse
    attn = np.zeros((4, P + R), dtype=np.int64)
    resp = np.zeros((4, R), dtype=np.int64)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, P - p : P + r] = rng.integers(0, vocab, p + r)
        attn[b, P - p : P + r] = 1
        resp[b, :r] = 1
    resp[1, 2] = 0  # a masked-out token inside a response (a tool's output, say)
    return ids, attn, resp, prompts, responses


def test_score_padded_sends_no_pad_and_aligns_the_answers_with_the_response_mask():
    rng = np.random.default_rng(3)
    ids, attn, resp, prompts, responses = _padded_batch(rng)
    P = max(prompts)

    async def main():
        backend = FakeBackend()
        app = create_app(Settings(), backend)
        async with running_app(app):
            backend.rows.clear()  # the readiness pass's row
            async with AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app)) as client:
                full = await client.score_padded(ids, attn, np.concatenate([np.zeros_like(attn[:, :P]), resp], 1))
                tail = await client.score_padded(ids, attn, resp, temperature=0.5, return_entropy=False)
        return full, tail, backend.rows

    full, tail, rows = asyncio.run(main())
    assert full.logprobs.shape == ids.shape and tail.logprobs.shape == resp.shape
    assert full.logprobs.dtype == np.float32 and full.entropy.dtype == np.float32 and tail.entropy is None
    # Each row went alone as its real tokens up to its last response token: no pad was ever sent.
    assert sorted(n for row in rows for n in row) == sorted([p + r for p, r in zip(prompts, responses) if r] * 2)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        real = ids[b, P - p : P + r]
        if r == 0:
            assert not full.logprobs[b].any() and not tail.logprobs[b].any()
            continue
        want = _expected({"input_ids": real, "score_from": p})
        want_cold = _expected({"input_ids": real, "score_from": p}, temperature=0.5, return_entropy=False)
        mask = resp[b, :r].astype(bool)
        np.testing.assert_array_equal(full.logprobs[b, P : P + r], np.where(mask, want.logprobs, 0))
        np.testing.assert_array_equal(full.entropy[b, P : P + r], np.where(mask, want.entropy, 0))
        np.testing.assert_array_equal(tail.logprobs[b, :r], np.where(mask, want_cold.logprobs, 0))
    assert not full.logprobs[:, :P].any() and not tail.logprobs[resp == 0].any()
    assert full.model == "fake-model" and full.weights_version == "fake#1"


def test_padded_input_is_refused_with_the_reason():
    rng = np.random.default_rng(0)
    ids, attn, resp, _, _ = _padded_batch(rng)
    client = ScoreClient(BASE)
    with pytest.raises(TypeError, match="pad tokens.*score_padded"):
        client.score(ids)  # a 2-D batch: its rows hold pads
    bad_attn = attn.copy()
    bad_attn[0, 2] = 0  # a hole inside the real tokens
    with pytest.raises(ValueError, match="row 0: attention_mask is not one contiguous run"):
        client.score_padded(ids, bad_attn, resp)
    bad_resp = resp.copy()
    bad_resp[0, 5] = 1  # past row 0's last real token
    with pytest.raises(ValueError, match="row 0: response_mask marks column 10 .* padding"):
        client.score_padded(ids, attn, bad_resp)
    whole = np.concatenate([attn[:, :5], resp], 1)  # row 0's first real token marked as response
    whole[0, 0] = 1
    with pytest.raises(ValueError, match="row 0: its first real token"):
        client.score_padded(ids, attn, whole)
    with pytest.raises(ValueError, match="response_mask must be"):
        client.score_padded(ids, attn, np.ones((4, 20)))
    client.close()


def test_an_unreachable_server_fails_fast_with_a_log_line_per_retry(caplog):
    from tests.ports import held_port

    with held_port() as port:  # nothing listens there
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="packscore_client"):
            with ScoreClient(url, connect_retry_s=1.5) as client, pytest.raises(ScoreError) as failed:
                client.score([[1, 2, 3]])
    elapsed = time.monotonic() - started
    assert failed.value.status == 0 and failed.value.type == "connection_error" and url in str(failed.value)
    assert elapsed < 1.5 + 5, f"took {elapsed:.1f}s to give up with connect_retry_s=1.5"
    retries = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert retries and all(url in m for m in retries), caplog.text


def test_the_blocking_client_retries_503_then_scores_through_the_same_exchange():
    answers = [httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"type": "not_ready", "message": "x"}}),
               httpx.Response(200, json={"model": "m", "weights_version": "v",
                                         "results": [{"id": None, "logprobs": [-1.5, -0.25]}]})]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(404) if request.url.path == "/readyz" else answers.pop(0)

    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
        (result,) = client.score([[1, 2, 3]], return_entropy=False)
    assert seen == ["/readyz", "/score", "/score"]
    np.testing.assert_array_equal(result.logprobs, np.array([-1.5, -0.25], np.float32))


def test_a_weights_update_refused_for_now_is_sent_again_after_retry_after():
    """503 (the pool restarting, no memory now) changes nothing on the server: the client waits
    Retry-After and sends the same update again, as it does for /score."""
    answers = [httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"type": "unavailable", "message": "x"}}),
               httpx.Response(200, json={"model": "m", "weights_version": "step-2", "previous_version": "step-1",
                                         "load_s": 1.0, "swap_ms": 2.0})]
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append((request.url.path, request.content))
        return answers.pop(0)

    with ScoreClient(BASE, transport=httpx.MockTransport(handler)) as client:
        update = client.update_weights("m", "step-2", version="step-2")
    assert update.weights_version == "step-2" and update.previous_version == "step-1"
    assert [p for p, _ in bodies] == ["/v1/weights"] * 2 and bodies[0][1] == bodies[1][1]


def test_a_weights_update_to_no_server_is_a_connection_error():
    from tests.ports import held_port

    with held_port() as port:  # nothing listens there
        with ScoreClient(f"http://127.0.0.1:{port}", connect_retry_s=0.5) as client, pytest.raises(ScoreError) as failed:
            client.update_weights(None, "step-1")
    assert failed.value.status == 0 and failed.value.type == "connection_error", failed.value


def test_deadline_ms_bounds_the_whole_call_not_each_retry():
    """A server answering 429 with Retry-After 1 s: a 500 ms deadline ends the call as 504 at
    once instead of retrying until retry_timeout_s; each attempt asks for what is left."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        sent.append(json.loads(request.content)["deadline_ms"])
        return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"type": "queue_full", "message": "x"}})

    started = time.monotonic()
    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler), retry_timeout_s=30) as client:
        with pytest.raises(ScoreError) as failed:
            client.score([[1, 2, 3]], deadline_ms=500)
    assert failed.value.status == 504 and failed.value.param == "deadline_ms", failed.value
    assert time.monotonic() - started < 2 and len(sent) == 1 and 0 < sent[0] <= 500, (sent, time.monotonic() - started)


def test_a_failed_part_stops_the_others_before_the_caller_wakes(monkeypatch):
    """The part that fails stops the rest itself: a caller's thread slow to wake and raise (a busy
    host) leaves no window in which a free worker sends the next part."""
    from packscore_client import clients

    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        body = json.loads(request.content)
        sent.append(body["sequences"][0]["input_ids"])
        if max(body["sequences"][0]["input_ids"]) >= 900:
            return httpx.Response(422, json={"error": {"type": "invalid_value", "message": "x", "param": "sequences[0]"}})
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [0.0] * (len(s["input_ids"]) - 1)} for s in body["sequences"]]})

    real_wait = clients.wait

    def slow_to_wake(*args, **kwargs):
        out = real_wait(*args, **kwargs)
        time.sleep(0.3)  # the caller's thread descheduled after the failure
        return out

    monkeypatch.setattr(clients, "wait", slow_to_wake)
    batch = [[1, 2, 999]] + [[1, 2, 3]] * 6
    with ScoreClient(BASE, transport=httpx.MockTransport(handler), encoding="json", max_sequences_per_request=1,
                     max_concurrency=1) as client:
        with pytest.raises(ScoreError):
            client.score(batch, return_entropy=False)
    assert sent == [[1, 2, 999]], f"parts sent after the first one failed: {sent[1:]}"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_failed_call_sends_none_of_its_other_parts_afterwards(blocking):
    """A part refused (422): the call raises, and no part is sent after that. One exception, on a
    thread pool: a worker that began to send before the failure came back may reach the wire just
    after the raise (the width of a thread switch); the failing part's own worker never does."""
    sent, raised_at, failed_on = [], [], []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        body = json.loads(request.content)
        if any(max(s["input_ids"]) >= 900 for s in body["sequences"]):
            failed_on.append(threading.get_ident())
            return httpx.Response(422, json={"error": {"type": "invalid_value", "message": "x", "param": "sequences[0]"}})
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [0.0] * (len(s["input_ids"]) - 1)} for s in body["sequences"]]})

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((time.monotonic(), threading.get_ident()))  # when it was sent, by which worker
        time.sleep(0.05)
        return answer(request)

    async def async_handler(request: httpx.Request) -> httpx.Response:
        sent.append((time.monotonic(), None))
        await asyncio.sleep(0.05)  # gives the event loop back, as a real round trip does
        return answer(request)

    batch = [[1, 2, 3]] * 3 + [[1, 2, 999]] + [[1, 2, 3]] * 40  # a later part fails, not the first
    knobs = dict(encoding="json", max_sequences_per_request=1, max_concurrency=2)
    if blocking:
        with ScoreClient(BASE, transport=httpx.MockTransport(handler), **knobs) as client:
            with pytest.raises(ScoreError):
                client.score(batch, return_entropy=False)
            raised_at.append(time.monotonic())
            time.sleep(0.3)
    else:
        async def main():
            async with AsyncScoreClient(BASE, transport=httpx.MockTransport(async_handler), **knobs) as client:
                with pytest.raises(ScoreError):
                    await client.score(batch, return_entropy=False)
                raised_at.append(time.monotonic())
                await asyncio.sleep(0.3)

        asyncio.run(main())
    late = [who for when, who in sent if when > raised_at[0]]
    # the failing worker stops the call itself, so it never takes the next part (an event loop: none is late)
    allowed = knobs["max_concurrency"] - 1 if blocking else 0
    assert len(late) <= allowed and failed_on[0] not in late and len(sent) < 10, \
        f"{len(sent)} parts sent, {len(late)} after the call raised ({late.count(failed_on[0])} by the failing worker)"


def test_a_padded_batch_split_across_a_weight_update_is_scored_by_one_version(tmp_path):
    """A padded batch split into parts, an update landing between them: the client scores the
    rows of the old version again with the new one, so PaddedScores.weights_version is true of
    every row; weights_version= pins it."""
    backend = FakeBackend()
    app = create_app(Settings(max_sequences_per_request=2), backend)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 900, (8, 12))
    attn, resp = np.ones((8, 12), np.int64), np.ones((8, 4), np.int64)
    step = tmp_path / "step-2"
    step.mkdir()

    class UpdateAfterSecondPart(httpx.ASGITransport):
        parts = 0

        async def handle_async_request(self, request):
            response = await super().handle_async_request(request)
            if request.url.path == "/score":
                UpdateAfterSecondPart.parts += 1
                if UpdateAfterSecondPart.parts == 2:
                    await asyncio.to_thread(backend.update_weights, step, "v2")
            return response

    async def scenario():
        async with running_app(app):
            transport = UpdateAfterSecondPart(app=app)
            async with AsyncScoreClient(BASE, transport=transport, encoding="json", max_concurrency=1) as client:
                scores = await client.score_padded(ids, attn, resp)
                with pytest.raises(ScoreError) as pinned:
                    await client.score_padded(ids, attn, resp, weights_version="v1-gone")
                alone = [await client.score([{"input_ids": row, "score_from": 8}]) for row in ids]
            return scores, pinned.value, alone

    scores, pinned, alone = asyncio.run(scenario())
    assert scores.weights_version == "v2", scores.weights_version
    assert pinned.status == 409 and pinned.type == "weights_version_mismatch", pinned
    for b, (result,) in enumerate(alone):  # every row holds the new version's numbers
        np.testing.assert_array_equal(scores.logprobs[b], result.logprobs, err_msg=f"row {b}")


def test_a_padded_batch_error_names_the_place_in_the_callers_arrays():
    """The server names the sent row's field; the caller holds [B, T] arrays: row 2, column 7."""
    ids = np.full((4, 10), 5)
    ids[2, 7] = 10**6  # outside the vocabulary
    attn = np.ones((4, 10), np.int64)
    attn[2, :3] = 0  # left padding: the sent row starts at column 3
    resp = np.zeros((4, 4), np.int64)
    resp[[0, 2, 3], :] = 1  # row 1 has no response: not sent, so row 2 is the second sent

    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as http:
            async with AsyncScoreClient(BASE, transport=http._transport, encoding="json") as client:
                with pytest.raises(ScoreError) as failed:
                    await client.score_padded(ids, attn, resp)
        return failed.value

    error = asyncio.run(main())
    assert error.status == 422 and error.param == "input_ids[2, 7]", error


def test_a_deadline_already_spent_is_one_attempt_the_server_judges():
    """deadline_ms 0 or less goes to the server as given, once: no retry can be answered in time."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        sent.append(json.loads(request.content)["deadline_ms"])
        return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"type": "not_ready", "message": "x"}})

    for given in (0, -5):
        sent.clear()
        with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
            with pytest.raises(ScoreError) as failed:
                client.score([[1, 2, 3]], deadline_ms=given)
        assert sent == [given] and failed.value.status == 503, (given, sent, failed.value)


def test_a_request_not_sent_whole_is_sent_again():
    tries = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        tries.append(1)
        if len(tries) == 1:
            raise httpx.WriteError("the connection broke while the body was written", request=request)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [{"id": None, "logprobs": [0.5, 0.5]}]})

    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler)) as client:
        (result,) = client.score([[1, 2, 3]], return_entropy=False)
    assert len(tries) == 2 and result.logprobs.tolist() == [0.5, 0.5]


def test_writes_that_keep_failing_are_named_as_such_not_as_a_server_not_reached():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        raise httpx.WriteTimeout("the body did not leave", request=request)

    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(handler), connect_retry_s=0.2) as client:
        with pytest.raises(ScoreError) as failed:
            client.score([[1, 2, 3]])
    assert failed.value.type == "connection_error", failed.value
    assert f"could not send the request whole to {BASE}" in failed.value.message, failed.value


def test_a_padded_row_is_named_by_its_place_before_and_after_sending():
    ids, attn = np.full((3, 10), 5), np.ones((3, 10), np.int64)
    resp = np.ones((3, 4), np.int64)
    ids[1, 2] = -1
    with ScoreClient(BASE, transport=httpx.MockTransport(lambda r: httpx.Response(404))) as client:
        with pytest.raises(ValueError, match=r"input_ids\[1, 2\]"):
            client.score_padded(ids, attn, resp)

    async def main():  # a row longer than the server takes: 413 naming the row, as the caller holds it
        app = create_app(Settings(max_model_len=8), FakeBackend())
        async with running_app(app) as http:
            async with AsyncScoreClient(BASE, transport=http._transport, encoding="json") as client:
                with pytest.raises(ScoreError) as failed:
                    await client.score_padded(np.full((3, 10), 5), np.ones((3, 10)), np.r_[[[0] * 4], [[1] * 4], [[1] * 4]])
        return failed.value

    error = asyncio.run(main())
    assert error.status == 413 and error.param == "input_ids[1]" and "Row 1" in error.message, error

