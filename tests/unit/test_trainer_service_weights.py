"""POST /v1/weights with the fake backend (API.md "POST /v1/weights"): the route, the swap,
paths kept inside --weights-root, refused checkpoints, one update at a time, the admin key."""

import asyncio
import json
import logging
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.scoring.checkpoint_error import CheckpointError
from service.http.app import create_app
from service.settings import Settings
from service.testing import FAKE_VERSION, FakeBackend, running_app, wait_until
from tests.unit.trainer_service import (ADMIN, KEY, SEQ, expected_logprobs, make_weights_root, score_body,
                                        two_models)

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def test_weights_route_is_absent_without_a_root():
    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            return await client.post("/v1/weights", json={"path": "x"}), await client.get("/openapi.json")

    response, openapi = asyncio.run(main())
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found"
    assert "/v1/weights" not in openapi.json()["paths"]



def test_an_update_swaps_the_version_and_the_numbers(tmp_path):
    root = make_weights_root(tmp_path)
    backends = two_models()

    async def main():
        async with running_app(create_app(Settings(weights_root=root), backends)) as client:
            before = await client.post("/score", json=score_body({"model": "policy"}))
            update = await client.post("/v1/weights", json={"model": "policy", "path": "step-1", "version": "step-1"})
            after = await client.post("/score", json=score_body({"model": "policy"}))
            ref = await client.post("/score", json=score_body({"model": "ref"}))
            hashed = await client.post("/v1/weights", json={"model": "policy", "path": "step-2/"})
            models = await client.get("/v1/models")
            metrics = await client.get("/metrics")
            return before, update, after, ref, hashed, models, metrics

    before, update, after, ref, hashed, models, metrics = asyncio.run(main())
    assert before.json()["weights_version"] == FAKE_VERSION
    body = update.json()
    assert update.status_code == 200, update.text
    assert (body["model"], body["weights_version"], body["previous_version"]) == ("policy", "step-1", FAKE_VERSION)
    assert body["load_s"] >= 0 and body["swap_ms"] >= 0
    assert after.json()["weights_version"] == "step-1"
    np.testing.assert_allclose(after.json()["results"][0]["logprobs"], expected_logprobs(SEQ, 1), rtol=0, atol=1e-6)
    assert ref.json()["weights_version"] == FAKE_VERSION  # the other model is untouched
    np.testing.assert_allclose(ref.json()["results"][0]["logprobs"], expected_logprobs(SEQ, 0), rtol=0, atol=1e-6)
    assert hashed.status_code == 200 and hashed.json()["weights_version"].startswith("xxh3-")
    versions = {m["id"]: m["weights_version"] for m in models.json()["data"]}
    assert versions == {"policy": hashed.json()["weights_version"], "ref": FAKE_VERSION}
    info = {s.labels["model"]: s.labels["weights_version"] for f in text_string_to_metric_families(metrics.text)
            if f.name in ("packscore_model", "packscore_model_info") for s in f.samples}
    assert info == versions
    assert 'packscore_weights_updates_total{model="policy",outcome="ok"} 2.0' in metrics.text



def test_every_path_escape_is_forbidden(tmp_path, caplog):
    root = make_weights_root(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"x")
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    (root / "files-out").mkdir()
    (root / "files-out" / "model.safetensors").symlink_to(outside / "model.safetensors")
    (root / "link-in").symlink_to(root / "step-1", target_is_directory=True)
    for name, shard in (("index-up", "../../outside/model.safetensors"), ("index-abs", str(outside / "model.safetensors"))):
        (root / name).mkdir()  # a directory inside the root whose index names shards outside it
        (root / name / "config.json").write_text("{}")
        (root / name / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    escapes = [str(outside), "../outside", "step-1/../../outside", "link-out", "link-out/", "files-out",
               "..", "step-1/..", "C:\\outside", "\\\\host\\share", "index-up", "index-abs"]

    async def main():
        app = create_app(Settings(weights_root=root), FakeBackend())
        async with running_app(app) as client:
            refused = {p: await client.post("/v1/weights", json={"path": p}) for p in escapes}
            missing = [await client.post("/v1/weights", json={"path": "step-9"})]
            # names the file system refuses (a component past 255 bytes): 422 on path, not a 500
            too_long = [await client.post("/v1/weights", json={"path": p}) for p in ("a" * 300, "step-1/" + "b" * 300)]
            inside = await client.post("/v1/weights", json={"path": "link-in", "version": "v2"})
            unknown = await client.post("/v1/weights", json={"model": "nope", "path": "step-1"})
            return refused, missing + too_long, inside, unknown

    with caplog.at_level(logging.INFO, logger="service.http.weights"):
        refused, missing, inside, unknown = asyncio.run(main())
    for path, response in refused.items():
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["type"] == "forbidden_path" and response.json()["error"]["param"] == "path"
    # each refusal is a line for the operator: a path out of the root a WARNING, the others INFO
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "refused before any load" in r.getMessage()]
    forbidden = [m for level, m in said if level == logging.WARNING]
    assert len(forbidden) == len(escapes) and all(": 403 forbidden_path: path " in m for m in forbidden), said
    assert any(level == logging.INFO and "404 model_not_found" in m for level, m in said), said
    for response in missing:
        assert response.status_code == 422 and response.json()["error"]["param"] == "path", response.text
    assert inside.status_code == 200, inside.text  # a symlink that stays inside the root is fine
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found"



