"""A weight update's answer is waited for ``update_timeout_s`` (or the call's ``timeout_s=``), not the
client's per-request ``timeout_s``, against a real server whose checkpoint loads take LOAD_S: a trainer
that lowers timeout_s for fast scoring still sees its updates through, in every client and in every
per-address client of ``update_weights_everywhere``; a bound shorter than the load says the update may
have run."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError, UpdateEverywhereError
from tests.e2e.helpers import fake_server, served_version
from tests.resolving import resolving

LOAD_S = 1.5  # each update's load on the server
SHORT_S = 0.3  # the trainer's timeout_s for scoring, well under a load
NAME = "scorer-pods.rl.svc"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("update-timeout")
    for step in range(1, 8):
        (root / f"step-{step}").mkdir()  # FakeBackend takes any directory as a checkpoint
    server = fake_server(root, "--weights-root", str(root), env={"FAKE_LOAD_SECONDS": str(LOAD_S)})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _served_soon(url: str, version: str) -> None:
    """The update the client stopped waiting for lands on the server all the same."""
    end = time.monotonic() + 30
    while served_version(url) != version:
        assert time.monotonic() < end, f"{version} never served"
        time.sleep(0.1)


def _may_have_run(error: ScoreError) -> None:
    assert (error.status, error.type) == (0, "connection_error"), error
    assert "may have run" in str(error) and "update_timeout_s" in str(error), error


def test_an_update_longer_than_timeout_s_completes_and_a_shorter_call_bound_says_it_may_have_run(server):
    with ScoreClient(server.url, timeout_s=SHORT_S) as client:
        t0 = time.monotonic()
        assert client.update_weights(None, "step-1", version="step-1").weights_version == "step-1"
        assert time.monotonic() - t0 >= LOAD_S  # waited out a load longer than timeout_s
        with pytest.raises(ScoreError) as caught:
            client.update_weights(None, "step-2", version="step-2", timeout_s=SHORT_S)
        _may_have_run(caught.value)
        _served_soon(server.url, "step-2")
    with ScoreClient(server.url, timeout_s=30.0, update_timeout_s=SHORT_S) as client:  # the knob, lower than timeout_s
        with pytest.raises(ScoreError) as caught:
            client.update_weights(None, "step-3", version="step-3")
        _may_have_run(caught.value)
        _served_soon(server.url, "step-3")

    async def main():
        async with AsyncScoreClient(server.url, timeout_s=SHORT_S) as client:
            assert (await client.update_weights(None, "step-4", version="step-4")).weights_version == "step-4"
            with pytest.raises(ScoreError) as caught:
                await client.update_weights(None, "step-5", version="step-5", timeout_s=SHORT_S)
            _may_have_run(caught.value)

    asyncio.run(main())
    _served_soon(server.url, "step-5")


def test_the_per_address_clients_of_an_update_everywhere_wait_as_long(server, monkeypatch):
    resolving(monkeypatch, NAME, "127.0.0.1")  # the name of a headless Service of one pod
    with ScoreClient(f"http://{NAME}:{server.port}", timeout_s=SHORT_S) as client:
        got = client.update_weights_everywhere(None, "step-6", version="step-6")
        assert {a: u.weights_version for a, u in got.items()} == {"127.0.0.1": "step-6"}
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere(None, "step-7", version="step-7", timeout_s=SHORT_S)
    assert list(caught.value.failed) == ["127.0.0.1"], caught.value
    _may_have_run(caught.value.failed["127.0.0.1"])
    _served_soon(server.url, "step-7")


def test_an_update_sent_again_while_the_first_still_loads_waits_for_it(server):
    # The trainer's first call gave up ("may have run") and it sends the same update again, as the
    # error suggests: the server answers 409 update_in_progress with Retry-After while the first loads.
    with ScoreClient(server.url, update_timeout_s=SHORT_S) as impatient, ScoreClient(server.url) as client:
        with pytest.raises(ScoreError) as caught:
            impatient.update_weights(None, "step-1", version="again-1")
        _may_have_run(caught.value)
        t0 = time.monotonic()
        again = client.update_weights(None, "step-1", version="again-1")  # the first one's answer once it serves
        assert again.weights_version == "again-1" and time.monotonic() - t0 < LOAD_S + 5, again
        with pytest.raises(ScoreError) as caught:
            impatient.update_weights(None, "step-2", version="again-2")
        _may_have_run(caught.value)
        with ScoreClient(server.url, retry_timeout_s=0) as no_retries:  # retries off: the 409 as it came
            with pytest.raises(ScoreError) as caught:
                no_retries.update_weights(None, "step-2", version="again-2")
        assert (caught.value.status, caught.value.type) == (409, "update_in_progress"), caught.value
        _served_soon(server.url, "again-2")

    async def main():
        async with AsyncScoreClient(server.url, update_timeout_s=SHORT_S) as impatient, AsyncScoreClient(server.url) as client:
            with pytest.raises(ScoreError) as caught:
                await impatient.update_weights(None, "step-3", version="again-3")
            _may_have_run(caught.value)
            return await client.update_weights(None, "step-3", version="again-3")

    assert asyncio.run(main()).weights_version == "again-3"


def _update_counts(url: str) -> dict[str, float]:
    """The weights route's samples that docs/weights.md names for an update whose client left."""
    counts = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "packscore_weights_updates_total" and sample.labels["outcome"] == "ok":
                counts["ok"] = sample.value
            elif sample.name == "packscore_requests_total" and sample.labels["route"] == "/v1/weights":
                counts[sample.labels["status"]] = sample.value
    return counts


def test_an_update_whose_client_left_runs_on_counts_the_answer_it_gave_and_a_retry_gets_it(server):
    """docs/weights.md: the server does not watch an update's connection, so a client that times out
    mid-load leaves an update that serves, counted ``ok`` and as the 200 it gave (not a 499); sent
    again, the same path and version get that answer at once."""
    before = _update_counts(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/weights", json={"path": "step-4", "version": "left-4"}, timeout=SHORT_S)
    _served_soon(server.url, "left-4")
    end = time.monotonic() + 10
    while (after := _update_counts(server.url)).get("200", 0) == before.get("200", 0):
        assert time.monotonic() < end, after
        time.sleep(0.05)
    assert after["ok"] - before["ok"] == 1 and after["200"] - before.get("200", 0) == 1, (before, after)
    assert after.get("499", 0) == before.get("499", 0), (before, after)
    t0 = time.monotonic()
    again = httpx.post(server.url + "/v1/weights", json={"path": "step-4", "version": "left-4"}, timeout=30)
    assert again.status_code == 200 and again.json()["weights_version"] == "left-4", again.text
    assert time.monotonic() - t0 < LOAD_S  # answered, not loaded again
    assert _update_counts(server.url)["ok"] == after["ok"]
