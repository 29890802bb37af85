"""``--weights-record``: the last update of each model written atomically, restored at start
(docs/weights.md "Surviving a restart"). With the fake backend; tests/e2e/test_e2e_weights_record.py
restarts real servers."""

import asyncio
import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from service import cli
from service.http.app import create_app
from service.settings import Settings
from service.testing import FAKE_VERSION, FakeBackend, running_app, wait_until
from service.weights_record import RecordError, WeightsRecord, write_atomically
from tests.unit.trainer_service import SEQ, expected_logprobs, make_weights_root

pytestmark = pytest.mark.usefixtures("no_packscore_env")

REPO = Path(__file__).resolve().parents[2]


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
        seen_before_rename.append((json.loads(file.read_text()), json.loads(open(src).read()), os.path.basename(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    files = (("model.safetensors", 6, 1),)
    assert record.write("policy", "policy", root / "step-1", "v1", files, requested_at=1700000000.5)
    (before, written, temporary), = seen_before_rename
    assert before == old
    assert written == json.loads(file.read_text()) == {"format": 1, "models": {
        "other": {"model": "/x", "path": "p", "version": "v"},
        "policy": {"model": "/ckpt/base", "path": "step-1", "version": "v1", "requested_at": 1700000000.5,
                   "files": [["model.safetensors", 6, 1]]}}}
    # a temporary name of this host, pid namespace and process: writers on several hosts share the directory
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64]
    assert re.fullmatch(rf"\.record\.json\.{host}\+[0-9a-f]{{8}}\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", temporary), temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "record.json.lock", "root"]  # no temporary


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "record.json.lock", "root"]
    assert str(file) in caplog.text and "No space left on device" in caplog.text and "the update stands" in caplog.text


@pytest.mark.parametrize("content, reason", [
    ("{not json", "is no JSON record"),
    ('{"format": 2, "models": {}}', "is no record of format 1"),
    ('{"format": 1, "models": {"policy": {"model": "/b", "path": "s"}}}', "the entry of 'policy' needs the strings"),
    ('{"format": 1, "models": {"policy": {"model": "/b", "path": "s", "version": "v", "files": [1]}}}', "files"),
    ('{"format": 1, "models": {"policy": {"model": "/b", "path": "s", "version": "v", "requested_at": "now"}}}',
     "has a requested_at that is no time in seconds ('now')"),
], ids=["no-json", "format", "no-version", "files", "requested-at"])
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
    sent = time.time()
    _, (answer,) = _run(settings, [("/v1/weights", update)])
    answered = time.time()
    assert answer.status_code == 200, answer.text
    entry = _record(settings)["models"]["policy"]
    assert entry | {"files": None, "requested_at": None} == {
        "model": "/ckpt/base", "path": "step-1", "version": "step-1", "files": None, "requested_at": None}
    assert sent <= entry["requested_at"] <= answered, (sent, entry["requested_at"], answered)

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
    begun = f"restoring policy from --weights-record {settings.weights_record}: version step-1 from"
    assert caplog.text.index(begun) < caplog.text.index("policy serves version step-1"), caplog.text
    assert str(settings.weights_record) in caplog.text


def test_an_entry_for_another_model_source_is_ignored_and_kept_until_that_model_is_updated(tmp_path, caplog):
    """Kept: servers sharing the record that still run the other --model restore it; this server's
    update of that model replaces it."""
    settings = _settings(tmp_path)
    settings.weights_record.parent.mkdir()
    old = {"model": "/ckpt/old-base", "path": "step-1", "version": "step-1"}
    settings.weights_record.write_text(json.dumps({"format": 1, "models": {
        "policy": old, "gone": {"model": "/ckpt/gone", "path": "step-2", "version": "g"}}}))
    with caplog.at_level(logging.WARNING):
        _, (policy, update) = _run(settings, [("/score", {"model": "policy", "sequences": [SEQ]}),
                                              ("/v1/weights", {"model": "ref", "path": "step-2", "version": "r2"})])
    assert policy.json()["weights_version"] == FAKE_VERSION
    assert "/ckpt/old-base" in caplog.text and "/ckpt/base" in caplog.text and "'gone'" in caplog.text
    assert update.status_code == 200, update.text
    models = _record(settings)["models"]
    assert set(models) == {"policy", "gone", "ref"} and models["policy"] == old  # the other base's, as it was

    _, (update,) = _run(settings, [("/v1/weights", {"model": "policy", "path": "step-1", "version": "p1"})])
    assert update.status_code == 200, update.text
    assert _record(settings)["models"]["policy"] | {"files": None, "requested_at": None} == {
        "model": "/ckpt/base", "path": "step-1", "version": "p1", "files": None, "requested_at": None}


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
        from model_runtime.scoring.checkpoint_error import CheckpointError

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


