"""A real server restarted with ``--weights-record`` serves the last update, not its ``--model``
(docs/weights.md "Surviving a restart"): killed (SIGKILL, nothing flushed at exit) or stopped,
started again with the same arguments, it answers with the updated version and its numbers; one
whose recorded checkpoint cannot be served waits, not ready, for the next update. Servers sharing
one record hand the last update on to a new server.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest

from service.local_server import _REPO_ROOT
from tests.checkpoints import save_checkpoint
from tests.e2e.helpers import (AUTH, ServerProcess, assert_matches, decode, post, random_sequences, served_versions,
                               wait_status)
from tests.ports import held_port

VOCAB = 512  # tests/checkpoints.py's vocabulary


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The weights root (step-0, step-1, step-2), a reference, and a second base outside the root."""
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    tmp = tmp_path_factory.mktemp("record")
    root = tmp / "root"
    paths = {f"step-{i}": save_checkpoint("qwen3_5", root / f"step-{i}", seed=i) for i in range(3)}
    paths["reference"] = save_checkpoint("qwen3_5", tmp / "reference", seed=7)
    paths["other-base"] = save_checkpoint("qwen3_5", tmp / "other-base", seed=8)
    scorers = {name: Scorer(load_model(str(path)), max_batch_tokens=4096) for name, path in paths.items()}
    return {"tmp": tmp, "root": root, "paths": paths, "scorers": scorers}


def _args(ck: dict, record, policy: str = "step-0") -> list[str]:
    return ["--model", f"policy={ck['paths'][policy]}", "--model", f"ref={ck['paths']['reference']}",
            "--weights-root", str(ck["root"]), "--weights-record", str(record), "--max-batch-tokens", "256",
            "--max-wait-ms", "2"]


def _update(url: str, path: str, version: str | None) -> dict:
    body = {"model": "policy", "path": path, **({"version": version} if version else {})}
    answer = httpx.post(url + "/v1/weights", json=body, headers=AUTH, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _policy_scores(url: str, seqs: list[dict]) -> httpx.Response:
    response = post(url, {"model": "policy", "sequences": seqs})
    assert response.status_code == 200, response.text
    return response


def test_a_killed_then_stopped_server_comes_back_serving_the_last_update(checkpoints, tmp_path):
    ck = checkpoints
    record = tmp_path / "state" / "record.json"
    record.parent.mkdir()
    seqs = random_sequences(np.random.default_rng(3), 4, VOCAB, lengths=(2, 60))

    first = ServerProcess(tmp_path, *_args(ck, record))
    try:
        url = first.wait_ready(timeout=240).url
        base = served_versions(url)
        assert _update(url, "step-1", "step-1")["weights_version"] == "step-1"
        before = _policy_scores(url, seqs)
        first.proc.send_signal(signal.SIGKILL)  # no drain, no exit code: the record is on disk before the 200
        first.proc.wait(timeout=30)
    finally:
        first.stop()

    second = ServerProcess(tmp_path, *_args(ck, record))
    try:
        url = second.wait_ready(timeout=240).url
        assert served_versions(url) == {"policy": "step-1", "ref": base["ref"]}, second.log()
        after = _policy_scores(url, seqs)
        assert after.json()["weights_version"] == "step-1"
        assert after.json()["results"] == before.json()["results"]  # exactly the numbers before the kill
        assert_matches(decode(after, 0), seqs, ck["scorers"]["step-1"])
        assert "policy serves version step-1" in second.log() and str(record) in second.log()
        hashed = _update(url, "step-2", None)["weights_version"]  # a content hash this time
    finally:
        assert second.stop() == 0, second.log()
    assert json.loads(record.read_text())["models"]["policy"]["path"] == "step-2"

    third = ServerProcess(tmp_path, *_args(ck, record))
    try:
        url = third.wait_ready(timeout=240).url
        assert served_versions(url) == {"policy": hashed, "ref": base["ref"]}
        assert_matches(decode(_policy_scores(url, seqs), 0), seqs, ck["scorers"]["step-2"])
    finally:
        assert third.stop() == 0, third.log()


def test_a_new_server_on_a_shared_record_joins_at_the_update_another_server_recorded(checkpoints, tmp_path):
    """Replicas on one record (a ReadWriteMany volume): A records policy's update, B then records
    ref's without losing A's entry, and a new server C starts serving both, policy with exactly
    A's numbers."""
    ck = checkpoints
    record = tmp_path / "shared" / "record.json"
    record.parent.mkdir()
    seqs = random_sequences(np.random.default_rng(6), 4, VOCAB, lengths=(2, 60))
    a, b = ServerProcess(tmp_path, *_args(ck, record)), ServerProcess(tmp_path, *_args(ck, record))
    try:
        a_url, b_url = a.wait_ready(timeout=240).url, b.wait_ready(timeout=240).url  # both read the empty record
        assert _update(a_url, "step-1", "step-1")["weights_version"] == "step-1"
        before = _policy_scores(a_url, seqs)
        body = {"model": "ref", "path": "step-2", "version": "ref-2"}
        answer = httpx.post(b_url + "/v1/weights", json=body, headers=AUTH, timeout=300)
        assert answer.status_code == 200, answer.text
    finally:
        assert a.stop() == 0, a.log()
        assert b.stop() == 0, b.log()
    assert {n: e["version"] for n, e in json.loads(record.read_text())["models"].items()} == {
        "policy": "step-1", "ref": "ref-2"}

    c = ServerProcess(tmp_path, *_args(ck, record))
    try:
        url = c.wait_ready(timeout=240).url
        assert served_versions(url) == {"policy": "step-1", "ref": "ref-2"}, c.log()
        after = _policy_scores(url, seqs)
        assert after.json()["weights_version"] == "step-1"
        assert after.json()["results"] == before.json()["results"]  # A's numbers, exactly
        assert_matches(decode(after, 0), seqs, ck["scorers"]["step-1"])
    finally:
        assert c.stop() == 0, c.log()


def test_a_record_of_another_base_is_ignored_with_a_warning(checkpoints, tmp_path):
    ck = checkpoints
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"format": 1, "models": {
        "policy": {"model": str(ck["paths"]["step-0"]), "path": "step-1", "version": "step-1"}}}))
    server = ServerProcess(tmp_path, *_args(ck, record, policy="other-base"))
    try:
        url = server.wait_ready(timeout=240).url
        assert served_versions(url)["policy"] != "step-1"
        seqs = random_sequences(np.random.default_rng(4), 3, VOCAB, lengths=(2, 40))
        assert_matches(decode(_policy_scores(url, seqs), 0), seqs, ck["scorers"]["other-base"])
        log = server.log()
        assert "WARNING" in log and str(ck["paths"]["step-0"]) in log and str(ck["paths"]["other-base"]) in log, log
    finally:
        assert server.stop() == 0, server.log()