def test_a_refused_checkpoint_changes_nothing(tmp_path):
    root = make_weights_root(tmp_path)

    def check(path):
        if path.name == "step-2":
            raise CheckpointError("incomplete", "step-2: missing 1 tensors the model needs: lm_head.weight")
        if path.name == "step-1":
            raise CheckpointError("incompatible", "step-1: 1 tensors differ in shape: lm_head.weight [8, 4] (served: [8, 8])")

    async def main():
        app = create_app(Settings(weights_root=root), FakeBackend(check_checkpoint=check))
        async with running_app(app) as client:
            incomplete = await client.post("/v1/weights", json={"path": "step-2"})
            incompatible = await client.post("/v1/weights", json={"path": "step-1"})
            after = await client.post("/score", json=score_body({}))
            return incomplete, incompatible, after

    incomplete, incompatible, after = asyncio.run(main())
    assert incomplete.status_code == 422 and incomplete.json()["error"]["type"] == "incomplete_checkpoint"
    assert "lm_head.weight" in incomplete.json()["error"]["message"]
    assert incompatible.status_code == 422 and incompatible.json()["error"]["type"] == "incompatible_checkpoint"
    assert "lm_head.weight" in incompatible.json()["error"]["message"]
    assert after.json()["weights_version"] == FAKE_VERSION
    np.testing.assert_allclose(after.json()["results"][0]["logprobs"], expected_logprobs(SEQ, 0), rtol=0, atol=1e-6)



def test_an_unreadable_checkpoint_is_422_and_memory_503(tmp_path):
    root = make_weights_root(tmp_path)

    def check(path):
        if path.name == "step-1":
            raise OSError("model.safetensors: unexpected end of file")
        raise RuntimeError("CUDA out of memory. Tried to allocate 18.00 GiB")

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend(check_checkpoint=check))) as client:
            return (await client.post("/v1/weights", json={"path": "step-1"}),
                    await client.post("/v1/weights", json={"path": "step-2"}),
                    await client.post("/score", json=score_body({})))

    unreadable, memory, after = asyncio.run(main())
    assert unreadable.status_code == 422 and unreadable.json()["error"]["type"] == "unreadable_checkpoint"
    assert memory.status_code == 503 and "retry-after" in memory.headers
    assert after.json()["weights_version"] == FAKE_VERSION



def test_a_second_update_of_the_same_model_is_409_and_readiness_holds_during_a_load(tmp_path):
    root = make_weights_root(tmp_path)
    load_gate = threading.Event()
    backends = two_models(load_gate=load_gate)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), backends)) as client:
            first = asyncio.create_task(client.post("/v1/weights", json={"model": "policy", "path": "step-1"}))
            await wait_until(lambda: backends["policy"]._updating.locked())
            second = await client.post("/v1/weights", json={"model": "policy", "path": "step-2"})
            # a body wrong in itself is 422 whatever the model's state
            reserved = await client.post("/v1/weights", json={"model": "policy", "path": "step-2", "version": "xxh3-0"})
            ready = await client.get("/readyz")
            served = await client.post("/score", json=score_body({"model": "policy"}))
            load_gate.set()
            return second, reserved, ready, served, await first

    second, reserved, ready, served, first = asyncio.run(main())
    assert second.status_code == 409 and second.json()["error"]["type"] == "update_in_progress"
    assert reserved.status_code == 422 and reserved.json()["error"]["param"] == "version", reserved.text
    assert ready.status_code == 200
    assert served.status_code == 200 and served.json()["weights_version"] == FAKE_VERSION
    assert first.status_code == 200



