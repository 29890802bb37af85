"""Weights versions as a trainer meets them, with the fake backend: pins, swaps in the middle of
a request, an update retried after a lost answer, and the OpenAPI schema and Python client that
carry the trainer's fields (API.md "POST /v1/weights"); rollout mismatch is in
test_rollout_mismatch.py."""

import asyncio
import logging
import math
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.http.app import create_app
from service.settings import Settings
from service.testing import FAKE_VERSION, FakeBackend, running_app, wait_until
from tests.unit.trainer_service import (ADMIN, KEY, SEQ, expected_logprobs, make_weights_root, score_body,
                                        two_models)

pytestmark = pytest.mark.usefixtures("no_packscore_env")


# ---- versions: pins and swaps in the middle of a request -------------------------------------


def test_a_pin_is_served_exactly_or_409(tmp_path):
    root = make_weights_root(tmp_path)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend())) as client:
            pinned = await client.post("/score", json=score_body({"weights_version": FAKE_VERSION}))
            await client.post("/v1/weights", json={"path": "step-1", "version": "v2"})
            stale = await client.post("/score", json=score_body({"weights_version": FAKE_VERSION}))
            current = await client.post("/score", json=score_body({"weights_version": "v2"}))
            return pinned, stale, current

    pinned, stale, current = asyncio.run(main())
    assert pinned.status_code == 200 and pinned.json()["weights_version"] == FAKE_VERSION
    error = stale.json()["error"]
    assert stale.status_code == 409 and error["type"] == "weights_version_mismatch" and "'v2'" in error["message"]
    assert error["param"] == "weights_version"
    assert current.status_code == 200 and current.json()["weights_version"] == "v2"



@pytest.mark.parametrize("pin", [None, FAKE_VERSION], ids=["unpinned", "pinned"])
def test_a_swap_between_the_rows_of_a_request(tmp_path, pin, caplog):
    """Two sequences in two rows; the weights change while the first is in its forward. Unpinned:
    the first is scored again, and the answer names the new version for both. Pinned: 409."""
    root = make_weights_root(tmp_path)
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    seqs = [{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 1}, {"id": "b", "input_ids": [5, 6, 7, 8], "score_from": 2}]
    settings = Settings(weights_root=root, max_batch_tokens=4, max_wait_ms=0)

    async def main():
        gate.set()
        async with running_app(create_app(settings, backend)) as client:
            gate.clear()
            request = asyncio.create_task(client.post("/score", json={"sequences": seqs, "weights_version": pin}))
            await wait_until(lambda: backend.running == 1)
            update = await client.post("/v1/weights", json={"path": "step-1", "version": "v2"})
            gate.set()
            return update, await request

    with caplog.at_level(logging.INFO, logger="service.http.scoring"):
        update, response = asyncio.run(main())
    assert update.status_code == 200
    if pin is not None:
        assert response.status_code == 409 and response.json()["error"]["type"] == "weights_version_mismatch"
        return
    assert response.status_code == 200, response.text
    assert response.json()["weights_version"] == "v2"
    for seq, result in zip(seqs, response.json()["results"]):
        np.testing.assert_allclose(result["logprobs"], expected_logprobs(seq, 1), rtol=0, atol=1e-6)
    assert [len(r) for r in backend.rows[1:]] == [1, 1, 1]  # a, b, then a again
    assert "1 of 2 sequences of a request scored by another version of fake-model than v2: scoring it again" \
        in caplog.text, caplog.text



def test_a_swap_after_the_last_row_of_a_request_leaves_its_one_version(tmp_path):
    """One row, the weights changed while it is in its forward: every sequence was scored by the
    old version, which the answer names; nothing is scored again (each time it were, the next swap
    could land after it too)."""
    root = make_weights_root(tmp_path)
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    seqs = [{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 1}, {"id": "b", "input_ids": [5, 6, 7], "score_from": 1}]

    async def main():
        gate.set()
        async with running_app(create_app(Settings(weights_root=root, max_wait_ms=0), backend)) as client:
            gate.clear()
            rows = len(backend.rows)
            request = asyncio.create_task(client.post("/score", json={"sequences": seqs}))
            await wait_until(lambda: backend.running == 1)
            update = await client.post("/v1/weights", json={"path": "step-1", "version": "v2"})
            gate.set()
            return update, await request, len(backend.rows) - rows

    update, response, rows = asyncio.run(main())
    assert update.status_code == 200, update.text
    assert response.status_code == 200, response.text
    assert response.json()["weights_version"] == FAKE_VERSION
    for seq, result in zip(seqs, response.json()["results"]):
        np.testing.assert_allclose(result["logprobs"], expected_logprobs(seq, 0), rtol=0, atol=1e-6)
    assert rows == 1, f"{rows} rows for a request that one row scored by one version"


