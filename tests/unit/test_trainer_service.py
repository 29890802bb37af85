"""Following the trainer with the fake backend: several models, POST /v1/weights, version pins
(API.md "POST /v1/weights", "Several models in one deployment"); rollout mismatch is in
test_rollout_mismatch.py."""

import asyncio
import json
import math
import os
import threading

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.scoring.checkpoint import CheckpointError
from model_runtime.types import SequenceInput
from service.http.app import create_app
from service.settings import Settings, parse_model_specs
from service.testing import FAKE_VERSION, FakeBackend, expected_scores, running_app, wait_until

SEQ = {"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}
KEY, ADMIN = "score-key", "admin-key"


@pytest.fixture(autouse=True)
def _no_packscore_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PACKSCORE_"):
            monkeypatch.delenv(name)


def _two(**fake):
    return {"policy": FakeBackend(name="policy-ckpt", **fake), "ref": FakeBackend(name="ref-ckpt", vocab_size=500)}


def _score(body: dict, **extra) -> dict:
    return {"sequences": [SEQ], **extra, **body}


def _expected(seq: dict, generation: int = 0) -> np.ndarray:
    return expected_scores(SequenceInput(np.array(seq["input_ids"]), seq["score_from"]), generation).logprobs


def _root(tmp_path):
    root = tmp_path / "root"
    for step in ("step-1", "step-2"):
        (root / step).mkdir(parents=True)
        (root / step / "model.safetensors").write_bytes(step.encode())
    return root


# ---- several models --------------------------------------------------------------------------


def test_model_specs_forms():
    assert parse_model_specs("tiny") == {None: "tiny"}
    assert parse_model_specs("policy=/ckpt/p, ref=tiny") == {"policy": "/ckpt/p", "ref": "tiny"}
    assert parse_model_specs('{"policy": "/ckpt/p", "ref": "tiny"}') == {"policy": "/ckpt/p", "ref": "tiny"}
    assert parse_model_specs('["policy=/ckpt/p", "ref=tiny"]') == {"policy": "/ckpt/p", "ref": "tiny"}
    for bad, why in (("a=tiny,tiny", "name each"), ("a=tiny,a=x", "twice"), ("a=", "expected"), ("=x", "expected")):
        with pytest.raises(ValueError, match=why):
            parse_model_specs(bad)


def test_a_named_checkpoint_directory_holding_a_comma_is_one_model(tmp_path, monkeypatch):
    """``--model NAME=DIR`` names one model when DIR (a sweep's run directory, say) holds "," and
    "=": it is not split into a second model named by the text after the comma."""
    from service import cli

    run = tmp_path / "lr=1e-5,bs=64"
    run.mkdir()
    assert parse_model_specs(f"policy={run}") == {"policy": str(run)}
    assert cli.parse_settings(["serve", "--model", f"policy={run}"])[1].model_specs() == {"policy": str(run)}
    monkeypatch.setenv("PACKSCORE_MODEL", f"policy={run}")
    assert cli.parse_settings(["serve"])[1].model_specs() == {"policy": str(run)}
    # several, one of them such a directory: the repeated option, or JSON in the environment
    both = {"policy": str(run), "ref": "tiny"}
    assert cli.parse_settings(["serve", "--model", f"policy={run}", "--model", "ref=tiny"])[1].model_specs() == both
    assert parse_model_specs(json.dumps(both)) == both


def test_repeated_model_option_and_environment(monkeypatch):
    from service import cli

    settings = cli.parse_settings(["serve", "--model", "policy=tiny", "--model", "ref=tiny"])[1]
    assert settings.model_specs() == {"policy": "tiny", "ref": "tiny"}
    assert cli.parse_settings(["serve", "--model", "tiny"])[1].model_specs() == {None: "tiny"}
    monkeypatch.setenv("PACKSCORE_MODEL", "policy=tiny,ref=tiny")
    assert cli.parse_settings(["serve"])[1].model_specs() == {"policy": "tiny", "ref": "tiny"}
    with pytest.raises(ValueError, match="served-model-name"):
        Settings(model="a=tiny,b=tiny", served_model_name="x")


def test_a_request_picks_its_model_and_models_never_share_a_row():
    backends = _two()

    async def main():
        async with running_app(create_app(Settings(), backends)) as client:
            return {
                "omitted": await client.post("/score", json=_score({})),
                "unknown": await client.post("/score", json=_score({"model": "nope"})),
                "policy": await client.post("/score", json=_score({"model": "policy"})),
                "ref": await client.post("/score", json=_score({"model": "ref"})),
                "ref-vocab": await client.post("/score", json={"model": "ref", "sequences": [{"input_ids": [1, 600]}]}),
                "policy-vocab": await client.post("/score", json={"model": "policy", "sequences": [{"input_ids": [1, 600]}]}),
                "models": await client.get("/v1/models"),
                "ready": await client.get("/readyz"),
            }

    out = asyncio.run(main())
    assert out["omitted"].status_code == 422 and out["omitted"].json()["error"]["type"] == "model_required"
    assert out["omitted"].json()["error"]["param"] == "model"
    assert out["unknown"].status_code == 404 and out["unknown"].json()["error"]["type"] == "model_not_found"
    for name in ("policy", "ref"):
        assert out[name].status_code == 200 and out[name].json()["model"] == name
    assert out["ref-vocab"].status_code == 422  # each model checks ids against its own vocabulary
    assert out["policy-vocab"].status_code == 200
    assert [m["id"] for m in out["models"].json()["data"]] == ["policy", "ref"]
    assert out["ready"].json()["models"] == ["policy", "ref"]
    model_limits = out["ready"].json()["model_limits"]
    assert sorted(model_limits) == ["policy", "ref"] and all("max_model_len" in lim for lim in model_limits.values())
    # every row a backend saw came from requests for it: the policy saw its two, the ref one
    assert sum(len(r) for r in backends["policy"].rows[1:]) == 2  # rows[0] is the readiness pass
    assert sum(len(r) for r in backends["ref"].rows[1:]) == 1


def test_models_share_the_forward_slots_and_the_admission_bound():
    gate = threading.Event()
    backends = {"policy": FakeBackend(gate=gate), "ref": FakeBackend(gate=gate)}
    settings = Settings(max_queued_tokens=12, max_wait_ms=0, max_admission_wait_s=0)  # 429 at once, not after a wait

    async def main():
        gate.set()
        async with running_app(create_app(settings, backends)) as client:
            gate.clear()
            first = asyncio.create_task(client.post("/score", json=_score({"model": "policy"})))
            second = asyncio.create_task(client.post("/score", json=_score({"model": "ref"})))
            await wait_until(lambda: backends["policy"].running + backends["ref"].running == 1)
            await asyncio.sleep(0.05)
            running_together = backends["policy"].running + backends["ref"].running
            # 8 tokens admitted across both models: 8 more would pass the shared bound of 12
            full = await client.post("/score", json={"model": "ref", "sequences": [SEQ, SEQ]})
            gate.set()
            return running_together, full, await first, await second

    running_together, full, first, second = asyncio.run(main())
    assert running_together == 1, "two models ran forwards at once on one device"
    assert full.status_code == 429, full.text
    assert first.status_code == 200 and second.status_code == 200


# ---- POST /v1/weights ------------------------------------------------------------------------


def test_weights_route_is_absent_without_a_root():
    async def main():
        async with running_app(create_app(Settings(), FakeBackend())) as client:
            return await client.post("/v1/weights", json={"path": "x"}), await client.get("/openapi.json")

    response, openapi = asyncio.run(main())
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found"
    assert "/v1/weights" not in openapi.json()["paths"]


def test_an_update_swaps_the_version_and_the_numbers(tmp_path):
    root = _root(tmp_path)
    backends = _two()

    async def main():
        async with running_app(create_app(Settings(weights_root=root), backends)) as client:
            before = await client.post("/score", json=_score({"model": "policy"}))
            update = await client.post("/v1/weights", json={"model": "policy", "path": "step-1", "version": "step-1"})
            after = await client.post("/score", json=_score({"model": "policy"}))
            ref = await client.post("/score", json=_score({"model": "ref"}))
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
    np.testing.assert_allclose(after.json()["results"][0]["logprobs"], _expected(SEQ, 1), rtol=0, atol=1e-6)
    assert ref.json()["weights_version"] == FAKE_VERSION  # the other model is untouched
    np.testing.assert_allclose(ref.json()["results"][0]["logprobs"], _expected(SEQ, 0), rtol=0, atol=1e-6)
    assert hashed.status_code == 200 and hashed.json()["weights_version"].startswith("xxh3-")
    versions = {m["id"]: m["weights_version"] for m in models.json()["data"]}
    assert versions == {"policy": hashed.json()["weights_version"], "ref": FAKE_VERSION}
    info = {s.labels["model"]: s.labels["weights_version"] for f in text_string_to_metric_families(metrics.text)
            if f.name in ("packscore_model", "packscore_model_info") for s in f.samples}
    assert info == versions
    assert 'packscore_weights_updates_total{model="policy",outcome="ok"} 2.0' in metrics.text


def test_every_path_escape_is_forbidden(tmp_path):
    root = _root(tmp_path)
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

    refused, missing, inside, unknown = asyncio.run(main())
    for path, response in refused.items():
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["type"] == "forbidden_path" and response.json()["error"]["param"] == "path"
    for response in missing:
        assert response.status_code == 422 and response.json()["error"]["param"] == "path", response.text
    assert inside.status_code == 200, inside.text  # a symlink that stays inside the root is fine
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found"


def test_a_refused_checkpoint_changes_nothing(tmp_path):
    root = _root(tmp_path)

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
            after = await client.post("/score", json=_score({}))
            return incomplete, incompatible, after

    incomplete, incompatible, after = asyncio.run(main())
    assert incomplete.status_code == 422 and incomplete.json()["error"]["type"] == "incomplete_checkpoint"
    assert "lm_head.weight" in incomplete.json()["error"]["message"]
    assert incompatible.status_code == 422 and incompatible.json()["error"]["type"] == "incompatible_checkpoint"
    assert "lm_head.weight" in incompatible.json()["error"]["message"]
    assert after.json()["weights_version"] == FAKE_VERSION
    np.testing.assert_allclose(after.json()["results"][0]["logprobs"], _expected(SEQ, 0), rtol=0, atol=1e-6)


def test_an_unreadable_checkpoint_is_422_and_memory_503(tmp_path):
    root = _root(tmp_path)

    def check(path):
        if path.name == "step-1":
            raise OSError("model.safetensors: unexpected end of file")
        raise RuntimeError("CUDA out of memory. Tried to allocate 18.00 GiB")

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend(check_checkpoint=check))) as client:
            return (await client.post("/v1/weights", json={"path": "step-1"}),
                    await client.post("/v1/weights", json={"path": "step-2"}),
                    await client.post("/score", json=_score({})))

    unreadable, memory, after = asyncio.run(main())
    assert unreadable.status_code == 422 and unreadable.json()["error"]["type"] == "unreadable_checkpoint"
    assert memory.status_code == 503 and "retry-after" in memory.headers
    assert after.json()["weights_version"] == FAKE_VERSION


