"""``--weights-record``: the last update of each model written atomically, restored at start
(docs/weights.md "Surviving a restart"). With the fake backend; tests/e2e/test_e2e_weights_record.py
restarts real servers."""

import asyncio
import json
import logging
import os

import numpy as np
import pytest

from service import cli
from service.http.app import create_app
from service.settings import Settings
from service.testing import FAKE_VERSION, FakeBackend, running_app, wait_until
from service.weights_record import RecordError, WeightsRecord, write_atomically
from tests.unit.trainer_service import SEQ, expected_logprobs, make_weights_root

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def _settings(tmp_path, model: str = "policy=/ckpt/base,ref=/ckpt/ref") -> Settings:
    return Settings(model=model, weights_root=make_weights_root(tmp_path), weights_record=tmp_path / "state" / "record.json")


def _backends():
    return {"policy": FakeBackend(name="policy-ckpt"), "ref": FakeBackend(name="ref-ckpt")}


def _run(settings: Settings, requests):
    """Starts a fresh app on fresh backends (a restarted process), sends ``requests`` (path, body or
    None for GET), returns the service and the answers."""
    app = create_app(settings, _backends())

    async def main():
        async with running_app(app) as client:
            out = []
            for path, body in requests:
                out.append(await (client.get(path) if body is None else client.post(path, json=body)))
            return out

    return app.state.service, asyncio.run(main())


def _record(settings: Settings) -> dict:
    return json.loads(settings.weights_record.read_text())


# ---- the write --------------------------------------------------------------------------------


def test_the_write_replaces_the_file_whole_and_keeps_every_other_model(tmp_path, monkeypatch):
    root = make_weights_root(tmp_path)
    file = tmp_path / "record.json"
    old = {"format": 1, "models": {"other": {"model": "/x", "path": "p", "version": "v"}}}
    file.write_text(json.dumps(old))
    record = WeightsRecord.open(file, root, {"policy": "/ckpt/base"})
    seen_before_rename = []
    real_replace = os.replace

    def replace(src, dst):  # what a reader sees at the last moment before the rename: the old file, whole
        seen_before_rename.append((json.loads(file.read_text()), json.loads(open(src).read())))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    files = (("model.safetensors", 6, 1),)
    assert record.write("policy", "policy", root / "step-1", "v1", files)
    (before, written), = seen_before_rename
    assert before == old
    assert written == json.loads(file.read_text()) == {"format": 1, "models": {
        "other": {"model": "/x", "path": "p", "version": "v"},
        "policy": {"model": "/ckpt/base", "path": "step-1", "version": "v1", "files": [["model.safetensors", 6, 1]]}}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "root"]  # no temporary file left


def test_a_failed_write_leaves_the_old_record_and_no_temporary_file(tmp_path, monkeypatch, caplog):
    file = tmp_path / "record.json"
    write_atomically(file, b'{"format": 1, "models": {}}\n')
    record = WeightsRecord.open(file, make_weights_root(tmp_path), {None: "/ckpt/base"})

    def no_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_disk)
    with caplog.at_level(logging.ERROR, logger="service.weights_record"):
        assert not record.write("policy", None, tmp_path / "root" / "step-1", "v1", None)
    assert file.read_text() == '{"format": 1, "models": {}}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "root"]
    assert str(file) in caplog.text and "No space left on device" in caplog.text and "the update stands" in caplog.text


@pytest.mark.parametrize("content, reason", [
    ("{not json", "is no JSON record"),
    ('{"format": 2, "models": {}}', "is no record of format 1"),
    ('{"format": 1, "models": {"policy": {"model": "/b", "path": "s"}}}', "the entry of 'policy' needs the strings"),
    ('{"format": 1, "models": {"policy": {"model": "/b", "path": "s", "version": "v", "files": [1]}}}', "files"),
], ids=["no-json", "format", "no-version", "files"])
def test_a_record_that_cannot_be_parsed_is_refused_naming_the_file_and_the_remedy(tmp_path, content, reason):
    file = tmp_path / "record.json"
    file.write_text(content)
    with pytest.raises(RecordError) as refused:
        WeightsRecord.open(file, tmp_path, {None: "tiny"})
    message = str(refused.value)
    assert str(file) in message and reason in message and f"delete {file} to serve --model" in message, message