def _serve_and_fail(args: list[str]) -> subprocess.CompletedProcess:
    """``packscore serve`` expected to refuse its start: its status and its own stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}
    env["OMP_NUM_THREADS"] = "1"
    with held_port() as port:  # a start that wrongly got as far as its bind exits 3
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
        return subprocess.run(command, cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_record_that_cannot_be_read_refuses_the_start(checkpoints, tmp_path):
    ck = checkpoints
    record = tmp_path / "record.json"
    record.write_text('{"format": 1, "models": {"policy": {"model": ')
    done = _serve_and_fail(_args(ck, record))
    assert done.returncode == 2, done.stderr[-3000:]
    err = done.stderr
    assert "packscore: error: " in err and str(record) in err, err[-3000:]
    assert f"delete {record} to serve --model" in err and "is no JSON record" in err, err[-3000:]


@pytest.mark.parametrize("case", ["deleted", "overwritten"])
def test_a_recorded_checkpoint_that_cannot_be_served_waits_for_the_next_update(checkpoints, tmp_path, case):
    """Deleted, or saved over in place (a trainer's ``latest/``): the server runs, not ready, scores
    nothing with --model's weights, and the next update of that model makes it ready with exactly
    that checkpoint's numbers; a failed update leaves it waiting."""
    from model_runtime.scoring.weights import files_snapshot

    ck = checkpoints
    root = tmp_path / "root"  # a root of this test's own: a checkpoint of it is deleted or saved over
    shutil.copytree(ck["paths"]["step-1"], root / "latest")
    shutil.copytree(ck["paths"]["step-2"], root / "step-2")
    record = tmp_path / "record.json"
    files = [list(f) for f in files_snapshot(root / "latest")]
    record.write_text(json.dumps({"format": 1, "models": {"policy": {
        "model": str(ck["paths"]["step-0"]), "path": "latest", "version": "step-1", "files": files}}}))
    if case == "deleted":
        shutil.rmtree(root / "latest")
        path, reason = "step-2", "is not a directory"
    else:
        # copied as a trainer writes: new contents and modification times under the same names
        shutil.copytree(ck["paths"]["step-2"], root / "latest", dirs_exist_ok=True, copy_function=shutil.copy)
        path, reason = "latest", "its files changed since it was recorded"
    args = _args(ck, record)
    args[args.index("--weights-root") + 1] = str(root)
    seqs = random_sequences(np.random.default_rng(5), 3, VOCAB, lengths=(2, 40))
    server = ServerProcess(tmp_path, *args)
    try:
        waiting = wait_status(server, "awaiting_weights")
        assert waiting.status_code == 503 and "'policy'" in waiting.json()["error"]["message"], waiting.text
        for model in ("policy", "ref"):  # the process is not ready: no model scores while one waits
            refused = post(server.url, {"model": model, "sequences": seqs})
            assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
            error = refused.json()["error"]
            assert error["type"] == "not_ready" and "'policy'" in error["message"] and reason in error["message"], error
        metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
        assert "packscore_ready 0.0" in metrics and 'packscore_weights_awaited{model="policy"} 1.0' in metrics
        log = server.log()
        assert "ERROR" in log and str(record) in log and reason in log and "POST /v1/weights" in log, log[-3000:]

        failed = httpx.post(server.url + "/v1/weights", json={"model": "policy", "path": "step-9"}, headers=AUTH,
                            timeout=300)
        assert failed.status_code == 422, failed.text
        assert httpx.get(server.url + "/readyz", timeout=30).json()["status"] == "awaiting_weights"

        assert _update(server.url, path, "step-2")["weights_version"] == "step-2"
        server.wait_ready(timeout=240)
        scored = _policy_scores(server.url, seqs)
        assert scored.json()["weights_version"] == "step-2"
        assert_matches(decode(scored, 0), seqs, ck["scorers"]["step-2"])
        assert served_versions(server.url)["policy"] == "step-2"
        assert json.loads(record.read_text())["models"]["policy"]["path"] == path
    finally:
        assert server.stop() == 0, server.log()