def _restore_refused_threads(tmp_path, monkeypatch, refusals: int):
    """A start restoring step-1 as v1 whose first ``refusals`` load threads the process's thread limit
    refuses ("can't start new thread"): (the service, /readyz, the version served)."""
    from service import runtime
    from service.load_thread import LOAD_THREAD

    settings = _settings(tmp_path, "/ckpt/base")
    settings.weights_record.parent.mkdir()
    settings.weights_record.write_text(json.dumps({"format": 1, "models": {"policy-ckpt": {
        "model": "/ckpt/base", "path": "step-1", "version": "v1"}}}))
    monkeypatch.setattr(runtime, "_NO_THREAD_BACKOFF_S", (0.01, 0.02, 0.04))
    start, refused = threading.Thread.start, []

    def limited(thread):
        if thread.name == LOAD_THREAD and len(refused) < refusals:
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", limited)
    backend = FakeBackend(name="policy-ckpt")
    app = create_app(settings, backend)

    async def main():
        async with running_app(app, ready=False) as client:
            await wait_until(lambda: app.state.service.phase in ("awaiting_weights", "ready", "failed"), 60)
            return await client.get("/readyz")

    readyz = asyncio.run(main())
    return app.state.service, readyz, backend.info.weights_version


def test_a_restore_whose_load_thread_the_thread_limit_refuses_once_is_tried_again(tmp_path, monkeypatch, caplog):
    """A load thread refused by the process's thread limit says nothing about the checkpoint, yet the
    restore withheld the model at once, not ready until an update came. It is tried again after a pause."""
    with caplog.at_level(logging.WARNING):
        service, readyz, version = _restore_refused_threads(tmp_path, monkeypatch, refusals=1)
    assert readyz.status_code == 200 and version == "v1" and not service.withheld, (readyz.text, version)
    (retried,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "can't start new thread" in retried and "trying again" in retried and "attempt 2 of 4" in retried, retried


def test_a_restore_whose_load_thread_stays_refused_is_withheld_saying_so(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING):
        service, readyz, version = _restore_refused_threads(tmp_path, monkeypatch, refusals=4)
    assert readyz.status_code == 503 and readyz.json()["status"] == "awaiting_weights", readyz.text
    assert "thread limit" in readyz.json()["error"]["message"], readyz.text
    assert "at each of 4 attempts" in service.withheld["policy-ckpt"].reason, service.withheld
    assert len([r for r in caplog.records if "trying again" in r.getMessage()]) == 3


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


# ---- one record shared by several servers (a ReadWriteMany volume) ------------------------------


def _server(file, root) -> WeightsRecord:
    """One server's view of a shared record, opened at its start."""
    return WeightsRecord.open(file, root, {None: "/ckpt/base"})


def test_an_older_update_finishing_after_a_newer_one_leaves_the_newer_entry(tmp_path, caplog):
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    slow, fast = _server(file, root), _server(file, root)  # both started before either update
    assert fast.write("policy", None, root / "step-2", "v2", None, requested_at=200.0)
    with caplog.at_level(logging.INFO, logger="service.weights_record"):
        assert slow.write("policy", None, root / "step-1", "v1", None, requested_at=100.0)  # requested first, done last
    assert _entries(file)["policy"]["version"] == "v2"
    assert "keeps 'step-2' as 'v2', an update requested after this one ('step-1' as 'v1')" in caplog.text
    assert _server(file, root).entry_for("policy", None).version == "v2"  # what a new server restores
    assert slow.write("policy", None, root / "step-1", "v3", None, requested_at=200.0)  # the same time: replaces
    assert _entries(file)["policy"]["version"] == "v3"


def test_a_write_keeps_the_entries_other_servers_wrote_since_it_started(tmp_path):
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    file.write_text(json.dumps({"format": 1, "models": {  # an older record's entry: no requested_at
        "policy": {"model": "/ckpt/base", "path": "step-1", "version": "v1"}}}))
    a, b = _server(file, root), _server(file, root)
    assert a.entry_for("policy", None).requested_at == 0.0
    assert a.write("ref", None, root / "step-2", "r2", None)
    assert b.write("policy", None, root / "step-2", "p2", None)  # b never read ref's entry: kept all the same
    assert {n: e["version"] for n, e in _entries(file).items()} == {"policy": "p2", "ref": "r2"}


def _entries(file) -> dict:
    return json.loads(file.read_text())["models"]


def test_threads_writing_at_once_leave_a_whole_record_with_every_entry_and_the_newest(tmp_path):
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    servers, writes = 6, 15
    times = np.random.default_rng(0).permutation(servers * writes) + 1.0  # policy's updates, in no order
    start = threading.Barrier(servers)

    def serve(k: int) -> None:
        record = _server(file, root)  # a record of its own: fcntl locks alone cannot keep threads apart
        start.wait()
        for i in range(writes):
            at = float(times[k * writes + i])
            assert record.write("policy", None, root / "step-1", f"p{at:g}", None, requested_at=at)
            assert record.write(f"m{k}-{i}", None, root / "step-2", "v", None, requested_at=at)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(servers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = _entries(file)
    assert entries["policy"]["version"] == f"p{times.max():g}", entries["policy"]
    missing = {f"m{k}-{i}" for k in range(servers) for i in range(writes)} - set(entries)
    assert not missing, f"{len(missing)} entries lost: {sorted(missing)[:5]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "record.json.lock", "root"]


_WRITER = """
import sys, time
from pathlib import Path
from service.weights_record import WeightsRecord

file, root, who, writes, start = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
record = WeightsRecord.open(file, root, {None: "/ckpt/base"})
while time.time() < start:
    time.sleep(0.001)
for i in range(writes):
    at = 2.0 * i + who
    assert record.write("policy", None, root / "step-1", f"p{at:g}", None, requested_at=at)
    assert record.write(f"m{who}-{i}", None, root / "step-2", "v", None, requested_at=at)
"""


def _python(*args: str, **options) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, *args], env=env, text=True, **options)