# ---- start-time refusals (the CLI, before anything loads) ------------------------------------------


@pytest.mark.parametrize("case", ["no-root", "no-directory", "a-directory", "corrupt"])
def test_the_cli_refuses_a_record_it_could_not_keep_or_read(tmp_path, capsys, case):
    root, record = make_weights_root(tmp_path), tmp_path / "record.json"
    argv = ["serve", "--weights-root", str(root), "--weights-record", str(record)]
    if case == "no-root":
        argv = ["serve", "--weights-record", str(record)]
        want = "which need --weights-root DIR"
    elif case == "no-directory":
        argv[-1] = str(tmp_path / "absent" / "record.json")
        want = "does not exist"
    elif case == "a-directory":
        record.mkdir()
        want = "is not a regular file"
    else:
        record.write_text('{"format": 1, "models": ')
        want = "is no JSON record"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("packscore: error: ") and "--weights-record" in err and want in err, err


# ---- restored at start ------------------------------------------------------------------------


def test_a_restarted_service_serves_the_recorded_update_and_keeps_the_other_models(tmp_path, caplog):
    settings = _settings(tmp_path)
    settings.weights_record.parent.mkdir()
    update = {"model": "policy", "path": "step-1", "version": "step-1"}
    _, (answer,) = _run(settings, [("/v1/weights", update)])
    assert answer.status_code == 200, answer.text
    assert _record(settings)["models"]["policy"] | {"files": None} == {
        "model": "/ckpt/base", "path": "step-1", "version": "step-1", "files": None}

    with caplog.at_level(logging.INFO):
        service, (policy, ref, models, again) = _run(settings, [
            ("/score", {"model": "policy", "sequences": [SEQ]}), ("/score", {"model": "ref", "sequences": [SEQ]}),
            ("/v1/models", None), ("/v1/weights", update)])
    assert policy.json()["weights_version"] == "step-1"
    np.testing.assert_allclose(policy.json()["results"][0]["logprobs"], expected_logprobs(SEQ, 1), rtol=0, atol=1e-6)
    assert ref.json()["weights_version"] == FAKE_VERSION
    assert {m["id"]: m["weights_version"] for m in models.json()["data"]} == {"policy": "step-1", "ref": FAKE_VERSION}
    assert again.status_code == 200, again.text  # a retry of the recorded update: its answer, not 409 version_in_use
    assert f"policy serves version step-1 from {settings.weights_root / 'step-1'}" in caplog.text
    assert str(settings.weights_record) in caplog.text


def test_an_entry_for_another_model_source_is_ignored_and_dropped_and_an_unserved_ones_kept(tmp_path, caplog):
    settings = _settings(tmp_path)
    settings.weights_record.parent.mkdir()
    settings.weights_record.write_text(json.dumps({"format": 1, "models": {
        "policy": {"model": "/ckpt/old-base", "path": "step-1", "version": "step-1"},
        "gone": {"model": "/ckpt/gone", "path": "step-2", "version": "g"}}}))
    with caplog.at_level(logging.WARNING):
        _, (policy, update) = _run(settings, [("/score", {"model": "policy", "sequences": [SEQ]}),
                                              ("/v1/weights", {"model": "ref", "path": "step-2", "version": "r2"})])
    assert policy.json()["weights_version"] == FAKE_VERSION
    assert "/ckpt/old-base" in caplog.text and "/ckpt/base" in caplog.text and "'gone'" in caplog.text
    assert update.status_code == 200, update.text
    assert set(_record(settings)["models"]) == {"gone", "ref"}  # policy's stale entry dropped, gone's kept


