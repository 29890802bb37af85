"""``ScoreError.request_id``: the ``X-Request-Id`` of the answer that failed the call, None without one."""

import asyncio
import pickle

import httpx
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
from packscore_client.errors import response_error
from packscore_client.protocol import renumbered
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

BASE = "http://packscore.test"


def test_the_error_of_an_answer_names_its_request_id_and_keeps_it_when_renamed():
    answer = httpx.Response(422, headers={"X-Request-Id": "req-42"},
                            json={"error": {"type": "invalid_value", "message": "Sequence 0 is bad.",
                                            "param": "sequences[0]"}})
    error = response_error(answer)
    assert (error.status, error.type, error.request_id) == (422, "invalid_value", "req-42")
    assert str(error) == "422 invalid_value: Sequence 0 is bad. (param: sequences[0]) (request_id: req-42)"
    moved = renumbered(error, [7])  # the caller's numbering: still the same answer's id
    assert (moved.param, moved.request_id) == ("sequences[7]", "req-42") and "(request_id: req-42)" in str(moved)
    proxy_page = response_error(httpx.Response(502, text="<html>bad gateway</html>"))
    assert proxy_page.request_id is None and "request_id" not in str(proxy_page)


def test_no_answer_no_request_id():
    with ScoreClient("http://127.0.0.1:1", connect_retry_s=0.1) as client:
        with pytest.raises(ScoreError) as failed:
            client.score([[1, 2]])
    assert failed.value.type == "connection_error" and failed.value.request_id is None, failed.value
    assert "request_id" not in str(failed.value)


def test_a_split_call_names_the_request_whose_answer_failed_it():
    seen: list[tuple[int, str]] = []

    class Recording(httpx.ASGITransport):
        async def handle_async_request(self, request):
            response = await super().handle_async_request(request)
            if request.url.path == "/score":
                seen.append((response.status_code, response.headers["x-request-id"]))
            return response

    async def main():
        app = create_app(Settings(), FakeBackend(vocab_size=10))
        async with running_app(app):
            client = AsyncScoreClient(BASE, transport=Recording(app=app), max_sequences_per_request=1, max_concurrency=1)
            with pytest.raises(ScoreError) as failed:
                await client.score([[1, 2], [3, 4], [5, 30]])  # three requests, the third refused
            await client.aclose()
        return failed.value

    error = asyncio.run(main())
    refused = [rid for status, rid in seen if status == 422]
    assert len(seen) == 3 and len(refused) == 1, seen
    assert (error.param, error.request_id) == ("sequences[2].input_ids[1]", refused[0]), (error, seen)


def test_a_score_error_pickles_with_every_field():
    # A process pool or a distributed trainer's workers hand a failed call's error back pickled.
    from packscore_client import UpdateEverywhereError
    from packscore_client.protocol import WeightsUpdate

    error = ScoreError(422, "invalid_value", "Sequence 3: bad id.", "sequences[3].input_ids[0]", "rid-9")
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), back.status, back.type, back.message, back.param, back.request_id, str(back)) == (
        ScoreError, 422, "invalid_value", "Sequence 3: bad id.", "sequences[3].input_ids[0]", "rid-9", str(error))
    update = WeightsUpdate("m", "v2", "v1", 1.5, 2.0)
    failed = {"10.0.0.2": ScoreError(0, "connection_error", "refused")}
    partial = UpdateEverywhereError(0, "update_incomplete", "1 of 2 failed", {"10.0.0.1": update}, failed)
    back = pickle.loads(pickle.dumps(partial))
    assert type(back) is UpdateEverywhereError and str(back) == str(partial), back
    assert back.updated == {"10.0.0.1": update} and back.failed["10.0.0.2"].type == "connection_error", back.failed
