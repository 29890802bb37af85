"""Several models in one deployment, as a trainer meets them, with the fake backend (API.md
"Several models in one deployment"): the --model forms, a request picks its model, the models
share the forward slots and the admission bound, each answers with its own limits. How a row
waits for another model's forward is in test_several_models.py."""

import asyncio
import json
import threading

import pytest

from service.http.app import create_app
from service.settings import Settings, parse_model_specs
from service.testing import FakeBackend, running_app, wait_until
from tests.unit.trainer_service import SEQ, score_body, two_models

pytestmark = pytest.mark.usefixtures("no_packscore_env")


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
    backends = two_models()

    async def main():
        async with running_app(create_app(Settings(), backends)) as client:
            return {
                "omitted": await client.post("/score", json=score_body({})),
                "unknown": await client.post("/score", json=score_body({"model": "nope"})),
                "policy": await client.post("/score", json=score_body({"model": "policy"})),
                "ref": await client.post("/score", json=score_body({"model": "ref"})),
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
            first = asyncio.create_task(client.post("/score", json=score_body({"model": "policy"})))
            second = asyncio.create_task(client.post("/score", json=score_body({"model": "ref"})))
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