def test_swaps_landing_faster_than_a_request_is_scored_never_fail_it(tmp_path):
    """Six one-sequence rows (about 0.25 s a pass) while updates land every 20 ms: each pass
    straddles swaps. The request still ends with one version (its second re-score holds the next
    update off), and every update still succeeds."""
    root = make_weights_root(tmp_path)
    backend = FakeBackend(seconds_per_token=0.01)
    seqs = [{"id": str(i), "input_ids": [i + 1, i + 2, i + 3, i + 4], "score_from": 1} for i in range(6)]
    settings = Settings(weights_root=root, max_batch_tokens=4, max_wait_ms=0)

    async def main():
        async with running_app(create_app(settings, backend)) as client:
            request = asyncio.create_task(client.post("/score", json={"sequences": seqs}))
            updates = []
            while not request.done() and len(updates) < 200:
                step = "step-1" if len(updates) % 2 else "step-2"
                updates.append(await client.post("/v1/weights", json={"path": step, "version": f"v{len(updates) + 1}"}))
                await asyncio.sleep(0.02)
            return await request, updates

    response, updates = asyncio.run(main())
    assert response.status_code == 200, response.text
    assert len(updates) >= 3 and all(u.status_code == 200 for u in updates), [u.text for u in updates if u.status_code != 200]
    version = response.json()["weights_version"]
    generation = backend.versions.index(version)
    for seq, result in zip(seqs, response.json()["results"]):
        np.testing.assert_allclose(result["logprobs"], expected_logprobs(seq, generation), rtol=0, atol=1e-6)



def test_a_version_names_one_set_of_weights(tmp_path):
    """A version the model served (now or before) is refused for new weights: a request pinned to
    it must never get other numbers under that name. Refusals are counted, path ones included."""
    root = make_weights_root(tmp_path)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend())) as client:
            answers = [await client.post("/v1/weights", json=body) for body in (
                {"path": "step-1", "version": "L"},
                {"path": "step-2", "version": "L"},  # the name now served
                {"path": "step-2", "version": FAKE_VERSION},  # the name served before
                {"path": "step-2", "version": "M"},
                {"path": "/etc", "version": "N"},
                {"path": "step-2", "version": 5},
                {"path": "step-2", "version": "xxh3-5e12cb26ac1f"},  # could later be other weights' hash
                {"path": "step-2", "version": "XXH3-5e12cb26ac1f"},
                {"path": "step-2", "version": "SHA256-5e12cb26ac1f"},  # what replicas of earlier builds call theirs
                {"path": "step-2", "version": "mixed:0"},
                {"path": "step-2", "version": "preset:tiny#seed0"},  # a preset's name
                {"path": "step-2", "version": "\x00\x01"},
                {"path": "step-2", "version": " v "},
                {"path": "step-2", "version": "a\nb"},
            )]
            return answers, await client.post("/score", json=score_body({"weights_version": "L"})), await client.get("/metrics")

    answers, pinned, metrics = asyncio.run(main())
    assert [a.status_code for a in answers] == [200, 409, 409, 200, 403] + [422] * 9, [a.text for a in answers]
    for refused in answers[5:]:
        assert refused.json()["error"]["param"] == "version", refused.text
    for refused in answers[1:3]:
        error = refused.json()["error"]
        assert error["type"] == "version_in_use" and error["param"] == "version", error
    assert pinned.status_code == 409 and pinned.json()["error"]["type"] == "weights_version_mismatch"
    counted = {}  # per outcome, over the model labels ("" for a body refused before its model is known)
    for f in text_string_to_metric_families(metrics.text):
        for s in f.samples if f.name == "packscore_weights_updates" else ():
            if s.name.endswith("_total") and s.value:  # every outcome is there, at 0, from the start
                counted[s.labels["outcome"]] = counted.get(s.labels["outcome"], 0.0) + s.value
    assert counted == {"ok": 2.0, "version_in_use": 2.0, "forbidden_path": 1.0, "invalid_value": 9.0}, counted
    labels = {s.labels["model"] for f in text_string_to_metric_families(metrics.text)
              for s in (f.samples if f.name == "packscore_weights_updates" else ()) if s.value}
    assert labels == {FakeBackend().info.name}, labels  # a refused body counts under the model it names



