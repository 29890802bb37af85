"""The client names a bad sequence by its place in the caller's list, whether the client refuses it
before sending or the server refuses it after the batch was split."""

import asyncio
import inspect
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
from packscore_client.base import _Base
from packscore_client.protocol import retry_after
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

BASE = "http://packscore.test"


def _nothing_sent(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"{request.url.path} was sent, though the input was refused before sending")


@pytest.mark.parametrize("bad,error,named", [
    (np.array([1, 2**40], np.int64), ValueError, r"sequences\[1\]: token ids must be in \[0, 2\*\*31\), got 1099511627776 at input_ids\[1\]"),
    (np.array([1, 2**63 + 5], np.uint64), ValueError, r"sequences\[1\]: .* got 9223372036854775813 at input_ids\[1\]"),
    ({"ids": [1, 2]}, ValueError, r"sequences\[1\]: a sequence given as a dict needs input_ids; got the keys \['ids'\]"),
    (7, TypeError, r"sequences\[1\]: got the single token id 7, not a sequence: .*pass \[ids\]"),
    ([1.5, 2.0], TypeError, r"sequences\[1\]: input_ids must be a 1-D sequence of ints"),
    ({"input_ids": [1, 2, 3], "score_from": 1, "rollout_logprobs": ["-1.5", "-2"]}, TypeError,
     r"sequences\[1\]: rollout_logprobs must be numbers, got '-1\.5' at rollout_logprobs\[0\]"),
    ({"input_ids": [1, 2, 3], "score_from": 1, "rollout_logprobs": [-1.5, True]}, TypeError,
     r"sequences\[1\]: rollout_logprobs must be numbers, got True at rollout_logprobs\[1\]"),
], ids=["int64-past-int32", "uint64-past-int64", "dict-without-input_ids", "flat-list", "floats", "rollout-strings",
        "rollout-bool"])
def test_a_sequence_refused_before_sending_is_named_by_its_place(bad, error, named):
    """A batch of thousands: 'token ids must be in [0, 2**31)' without the sequence is no help."""
    seqs = [[1, 2, 3], bad, [4, 5]]
    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        with pytest.raises(error, match=named):
            client.score(seqs)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
            with pytest.raises(error, match=named):
                await client.score(seqs)

    asyncio.run(main())


def test_a_flat_list_of_ids_says_score_takes_a_list_of_sequences():
    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        for flat in ([5, 6, 7], np.array([5, 6, 7])):
            with pytest.raises(TypeError, match=r"sequences\[0\]: got the single token id 5, not a sequence"):
                client.score(flat)


def test_a_sequence_too_large_for_one_request_is_named_by_its_place_after_the_split():
    """The server's 413 for a body of one sequence names no field: the client, which split the
    batch down to it, names the caller's sequence (and score_padded the caller's row)."""
    seqs = [[1, 2, 3]] * 7 + [list(range(3, 3003))] + [[4, 5]] * 5

    async def main():
        app = create_app(Settings(max_request_bytes=4000), FakeBackend(vocab_size=4096))
        async with running_app(app):
            # one part at a time: a part cancelled inside the in-process app would hold its shutdown
            async with AsyncScoreClient(BASE, transport=httpx.ASGITransport(app=app), max_concurrency=1) as client:
                with pytest.raises(ScoreError) as plain:
                    await client.score(seqs)
                ids = np.zeros((3, 3100), np.int64)
                ids[:, :3], ids[1, :3000] = 1, 1
                attention = (ids != 0).astype(np.int64)
                response = attention.copy()
                response[:, 0] = 0
                with pytest.raises(ScoreError) as padded:
                    await client.score_padded(ids, attention, response)
        return plain.value, padded.value

    plain, padded = asyncio.run(main())
    assert (plain.status, plain.type, plain.param) == (413, "body_too_large", "sequences[7]"), plain
    assert (padded.status, padded.param) == (413, "input_ids[1]"), padded


def test_a_retry_after_of_zero_does_not_make_a_hot_loop():
    """A proxy's 'Retry-After: 0' was obeyed to the letter: ten thousand requests a second to a
    server refusing them, for retry_timeout_s."""
    sent = []

    def busy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        sent.append(request.url.path)
        return httpx.Response(429, headers={"Retry-After": "0"},
                              json={"error": {"type": "queue_full", "message": "busy", "param": None}})

    with ScoreClient(BASE, encoding="json", retry_timeout_s=1.0, transport=httpx.MockTransport(busy)) as client:
        with pytest.raises(ScoreError) as caught:
            client.score([[1, 2, 3]])
    assert (caught.value.status, caught.value.type) == (429, "queue_full")
    assert 2 <= len(sent) <= 12, f"{len(sent)} requests in the 1 s of retry_timeout_s"
    assert retry_after(httpx.Response(429, headers={"Retry-After": "3"}), attempt=9) == 3.0
    assert retry_after(httpx.Response(429, headers={"Retry-After": "nan"}), attempt=0) <= 10