def test_two_processes_writing_at_once_leave_a_whole_record_with_every_entry_and_the_newest(tmp_path):
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    writes, start = 25, time.time() + 2.0  # both started, then writing together
    procs = [_python("-c", _WRITER, str(file), str(root), str(who), str(writes), str(start), stderr=subprocess.PIPE)
             for who in (0, 1)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    entries = _entries(file)
    assert entries["policy"]["version"] == f"p{2 * writes - 1}", entries["policy"]  # process 1's last
    missing = {f"m{who}-{i}" for who in (0, 1) for i in range(writes)} - set(entries)
    assert not missing, f"{len(missing)} entries lost: {sorted(missing)[:5]}"


_HOLDER = """
import fcntl, json, os, sys, time
file, hold_s = sys.argv[1], float(sys.argv[2])
fd = os.open(file + ".lock", os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(hold_s)
entry = {"model": "/ckpt/other", "path": "step-2", "version": "o2", "requested_at": time.time()}
with open(file, "w") as f:  # the holder's write, done just before it lets go
    json.dump({"format": 1, "models": {"other": entry}}, f)
"""


@pytest.mark.parametrize("case", ["released", "stuck"])
def test_a_write_waits_for_the_lock_of_another_process(tmp_path, monkeypatch, caplog, case):
    """Released: the write reads the record after the holder's write, and keeps its entry. Stuck
    (held past LOCK_WAIT_S): the write goes on without the lock, with a WARNING."""
    import service.weights_record as weights_record

    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    record = _server(file, root)
    hold_s = 0.5 if case == "released" else 30
    monkeypatch.setattr(weights_record, "LOCK_WAIT_S", 10.0 if case == "released" else 0.3)
    holder = _python("-c", _HOLDER, str(file), str(hold_s), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "locked"
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="service.weights_record"):
            assert record.write("policy", None, root / "step-1", "p1", None)
        waited = time.monotonic() - began
    finally:
        holder.kill()
        holder.wait()
    if case == "released":
        assert waited >= 0.3, waited
        assert set(_entries(file)) == {"other", "policy"}
        assert not caplog.records, caplog.text
    else:
        assert 0.3 <= waited < 5, waited
        assert set(_entries(file)) == {"policy"}
        assert f"{file}.lock stayed locked by another writer" in caplog.text and "writing without it" in caplog.text


def test_a_filesystem_without_locks_is_said_once_and_written_all_the_same(tmp_path, monkeypatch, caplog):
    import fcntl

    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    record = _server(file, root)

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with caplog.at_level(logging.WARNING, logger="service.weights_record"):
        assert record.write("policy", None, root / "step-1", "p1", None)
        assert record.write("ref", None, root / "step-2", "r2", None)
    (warning,) = caplog.records
    assert "cannot be locked (No locks available)" in warning.getMessage() and str(file) in warning.getMessage()
    assert {n: e["version"] for n, e in _entries(file).items()} == {"policy": "p1", "ref": "r2"}


def test_a_record_renamed_over_by_another_host_while_read_is_read_again(tmp_path, monkeypatch):
    """NFS answers ESTALE to a read of a file another host replaced: the new record is read."""
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    _server(file, root).write("policy", None, root / "step-1", "p1", None)
    real_read, stale = Path.read_bytes, [OSError(errno.ESTALE, "Stale file handle")] * 2

    def read_bytes(path):
        if stale:
            raise stale.pop()
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert _server(file, root).entry_for("policy", None).version == "p1"