def test_an_update_repeated_after_a_lost_answer_gets_the_first_answer(tmp_path):
    """A trainer that lost the answer sends the same update again: while that version still
    serves the same files it gets the first answer and nothing reloads; files rewritten under the
    same version name, or the name for another directory, are new weights: 409."""
    root = make_weights_root(tmp_path)
    backend = FakeBackend()

    async def main():
        async with running_app(create_app(Settings(weights_root=root), backend)) as client:
            body = {"path": "step-1", "version": "L"}
            first, again = [await client.post("/v1/weights", json=body) for _ in range(2)]
            loads = backend.generation
            elsewhere = await client.post("/v1/weights", json={"path": "step-2", "version": "L"})
            (root / "step-1" / "model.safetensors").write_bytes(b"rewritten, and longer")
            rewritten = await client.post("/v1/weights", json=body)
            return first, again, loads, elsewhere, rewritten

    first, again, loads, elsewhere, rewritten = asyncio.run(main())
    assert first.status_code == 200 and again.status_code == 200, again.text
    assert again.json() == first.json() and loads == 1, (again.json(), first.json(), loads)
    for refused in (elsewhere, rewritten):
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "version_in_use", refused.text


# ---- the schema and the client ---------------------------------------------------------------


def test_openapi_documents_the_new_fields(tmp_path):
    async def main():
        async with running_app(create_app(Settings(weights_root=tmp_path), two_models())) as client:
            return (await client.get("/openapi.json")).json()

    schema = asyncio.run(main())
    components = schema["components"]["schemas"]
    assert "rollout_logprobs" in components["SequenceIn"]["properties"]
    assert "weights_version" in components["ScoreRequest"]["properties"]
    assert components["ScoreRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["policy", "ref"]
    assert set(components["Mismatch"]["properties"]) == {"mean_abs_diff", "max_abs_diff", "k3_kl"}
    assert set(schema["paths"]["/v1/weights"]["post"]["responses"]) >= {"200", "403", "404", "409", "422"}
    assert "WeightsRequest" in components and "WeightsResponse" in components



@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_client_updates_weights_pins_versions_and_sends_rollouts(tmp_path, encoding):
    import httpx

    from packscore_client import AsyncScoreClient, ScoreError

    root = make_weights_root(tmp_path)
    settings = Settings(weights_root=root, api_key=KEY, admin_key=ADMIN)
    rollout = expected_logprobs(SEQ) + np.float32(0.5)

    async def main():
        app = create_app(settings, two_models())
        async with running_app(app):
            transport = httpx.ASGITransport(app=app)
            async with AsyncScoreClient("http://packscore.test", KEY, admin_key=ADMIN, encoding=encoding,
                                        transport=transport) as client:
                first = await client.score([{**SEQ, "rollout_logprobs": rollout}], model="policy")
                update = await client.update_weights("policy", "step-1", version="v2")
                pinned = await client.score([SEQ], model="policy", weights_version="v2")
                with pytest.raises(ScoreError) as stale:
                    await client.score([SEQ], model="policy", weights_version=FAKE_VERSION)
                with pytest.raises(ScoreError) as escape:
                    await client.update_weights("policy", "../x")
            async with AsyncScoreClient("http://packscore.test", KEY, transport=transport) as scoring_only:
                with pytest.raises(ScoreError) as no_admin:
                    await scoring_only.update_weights("policy", "step-2")
            return first, update, pinned, stale.value, escape.value, no_admin.value

    first, update, pinned, stale, escape, no_admin = asyncio.run(main())
    assert first[0].weights_version == FAKE_VERSION and first[0].model == "policy"
    assert abs(first[0].mismatch["max_abs_diff"] - 0.5) <= 1e-6 and abs(first[0].mismatch["mean_abs_diff"] - 0.5) <= 1e-6
    assert abs(first[0].mismatch["k3_kl"] - (math.exp(-0.5) - 1 + 0.5)) <= 1e-6
    assert (update.model, update.weights_version, update.previous_version) == ("policy", "v2", FAKE_VERSION)
    assert pinned[0].weights_version == "v2"
    np.testing.assert_allclose(pinned[0].logprobs, expected_logprobs(SEQ, 1), rtol=0, atol=1e-6)
    assert (stale.status, stale.type) == (409, "weights_version_mismatch")
    assert (escape.status, escape.type) == (403, "forbidden_path")
    assert no_admin.status == 403