def test_the_admin_key_guards_updates_and_the_scoring_key_is_refused(tmp_path):
    root = make_weights_root(tmp_path)
    settings = Settings(weights_root=root, api_key=KEY, admin_key=ADMIN)
    body = {"path": "step-1", "version": "v2"}

    async def main():
        async with running_app(create_app(settings, FakeBackend())) as client:
            bearer = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
            return {
                "none": await client.post("/v1/weights", json=body),
                "scoring-key": await client.post("/v1/weights", json=body, headers=bearer(KEY)),
                "admin-on-score": await client.post("/score", json=score_body({}), headers=bearer(ADMIN)),
                "admin": await client.post("/v1/weights", json=body, headers=bearer(ADMIN)),
            }

    out = asyncio.run(main())
    assert out["none"].status_code == 401
    assert out["scoring-key"].status_code == 403
    assert out["admin-on-score"].status_code == 403  # a known key, not allowed for this route
    assert out["admin"].status_code == 200, out["admin"].text

    async def without_admin_key():
        async with running_app(create_app(Settings(weights_root=root, api_key=KEY), FakeBackend())) as client:
            return (await client.post("/v1/weights", json=body),
                    await client.post("/v1/weights", json=body, headers={"Authorization": f"Bearer {KEY}"}))

    none, scoring = asyncio.run(without_admin_key())
    assert none.status_code == 401 and scoring.status_code == 200



def test_the_update_route_keeps_the_body_limit_and_is_404_without_a_root(tmp_path):
    root = make_weights_root(tmp_path)

    async def main():
        limited = create_app(Settings(weights_root=root, max_request_bytes=4096), FakeBackend())
        async with running_app(limited) as client:
            big = await client.post("/v1/weights", json={"path": "step-1", "version": "x" * 10_000})
        # --admin-key without --weights-root: the route does not exist, whoever asks
        # ... with an API key too: 404 with no key, the scoring key or the admin key
        rootless = create_app(Settings(admin_key=ADMIN, api_key=KEY), FakeBackend())
        async with running_app(rootless) as client:
            answers = [await client.post("/v1/weights", json={"path": "step-1"}, headers=headers)
                       for headers in ({}, {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": f"Bearer {KEY}"})]
        return big, answers

    big, answers = asyncio.run(main())
    assert big.status_code == 413 and big.json()["error"]["type"] == "body_too_large", big.text
    assert [a.status_code for a in answers] == [404] * 3, [a.text for a in answers]



def test_a_checkpoint_packscore_cannot_load_is_incompatible(tmp_path):
    """API.md names two refusals of a checkpoint's content: another model_type, a quantization or
    no safetensors at all is not the served model's checkpoint: 422 incompatible_checkpoint."""
    root = make_weights_root(tmp_path)

    def check(path):
        raise CheckpointError("unsupported", f"{path.name}: model_type 'llama' is not supported")

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend(check_checkpoint=check))) as client:
            return await client.post("/v1/weights", json={"path": "step-1"})

    refused = asyncio.run(main())
    error = refused.json()["error"]
    assert refused.status_code == 422 and error["type"] == "incompatible_checkpoint" and error["param"] == "path", error
    assert "llama" in error["message"], error


def test_openapi_names_every_status_the_weights_route_and_the_admin_key_bring(tmp_path):
    """The /docs page lists what a route answers: /v1/weights' 413 (a body over 1 MiB) and the 403 the
    admin key gets on the scoring routes."""
    settings = Settings(weights_root=make_weights_root(tmp_path), api_key=KEY, admin_key=ADMIN)
    scoring, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}

    async def main():
        async with running_app(create_app(settings, two_models())) as client:
            answered = {
                ("/v1/weights", "post"): (await client.post("/v1/weights", content=b" " * (2 << 20), headers={
                    **admin, "Content-Type": "application/json"})).status_code,
                ("/score", "post"): (await client.post("/score", headers=admin, json=score_body({"model": "ref"}))).status_code,
                ("/v1/models", "get"): (await client.get("/v1/models", headers=admin)).status_code,
                ("/metrics", "get"): (await client.get("/metrics", headers=admin)).status_code,
            }
            return answered, (await client.get("/openapi.json", headers=scoring)).json()

    answered, schema = asyncio.run(main())
    assert answered == {("/v1/weights", "post"): 413, ("/score", "post"): 403, ("/v1/models", "get"): 403,
                        ("/metrics", "get"): 403}, answered
    undocumented = {route: status for route, status in answered.items()
                    if str(status) not in schema["paths"][route[0]][route[1]]["responses"]}
    assert not undocumented, f"answered but not in /openapi.json: {undocumented}"