@pytest.mark.parametrize("case", ["deleted", "escapes", "changed", "refused", "load-error"])
def test_a_recorded_checkpoint_that_cannot_be_served_waits_for_an_update_not_ready(tmp_path, case, caplog):
    """The model never scores with --model's weights: the process waits, not ready, with the reason on
    /readyz, /score's 503 and /v1/models, until an update of it succeeds; a failed one leaves it waiting."""
    settings = _settings(tmp_path, "/ckpt/base")
    root = settings.weights_root
    settings.weights_record.parent.mkdir()
    entry = {"model": "/ckpt/base", "path": "step-1", "version": "v1"}
    if case == "deleted":
        entry["path"] = "step-9"
    elif case == "escapes":
        entry["path"] = "../state"
    elif case == "changed":
        entry["files"] = [["model.safetensors", 6, 1]]
    settings.weights_record.write_text(json.dumps({"format": 1, "models": {"policy-ckpt": entry}}))

    def check(path):
        from model_runtime.scoring.checkpoint import CheckpointError

        if path.name == "step-1" and case == "refused":
            raise CheckpointError("incompatible", f"{path.name}: layers.0 has shape [4, 4], the model [8, 8]")
        if path.name == "step-1" and case == "load-error":
            raise OSError(5, "Input/output error")

    app = create_app(settings, FakeBackend(name="policy-ckpt", check_checkpoint=check))
    service = app.state.service

    async def main():
        async with running_app(app, ready=False) as client:
            await wait_until(lambda: service.phase in ("awaiting_weights", "ready", "failed"))
            waiting = [await client.get("/readyz"), await client.post("/score", json={"sequences": [SEQ]}),
                       await client.get("/v1/models"), await client.get("/metrics")]
            failed = await client.post("/v1/weights", json={"path": "step-9", "version": "v9"})
            still = [service.phase, await client.get("/readyz")]
            update = await client.post("/v1/weights", json={"path": "step-2", "version": "v2"})
            await wait_until(lambda: service.phase in ("ready", "failed"))
            after = [await client.get("/readyz"), await client.post("/score", json={"sequences": [SEQ]}),
                     await client.get("/v1/models"), await client.get("/metrics")]
            return waiting, failed, still, update, after

    with caplog.at_level(logging.INFO):
        (readyz, score, models, metrics), failed, still, update, after = asyncio.run(main())
    want = {"deleted": "is not a directory", "escapes": "climbs out", "refused": "layers.0 has shape",
            "changed": "its files changed since it was recorded", "load-error": "Input/output error"}[case]
    summary = {"deleted": "it is no directory under --weights-root", "escapes": "it leaves --weights-root",
               "refused": "the checkpoint was refused (incompatible_checkpoint)", "load-error": "loading it failed",
               "changed": "its files changed since it was recorded"}[case]
    assert service.fatal_error is None, service.fatal_error
    # the log: one ERROR paragraph naming the file, the model, the entry, the reason and both remedies
    (paragraph,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "weights-record" in r.getMessage()]
    assert str(settings.weights_record) in paragraph and "'policy-ckpt'" in paragraph and want in paragraph, paragraph
    assert str(root) in paragraph and f"'{entry['path']}'" in paragraph and "'v1'" in paragraph, paragraph
    assert "POST /v1/weights" in paragraph and f"delete {settings.weights_record} and restart to serve --model " \
        "/ckpt/base" in paragraph, paragraph
    # while it waits
    assert readyz.status_code == 503 and readyz.json()["status"] == "awaiting_weights", readyz.text
    message = readyz.json()["error"]["message"]
    assert "'policy-ckpt'" in message and summary in message and str(root) not in message, message
    assert score.status_code == 503 and score.json()["error"]["type"] == "not_ready", score.text
    assert score.headers["retry-after"] == "5"
    message = score.json()["error"]["message"]
    assert "'policy-ckpt'" in message and want in message and "POST /v1/weights" in message, message
    (card,) = models.json()["data"]
    assert card["awaiting_weights"]["version"] == "v1" and want in card["awaiting_weights"]["reason"], card
    assert "packscore_ready 0.0" in metrics.text
    assert 'packscore_weights_awaited{model="policy-ckpt"} 1.0' in metrics.text
    # a failed update leaves it waiting
    assert failed.status_code == 422, failed.text
    assert still[0] == "awaiting_weights" and still[1].json()["status"] == "awaiting_weights", still[1].text
    # the update it waits for: recorded, then ready, scoring exactly those weights
    assert update.status_code == 200, update.text
    assert update.json()["weights_version"] == "v2" and update.json()["previous_version"] == FAKE_VERSION
    readyz, score, models, metrics = after
    assert readyz.status_code == 200, readyz.text
    assert score.status_code == 200 and score.json()["weights_version"] == "v2", score.text
    np.testing.assert_allclose(score.json()["results"][0]["logprobs"], expected_logprobs(SEQ, 1), rtol=0, atol=1e-6)
    (card,) = models.json()["data"]
    assert card["weights_version"] == "v2" and "awaiting_weights" not in card, card
    assert "packscore_ready 1.0" in metrics.text and 'packscore_weights_awaited{model="policy-ckpt"} 0.0' in metrics.text
    assert _record(settings)["models"]["policy-ckpt"]["path"] == "step-2"


