"""The client's time bounds against real servers: ``models()`` asked right after ``packscore serve``
starts (not listening yet, then loading) waits for it; a call whose ``deadline_ms`` passes while the
server still scores it raises the server's own 504 (with its request id), not one of its own."""

from __future__ import annotations

import asyncio
import time

import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
from packscore_client.protocol import DEADLINE_GRACE_S
from tests.e2e.helpers import API_KEY, ServerProcess, fake_server


def test_models_right_after_the_server_starts_waits_for_it(tmp_path):
    server = ServerProcess(tmp_path)  # started, not waited for: the port is not bound yet, then the model loads
    try:
        with ScoreClient(server.url, API_KEY, connect_retry_s=120) as client:
            assert [m["id"] for m in client.models()] == ["tiny"], server.log()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    server = fake_server(tmp_path_factory.mktemp("slow"), env={"FAKE_SECONDS_PER_TOKEN": "0.5"})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_deadline_passed_mid_forward_raises_the_servers_own_504(slow_server, blocking):
    ids = [list(range(1, 9))]  # a forward of 4 s

    async def awaited():
        async with AsyncScoreClient(slow_server.url) as client:
            return await client.score(ids, deadline_ms=400)

    started = time.monotonic()
    with pytest.raises(ScoreError) as failed:
        if blocking:
            with ScoreClient(slow_server.url) as client:
                client.score(ids, deadline_ms=400)
        else:
            asyncio.run(awaited())
    elapsed = time.monotonic() - started
    e = failed.value
    assert (e.status, e.type) == (504, "deadline_exceeded"), e
    assert e.request_id is not None, f"the client's own 504, not the server's: {e}"
    assert elapsed < 0.4 + DEADLINE_GRACE_S, f"raised {elapsed:.2f} s into a call of deadline_ms=400"