def test_an_update_that_fails_unexpectedly_is_a_500_counted_as_a_failed_update(tmp_path):
    """An exception the route does not expect (a bug) is answered 500 and counted under the outcome
    internal_error, so PackscoreWeightsUpdateFailed sees it; the old weights still serve."""
    root = make_weights_root(tmp_path)

    def check(path):
        raise ValueError("a bug in the check")

    async def main():
        app = create_app(Settings(weights_root=root), FakeBackend(check_checkpoint=check))
        async with running_app(app) as client:
            return (await client.post("/v1/weights", json={"path": "step-1"}), await client.get("/metrics"),
                    await client.post("/score", json=score_body({})))

    failed, metrics, after = asyncio.run(main())
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "internal_error", failed.text
    counted = {(s.labels["model"], s.labels["outcome"], s.value) for family in text_string_to_metric_families(metrics.text)
               for s in family.samples if s.name == "packscore_weights_updates_total" and s.value}
    assert counted == {(FakeBackend().info.name, "internal_error", 1.0)}, sorted(counted)
    assert after.json()["weights_version"] == FAKE_VERSION


def test_an_update_whose_worker_was_lost_as_it_swapped_is_a_503_counted_and_not_recorded(tmp_path):
    """The pool's answer when a worker is lost between the ranks' swap and the new version serving:
    a 503 to retry, counted as backend_unavailable; the record keeps what a restart should serve."""
    from model_runtime.scoring.backend import BackendUnavailableError

    root, record = make_weights_root(tmp_path), tmp_path / "record.json"

    def check(path):
        raise BackendUnavailableError("a worker failed as the ranks swapped to 'v2'; the pool is restarting with "
                                      "the weights of version 'v1': send the update again")

    async def main():
        app = create_app(Settings(weights_root=root, weights_record=record), FakeBackend(check_checkpoint=check))
        async with running_app(app) as client:
            return (await client.post("/v1/weights", json={"path": "step-1", "version": "v2"}),
                    await client.get("/metrics"), await client.post("/score", json=score_body({})))

    lost, metrics, after = asyncio.run(main())
    assert lost.status_code == 503 and lost.json()["error"]["type"] == "backend_unavailable", lost.text
    assert "retry-after" in lost.headers and "send the update again" in lost.json()["error"]["message"]
    counted = {(s.labels["outcome"], s.value) for family in text_string_to_metric_families(metrics.text)
               for s in family.samples if s.name == "packscore_weights_updates_total" and s.value}
    assert counted == {("backend_unavailable", 1.0)}, sorted(counted)
    assert not record.exists() or "v2" not in record.read_text(), record.read_text()
    assert after.json()["weights_version"] == FAKE_VERSION


def test_an_update_says_it_still_runs_while_it_loads_and_nothing_once_it_ended(tmp_path, monkeypatch, caplog):
    """A large checkpoint's read takes a minute (minutes from a network disk): between "weights update of NAME
    from DIR" and "NAME now serves V" the log says "still updating NAME" every ``still_lines.EVERY_S``, as a
    load's and a restore's do, and nothing after the update ended."""
    import model_runtime.still_lines as still_lines

    every_s = 0.1
    monkeypatch.setattr(still_lines, "EVERY_S", every_s)
    caplog.set_level(logging.INFO, logger="service.http.weights")
    root = make_weights_root(tmp_path)
    load_gate = threading.Event()
    backends = two_models(load_gate=load_gate)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "service.http.weights"]

    async def main():
        async with running_app(create_app(Settings(weights_root=root), backends)) as client:
            update = asyncio.create_task(client.post("/v1/weights", json={"model": "policy", "path": "step-1",
                                                                          "version": "v2"}))
            await wait_until(lambda: backends["policy"]._updating.locked())
            await asyncio.sleep(3.5 * every_s)
            load_gate.set()
            answer = await update
            at_end = said()
            await asyncio.sleep(4 * every_s)  # a line past the end would have come by now
            return answer, at_end, said()

    answer, at_end, lines = asyncio.run(main())
    assert answer.status_code == 200, answer.text
    assert lines == at_end, lines  # none once it ended
    assert lines[0].startswith("weights update of policy from "), lines
    assert lines[1:3] == ["still updating policy: 0.1 s", "still updating policy: 0.2 s"], lines
    assert lines[-1].startswith("policy now serves v2 (was "), lines