def test_only_the_withheld_model_is_awaited_and_the_process_is_ready_once_it_is_updated(tmp_path):
    """With two served models, one withheld: the whole process waits (readiness is the process's), an
    update of the other model is served meanwhile, and the withheld one's update makes it ready."""
    settings = _settings(tmp_path)
    settings.weights_record.parent.mkdir()
    settings.weights_record.write_text(json.dumps({"format": 1, "models": {
        "policy": {"model": "/ckpt/base", "path": "step-9", "version": "v9"}}}))
    app = create_app(settings, _backends())
    service = app.state.service

    async def main():
        async with running_app(app, ready=False) as client:
            await wait_until(lambda: service.phase in ("awaiting_weights", "ready", "failed"))
            ref_score = await client.post("/score", json={"model": "ref", "sequences": [SEQ]})
            ref_update = await client.post("/v1/weights", json={"model": "ref", "path": "step-1", "version": "r1"})
            phase = service.phase
            policy = await client.post("/v1/weights", json={"model": "policy", "path": "step-2", "version": "p2"})
            await wait_until(lambda: service.phase in ("ready", "failed"))
            return ref_score, ref_update, phase, policy, await client.post("/score", json={"model": "ref", "sequences": [SEQ]})

    ref_score, ref_update, phase, policy, ref_after = asyncio.run(main())
    assert ref_score.status_code == 503 and "'policy'" in ref_score.json()["error"]["message"], ref_score.text
    assert ref_update.status_code == 200, ref_update.text
    assert phase == "awaiting_weights"
    assert policy.status_code == 200, policy.text
    assert ref_after.status_code == 200 and ref_after.json()["weights_version"] == "r1", ref_after.text
    assert {n: e["version"] for n, e in _record(settings)["models"].items()} == {"policy": "p2", "ref": "r1"}


def test_a_record_that_cannot_be_written_leaves_the_update_standing_and_is_counted(tmp_path, monkeypatch, caplog):
    import service.weights_record as weights_record

    settings = _settings(tmp_path)
    settings.weights_record.parent.mkdir()

    def read_only(file, data):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(weights_record, "write_atomically", read_only)
    with caplog.at_level(logging.ERROR):
        _, (update, after, metrics) = _run(settings, [("/v1/weights", {"model": "policy", "path": "step-1"}),
                                                      ("/score", {"model": "policy", "sequences": [SEQ]}),
                                                      ("/metrics", None)])
    assert update.status_code == 200, update.text
    assert after.json()["weights_version"] == update.json()["weights_version"]
    assert 'packscore_weights_record_failures_total{model="policy"} 1.0' in metrics.text
    assert "Read-only file system" in caplog.text and str(settings.weights_record) in caplog.text
    assert not settings.weights_record.exists()


def test_a_write_overtaken_by_a_later_update_leaves_the_later_entry(tmp_path):
    root = make_weights_root(tmp_path)
    file = tmp_path / "record.json"
    record = WeightsRecord.open(file, root, {None: "/ckpt/base"})
    assert record.write("policy", None, root / "step-2", "v2", None, serving=lambda: "v2")
    assert record.write("policy", None, root / "step-1", "v1", None, serving=lambda: "v2")  # v1's write came late
    assert json.loads(file.read_text())["models"]["policy"]["version"] == "v2"