def test_a_second_update_of_the_same_model_is_409_and_readiness_holds_during_a_load(tmp_path):
    root = _root(tmp_path)
    load_gate = threading.Event()
    backends = _two(load_gate=load_gate)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), backends)) as client:
            first = asyncio.create_task(client.post("/v1/weights", json={"model": "policy", "path": "step-1"}))
            await wait_until(lambda: backends["policy"]._updating.locked())
            second = await client.post("/v1/weights", json={"model": "policy", "path": "step-2"})
            # a body wrong in itself is 422 whatever the model's state
            reserved = await client.post("/v1/weights", json={"model": "policy", "path": "step-2", "version": "xxh3-0"})
            ready = await client.get("/readyz")
            served = await client.post("/score", json=_score({"model": "policy"}))
            load_gate.set()
            return second, reserved, ready, served, await first

    second, reserved, ready, served, first = asyncio.run(main())
    assert second.status_code == 409 and second.json()["error"]["type"] == "update_in_progress"
    assert reserved.status_code == 422 and reserved.json()["error"]["param"] == "version", reserved.text
    assert ready.status_code == 200
    assert served.status_code == 200 and served.json()["weights_version"] == FAKE_VERSION
    assert first.status_code == 200


def test_the_admin_key_guards_updates_and_the_scoring_key_is_refused(tmp_path):
    root = _root(tmp_path)
    settings = Settings(weights_root=root, api_key=KEY, admin_key=ADMIN)
    body = {"path": "step-1", "version": "v2"}

    async def main():
        async with running_app(create_app(settings, FakeBackend())) as client:
            bearer = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
            return {
                "none": await client.post("/v1/weights", json=body),
                "scoring-key": await client.post("/v1/weights", json=body, headers=bearer(KEY)),
                "admin-on-score": await client.post("/score", json=_score({}), headers=bearer(ADMIN)),
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
    root = _root(tmp_path)

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


# ---- versions: pins and swaps in the middle of a request ------------------------------------


def test_a_pin_is_served_exactly_or_409(tmp_path):
    root = _root(tmp_path)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend())) as client:
            pinned = await client.post("/score", json=_score({"weights_version": FAKE_VERSION}))
            await client.post("/v1/weights", json={"path": "step-1", "version": "v2"})
            stale = await client.post("/score", json=_score({"weights_version": FAKE_VERSION}))
            current = await client.post("/score", json=_score({"weights_version": "v2"}))
            return pinned, stale, current

    pinned, stale, current = asyncio.run(main())
    assert pinned.status_code == 200 and pinned.json()["weights_version"] == FAKE_VERSION
    error = stale.json()["error"]
    assert stale.status_code == 409 and error["type"] == "weights_version_mismatch" and "'v2'" in error["message"]
    assert error["param"] == "weights_version"
    assert current.status_code == 200 and current.json()["weights_version"] == "v2"


