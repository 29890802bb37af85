"""Several models in one deployment sharing the forward slots (docs/weights.md "Several models in
one deployment"), with the fake backend: what a row of one model waiting for another's forward
does, and on which data-parallel group it runs."""

import asyncio
import os
import threading
import time

import pytest

from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app, wait_until

SEQ = {"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}


@pytest.fixture(autouse=True)
def _no_packscore_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PACKSCORE_"):
            monkeypatch.delenv(name)


def _score(body: dict, **extra) -> dict:
    return {"sequences": [SEQ], **extra, **body}


def test_the_queue_wait_of_a_model_counts_its_wait_for_anothers_forward():
    # packscore_queue_wait_seconds: "between admission and the start of its forward"; the ref's
    # forward starts only once the policy's ends (one set of forward slots).
    policy_gate = threading.Event()
    backends = {"policy": FakeBackend(gate=policy_gate), "ref": FakeBackend()}
    held_s = 0.3

    async def main():
        policy_gate.set()
        app = create_app(Settings(max_wait_ms=0), backends)
        async with running_app(app) as client:
            policy_gate.clear()
            policy = asyncio.create_task(client.post("/score", json=_score({"model": "policy"})))
            await wait_until(lambda: backends["policy"].running == 1)
            ref = asyncio.create_task(client.post("/score", json=_score({"model": "ref"})))
            await wait_until(lambda: app.state.service.models["ref"].scheduler.queued_sequences == 1)
            queued = time.monotonic()
            await asyncio.sleep(held_s)
            assert backends["ref"].running == 0, "the ref ran beside the policy's forward"
            held = time.monotonic() - queued
            policy_gate.set()
            assert (await policy).status_code == 200 and (await ref).status_code == 200
            registry = app.state.service.metrics.registry
            return registry.get_sample_value("packscore_queue_wait_seconds_sum", {"model": "ref"}), held

    waited, held = asyncio.run(main())
    assert waited >= held, f"the ref's queue wait {waited:.3f} s leaves out its {held:.3f} s wait for a forward slot"


def test_a_request_that_ends_while_its_row_waits_for_anothers_forward_never_runs():
    # A deadline (504) or a disconnect drops the sequences whose forward has not started; with
    # several models a row may wait for another model's forward: it must not run for nobody.
    policy_gate = threading.Event()
    backends = {"policy": FakeBackend(gate=policy_gate), "ref": FakeBackend()}

    async def main():
        policy_gate.set()
        app = create_app(Settings(max_wait_ms=0), backends)
        async with running_app(app) as client:
            policy_gate.clear()
            policy = asyncio.create_task(client.post("/score", json=_score({"model": "policy"})))
            await wait_until(lambda: backends["policy"].running == 1)
            late = await client.post("/score", json=_score({"model": "ref", "deadline_ms": 100}))
            ref_queue = app.state.service.models["ref"].scheduler.queued_tokens
            policy_gate.set()
            assert (await policy).status_code == 200
            after = await client.post("/score", json=_score({"model": "ref"}))
            return late, ref_queue, after

    late, ref_queue, after = asyncio.run(main())
    assert late.status_code == 504, late.text
    assert ref_queue == 0, "the tokens of the request that timed out still count against admission"
    assert after.status_code == 200
    ref_rows = backends["ref"].rows[1:]  # rows[0] is the readiness pass
    assert ref_rows == [[4]], f"the ref ran rows {ref_rows}: the timed-out request's row ran after it was answered 504"
