"""score_padded's rescoring pass: rows whose part met a weight update are sent again as a subset,
and the server numbers an error by its place in that subset; the caller must read the row it holds."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError

BASE = "http://packscore.test"

# Errors the new weights can give a row the old ones scored, as the server words them.
REFUSALS = [
    (422, "non_finite_scores", "sequences[1]", "The model's scores of sequences[1] are not finite at position 4: its logits "
     "overflow float32 or are NaN, so the served weights cannot score this sequence."),
    (422, "invalid_value", "sequences[1].input_ids[2]", "Token id 5 is outside the vocabulary [0, 4)."),
    (413, "sequence_too_long", "sequences[1].input_ids", "Sequence 1 has 5 tokens; the longest accepted is 4 (max_model_len)."),
]
# Row 4, the subset's sequences[1] and the batch's sent sequences[3], begins at column 3 of input_ids.
NAMED = {"sequences[1]": "input_ids[4]", "sequences[1].input_ids[2]": "input_ids[4, 5]",
         "sequences[1].input_ids": "input_ids[4]"}


def _server(bodies: list, answer) -> httpx.MockTransport:
    """A server whose limits are unknown (/readyz 404) and that serves v2 now (/v1/models); each /score
    body is kept in ``bodies`` and answered by ``answer(body)``."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(404)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "weights_version": "v2"}]})
        body = json.loads(request.content)
        bodies.append(body)
        return answer(body)

    return httpx.MockTransport(handler)


def _scored(body: dict, version: str, logprob: float = 0.0) -> httpx.Response:
    return httpx.Response(200, json={"model": "m", "weights_version": version, "results": [
        {"id": s["id"], "logprobs": [logprob] * (len(s["input_ids"]) - s["score_from"])} for s in body["sequences"]]})


def _refusing(status: int, kind: str, param: str, message: str, bodies: list) -> httpx.MockTransport:
    """Two parts of two rows: the first scored by v2, the second by v1; v2 then refuses its second row."""
    def answer(body: dict) -> httpx.Response:
        if body.get("weights_version") == "v2":
            return httpx.Response(status, json={"error": {"type": kind, "message": message, "param": param}})
        return _scored(body, "v2" if len(bodies) == 1 else "v1")

    return _server(bodies, answer)


@pytest.mark.parametrize("blocking", [True, False], ids=["ScoreClient", "AsyncScoreClient"])
@pytest.mark.parametrize("status,kind,param,message", REFUSALS, ids=[r[1] for r in REFUSALS])
def test_a_rescoring_error_names_the_callers_row(blocking, status, kind, param, message):
    ids, attn, resp = np.full((5, 8), 3), np.ones((5, 8), np.int64), np.ones((5, 2), np.int64)
    resp[0] = 0  # row 0 is not sent: the sent sequences are rows 1..4
    attn[4, :3] = 0  # row 4 is left-padded: its sent input_ids[2] is column 5
    bodies: list = []
    knobs = dict(encoding="json", max_sequences_per_request=2, max_concurrency=1,
                 transport=_refusing(status, kind, param, message, bodies))
    if blocking:
        with ScoreClient(BASE, **knobs) as client, pytest.raises(ScoreError) as failed:
            client.score_padded(ids, attn, resp, return_entropy=False)
    else:
        async def main():
            async with AsyncScoreClient(BASE, **knobs) as client:
                with pytest.raises(ScoreError) as failed:
                    await client.score_padded(ids, attn, resp, return_entropy=False)
            return failed
        failed = asyncio.run(main())
    error = failed.value
    assert [s["id"] for s in bodies[-1]["sequences"]] == ["row-3", "row-4"], bodies[-1]  # the subset re-sent
    assert (error.status, error.type, error.param) == (status, kind, NAMED[param]), \
        f"param {error.param!r}, expected {NAMED[param]!r}: {error}"
    assert "sequences[" not in error.message and "Sequence 1" not in error.message, error.message
    if kind != "invalid_value":  # its message names no row
        assert ("Row 4" if kind == "sequence_too_long" else "input_ids[4]") in error.message, error.message


def test_the_blocking_client_scores_a_padded_batch_by_one_version_too():
    """test_client.py's re-scoring across a weight update (the async client against the app), driven
    by the blocking client: the rows of the part v1 scored are sent again pinned to v2."""
    bodies: list = []

    def answer(body: dict) -> httpx.Response:
        version = "v1" if len(bodies) == 1 else "v2"  # an update after the first part
        return _scored(body, version, float(version[1]))

    ids, attn, resp = np.full((4, 6), 5), np.ones((4, 6)), np.ones((4, 2))
    with ScoreClient(BASE, encoding="json", transport=_server(bodies, answer), max_sequences_per_request=2,
                     max_concurrency=1) as client:
        scores = client.score_padded(ids, attn, resp, return_entropy=False)
    assert scores.weights_version == "v2" and (scores.logprobs == 2.0).all(), scores
    assert [b.get("weights_version") for b in bodies] == [None, None, "v2"], bodies