@pytest.mark.parametrize("pin", [None, FAKE_VERSION], ids=["unpinned", "pinned"])
def test_a_swap_between_the_rows_of_a_request(tmp_path, pin):
    """Two sequences in two rows; the weights change while the first is in its forward. Unpinned:
    the first is scored again, and the answer names the new version for both. Pinned: 409."""
    root = _root(tmp_path)
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

    update, response = asyncio.run(main())
    assert update.status_code == 200
    if pin is not None:
        assert response.status_code == 409 and response.json()["error"]["type"] == "weights_version_mismatch"
        return
    assert response.status_code == 200, response.text
    assert response.json()["weights_version"] == "v2"
    for seq, result in zip(seqs, response.json()["results"]):
        np.testing.assert_allclose(result["logprobs"], _expected(seq, 1), rtol=0, atol=1e-6)
    assert [len(r) for r in backend.rows[1:]] == [1, 1, 1]  # a, b, then a again


def test_swaps_landing_faster_than_a_request_is_scored_never_fail_it(tmp_path):
    """Six one-sequence rows (about 0.25 s a pass) while updates land every 20 ms: each pass
    straddles swaps. The request still ends with one version (its second re-score holds the next
    update off), and every update still succeeds."""
    root = _root(tmp_path)
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
        np.testing.assert_allclose(result["logprobs"], _expected(seq, generation), rtol=0, atol=1e-6)