def test_the_knobs_and_options_docs_client_md_names_are_where_it_says():
    """docs/client.md lists the constructor's knobs and each call's options apart: a name in the wrong
    list is a TypeError for whoever copies it."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "client.md").read_text()

    def names(heading: str) -> set[str]:
        block = re.search(re.escape(heading) + r".*?\n- ", text, re.S).group(0)
        return {name for name in re.findall(r"`([a-z_]+)", block)} - {"score", "score_padded", "deadline_exceeded"}

    knobs, options = names("- The client's knobs, given once to"), names("- Each call's options, given to")
    # ScoreClient and AsyncScoreClient pass their knobs on to one constructor, _Base's
    init = set(inspect.signature(_Base.__init__).parameters)
    assert knobs - {"url"} <= init, knobs - init
    for method in (ScoreClient.score, ScoreClient.score_padded, AsyncScoreClient.score, AsyncScoreClient.score_padded):
        params = set(inspect.signature(method).parameters)
        wanted = options - {"top_k"} if method.__name__ == "score_padded" else options
        assert wanted <= params, (method.__qualname__, wanted - params)


@pytest.mark.parametrize("call", [
    lambda c: c.score([[1, 2]]), lambda c: c.score_padded([[1, 2]], [[1, 1]], [[1]]), lambda c: c.models(),
    lambda c: c.ready(), lambda c: c.wait_ready(1), lambda c: c.update_weights(None, "ckpt"),
], ids=["score", "score_padded", "models", "ready", "wait_ready", "update_weights"])
def test_a_closed_client_says_it_is_closed(call):
    """Not a thread pool's 'cannot schedule new futures after shutdown' or httpx's message."""
    client = ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent))
    client.close()
    with pytest.raises(RuntimeError, match=r"^this ScoreClient is closed: create a new one"):
        call(client)
    client.close()  # closing again is harmless

    async def main():
        client = AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent))
        await client.aclose()
        with pytest.raises(RuntimeError, match=r"^this AsyncScoreClient is closed: create a new one"):
            await call(client)
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("batch,named", [
    ({"input_ids": [1, 2, 3], "score_from": 1}, r"got a dict with the keys \['input_ids', 'score_from'\]: pass a list "
                                                r"of sequences \(\[sequence\] for one\)"),
    (None, r"got None$"),
    (5, r"got int 5$"),
    ("1 2 3", r"got str '1 2 3'$"),
], ids=["one-sequence-dict", "None", "int", "str"])
def test_a_batch_that_is_no_iterable_of_sequences_says_what_sequences_must_be(batch, named):
    """A dict was iterated as its keys ('sequences[0]' blamed for being a str), None raised a bare
    "'NoneType' object is not iterable"."""
    wanted = r"^sequences must be an iterable of sequences \(dicts with input_ids, lists of ids or 1-D arrays\), "
    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        with pytest.raises(TypeError, match=wanted + named):
            client.score(batch)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
            with pytest.raises(TypeError, match=wanted + named):
                await client.score(batch)

    asyncio.run(main())


def test_a_generator_of_sequences_is_still_a_batch():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        return httpx.Response(200, json={"model": "m", "weights_version": "v", "results": [
            {"id": None, "logprobs": [-1.0] * 2}, {"id": None, "logprobs": [-1.0]}]})

    with ScoreClient(BASE, encoding="json", transport=httpx.MockTransport(answer)) as client:
        results = client.score(ids for ids in ([1, 2, 3], np.array([4, 5])))
    assert [r.logprobs.size for r in results] == [2, 1]


@pytest.mark.parametrize("where", ["input_ids", "attention_mask", "response_mask"])
@pytest.mark.parametrize("given,named", [
    (None, r"got None$"), ({"input_ids": [[1, 2]]}, r"got a dict: pass the batch's arrays \(batch\['{where}'\]\), not "
                                                    r"the batch$"),
], ids=["None", "the-batch-dict"])
def test_score_padded_says_what_each_array_must_be(where, given, named):
    """None or the batch's dict was read by numpy as a 0-D object array: a shape error or, for a mask, a
    comparison that said nothing of the argument."""
    arrays = {"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]], "response_mask": [[0, 1, 1]], where: given}
    wanted = rf"^{where} must be a 2-D array \(numpy, torch or nested lists\), " + named.replace("{where}", where)
    with ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
        with pytest.raises(TypeError, match=wanted):
            client.score_padded(**arrays)

    async def main():
        async with AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent)) as client:
            with pytest.raises(TypeError, match=wanted):
                await client.score_padded(**arrays)

    asyncio.run(main())


def test_entering_a_closed_client_says_it_is_closed():
    """``with client:`` on a closed client went in; only the first call inside raised."""
    client = ScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent))
    client.close()
    with pytest.raises(RuntimeError, match=r"^this ScoreClient is closed: create a new one"):
        with client:
            pass

    async def main():
        client = AsyncScoreClient(BASE, transport=httpx.MockTransport(_nothing_sent))
        await client.aclose()
        with pytest.raises(RuntimeError, match=r"^this AsyncScoreClient is closed: create a new one"):
            async with client:
                pass

    asyncio.run(main())