def test_a_version_names_one_set_of_weights(tmp_path):
    """A version the model served (now or before) is refused for new weights: a request pinned to
    it must never get other numbers under that name. Refusals are counted, path ones included."""
    root = _root(tmp_path)

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
            return answers, await client.post("/score", json=_score({"weights_version": "L"})), await client.get("/metrics")

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
            if s.name.endswith("_total"):
                counted[s.labels["outcome"]] = counted.get(s.labels["outcome"], 0.0) + s.value
    assert counted == {"ok": 2.0, "version_in_use": 2.0, "forbidden_path": 1.0, "invalid_value": 9.0}, counted
    labels = {s.labels["model"] for f in text_string_to_metric_families(metrics.text)
              for s in (f.samples if f.name == "packscore_weights_updates" else ())}
    assert labels == {FakeBackend().info.name}, labels  # a refused body counts under the model it names


def test_an_update_repeated_after_a_lost_answer_gets_the_first_answer(tmp_path):
    """A trainer that lost the answer sends the same update again: while that version still
    serves the same files it gets the first answer and nothing reloads; files rewritten under the
    same version name, or the name for another directory, are new weights: 409."""
    root = _root(tmp_path)
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


def test_a_checkpoint_packscore_cannot_load_is_incompatible(tmp_path):
    """API.md names two refusals of a checkpoint's content: another model_type, a quantization or
    no safetensors at all is not the served model's checkpoint: 422 incompatible_checkpoint."""
    root = _root(tmp_path)

    def check(path):
        raise CheckpointError("unsupported", f"{path.name}: model_type 'llama' is not supported")

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend(check_checkpoint=check))) as client:
            return await client.post("/v1/weights", json={"path": "step-1"})

    refused = asyncio.run(main())
    error = refused.json()["error"]
    assert refused.status_code == 422 and error["type"] == "incompatible_checkpoint" and error["param"] == "path", error
    assert "llama" in error["message"], error


def test_openapi_documents_the_new_fields(tmp_path):
    async def main():
        async with running_app(create_app(Settings(weights_root=tmp_path), _two())) as client:
            return (await client.get("/openapi.json")).json()

    schema = asyncio.run(main())
    components = schema["components"]["schemas"]
    assert "rollout_logprobs" in components["SequenceIn"]["properties"]
    assert "weights_version" in components["ScoreRequest"]["properties"]
    assert components["ScoreRequest"]["properties"]["model"]["anyOf"][0]["enum"] == ["policy", "ref"]
    assert set(components["Mismatch"]["properties"]) == {"mean_abs_diff", "max_abs_diff", "k3_kl"}
    assert set(schema["paths"]["/v1/weights"]["post"]["responses"]) >= {"200", "403", "404", "409", "422"}
    assert "WeightsRequest" in components and "WeightsResponse" in components


# ---- the client ------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_client_updates_weights_pins_versions_and_sends_rollouts(tmp_path, encoding):
    import httpx

    from service.client import AsyncScoreClient, ScoreError

    root = _root(tmp_path)
    settings = Settings(weights_root=root, api_key=KEY, admin_key=ADMIN)
    rollout = _expected(SEQ) + np.float32(0.5)

    async def main():
        app = create_app(settings, _two())
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
    np.testing.assert_allclose(pinned[0].logprobs, _expected(SEQ, 1), rtol=0, atol=1e-6)
    assert (stale.status, stale.type) == (409, "weights_version_mismatch")
    assert (escape.status, escape.type) == (403, "forbidden_path")
    assert no_admin.status == 403


def test_a_sequence_too_long_for_the_model_named_gets_that_models_limits():
    """413 tells a client the limits to split under: those of the model it named, not the first's."""
    backends = {"policy": FakeBackend(name="policy-ckpt", max_model_len=64), "ref": FakeBackend(name="ref-ckpt", max_model_len=128)}

    async def main():
        async with running_app(create_app(Settings(), backends)) as client:
            return {name: await client.post("/score", json={"model": name, "sequences": [{"input_ids": [1] * 200}]})
                    for name in backends}

    for name, answer in asyncio.run(main()).items():
        want = str(backends[name].info.max_model_len)
        assert answer.status_code == 413 and answer.headers["X-Packscore-Max-Model-Len"] == want, \
            f"{name}: {answer.status_code} {dict(answer.headers)}, want X-Packscore-Max-Model-Len {want}"
        assert want in answer.json()["error"]["message"], answer.text
