"""Weight updates in the worker pool (2 gloo ranks, replicas and FSDP) under continuous load."""

import threading
import time

import numpy as np
import pytest

from model_runtime.pool.pool import start_pool
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.scoring.content_hash import content_version
from model_runtime.types import SequenceInput
from tests.checkpoints import save_checkpoint

TOL = 1e-5  # as the pool's other tests: gloo ranks run one intra-op thread, the reference two
BASE = dict(device="cpu", dtype="auto", max_batch_tokens=256, allow_slow_kernels=False, world_size=2, sp=1)


@pytest.fixture(scope="module")
def checkpoints(checkpoint_dir, tmp_path_factory):
    """(old, new, incomplete): two tiny qwen3_5 checkpoints and one missing a tensor."""
    from safetensors.torch import load_file, save_file

    old = checkpoint_dir("qwen3_5")
    new = save_checkpoint("qwen3_5", tmp_path_factory.mktemp("seed1"), seed=1)
    incomplete = tmp_path_factory.mktemp("incomplete")
    (incomplete / "config.json").write_text((old / "config.json").read_text())
    (weights,) = old.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.0.linear_attn.A_log"]
    save_file(tensors, incomplete / "model.safetensors")
    return old, new, incomplete


def make_rows(vocab: int, count: int) -> list[list[SequenceInput]]:
    rng = np.random.default_rng(11)
    return [[SequenceInput(rng.integers(0, vocab, int(n)), score_from=1) for n in rng.integers(2, 30, 2)] for _ in range(count)]


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicas", "fsdp"])
def test_every_rank_swaps_at_the_same_row_and_failures_change_nothing(fsdp, checkpoints):
    old, new, incomplete = checkpoints
    pool = start_pool({**BASE, "model": str(old), "fsdp": fsdp})
    try:
        work = make_rows(pool.info.vocab_size, 3)
        old_ref, new_ref = (Scorer(load_model(str(p), device="cpu")) for p in (old, new))
        first = pool.info.weights_version
        want = {first: [old_ref.score_row(r) for r in work], "step-1": [new_ref.score_row(r) for r in work]}
        want[content_version(old)] = want[first]
        seen, stop, errors = [], threading.Event(), []

        def load(offset: int) -> None:
            i = offset
            try:
                while not stop.is_set():
                    seen.append((i % len(work), pool.score_row(work[i % len(work)])))
                    i += 1
            except BaseException as error:  # reported below: no row may fail because of a swap
                errors.append(error)

        threads = [threading.Thread(target=load, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        try:
            update = pool.update_weights(new, "step-1")
            assert (update.weights_version, update.previous_version) == ("step-1", first)
            assert pool.info.weights_version == "step-1"
            with pytest.raises(CheckpointError) as caught:
                pool.update_weights(incomplete, "broken")
            assert caught.value.kind == "incomplete" and "A_log" in str(caught.value)
            assert pool.info.weights_version == "step-1"
            count = len(seen)
            while len(seen) < count + 2 and not errors:
                time.sleep(0.05)
            back = pool.update_weights(old, None)
            assert back.weights_version == content_version(old) and back.previous_version == "step-1"
            count = len(seen)
            while len(seen) < count + 2 and not errors:
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not errors, f"rows failed during updates: {errors[:2]}"
        versions = []
        for i, got in seen:
            (version,) = {s.weights_version for s in got}  # one version per row
            versions.append(version)
            for j, (a, b) in enumerate(zip(got, want[version][i])):
                diff = float(np.abs(a.logprobs - b.logprobs).max())
                assert diff <= TOL, f"row {i} seq {j} named {version}: max |diff| {diff:.3e} > tol {TOL:.0e}"
        assert {"step-1", content_version(old)} <= set(versions), f"versions seen: {versions}"
    finally:
        pool.close()


def test_a_restart_refuses_a_checkpoint_directory_saved_over_since_it_was_loaded(checkpoints, tmp_path):
    """A restarted world reloads from the directory that serves: if another save replaced its
    files, those weights would serve under the old version (a pinned request included). The
    restart is refused, naming why, until the files are back; then the pool serves them again."""
    import os
    import shutil
    import signal

    old, new, _ = checkpoints
    served = tmp_path / "step"
    shutil.copytree(new, served)
    (weights,) = served.glob("*.safetensors")
    original = weights.read_bytes()
    pool = start_pool({**BASE, "model": str(old), "fsdp": False})
    try:
        row = make_rows(pool.info.vocab_size, 1)[0]
        pool.update_weights(served, "step-1")  # a named version: hashed after the swap, for restarts
        want = pool.score_row(row)
        deadline = time.monotonic() + 30
        while pool._loaded.content is None:
            assert time.monotonic() < deadline, "the named version's content was not hashed within 30s"
            time.sleep(0.05)
        weights.write_bytes(next(old.glob("*.safetensors")).read_bytes())  # a trainer saves over it
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pool.restart_error is None:
            assert time.monotonic() < deadline, "no restart was refused within 60s"
            time.sleep(0.1)
        assert not pool.is_alive() and "holds other weights since version 'step-1'" in pool.restart_error, pool.restart_error
        weights.write_bytes(original)
        deadline = time.monotonic() + 90
        while not pool.is_alive():
            assert time.monotonic() < deadline, f"the pool did not come back within 90s: {pool.restart_error}"
            time.sleep(0.2)
        assert pool.restart_error is None and pool.info.weights_version == "step-1"
        for a, b in zip(pool.score_row(row), want):
            assert np.array_equal(a.logprobs, b.logprobs), "after the restart, other numbers under step-1"
    finally:
        pool.close()


def test_a_content_hash_that_fails_has_every_rank_drop_what_it_read(checkpoints, monkeypatch):
    """The ranks read while the server process hashes: when the hash fails (a file cut meanwhile),
    every rank is told to drop its copy (else each holds a second copy of the weights until the
    next update), and the old version keeps serving."""
    import model_runtime.pool.messages as msg
    import model_runtime.scoring.content_hash as content_hash

    old, new, _ = checkpoints
    pool = start_pool({**BASE, "model": str(old), "fsdp": False})
    try:
        row = make_rows(pool.info.vocab_size, 1)[0]
        first, before = pool.info.weights_version, pool.score_row(row)
        sent, real_send = [], pool._send_all

        def record(world, pending, message):
            sent.append(msg.decode(message) if isinstance(message, bytes) else message)
            return real_send(world, pending, message)

        def cut(path, **kw):
            raise CheckpointError("unreadable", f"{path.name}: a file was cut while it was hashed")

        monkeypatch.setattr(pool, "_send_all", record)
        monkeypatch.setattr(content_hash, "content_version", cut)
        with pytest.raises(CheckpointError, match="cut while it was hashed"):
            pool.update_weights(new, None)
        swaps = [m for m in sent if isinstance(m, msg.SwapWeights)]
        assert [m.commit for m in swaps] == [False], f"swap messages after the failed hash: {swaps}"
        assert pool.info.weights_version == first
        for a, b in zip(pool.score_row(row), before):
            assert a.weights_version == first and np.array_equal(a.logprobs, b.logprobs), "the old version changed"
    finally:
        pool.close()


def test_a_pool_server_restarted_with_a_weights_record_serves_the_last_update(checkpoints, tmp_path):
    """``--weights-record`` with the worker pool: the recorded update is swapped into every rank
    before the restarted server is ready (docs/weights.md "Surviving a restart")."""
    import shutil

    import httpx

    from service.local_server import LocalServer

    old, new, _ = checkpoints
    root = tmp_path / "root"
    shutil.copytree(old, root / "step-0")
    shutil.copytree(new, root / "step-1")
    record = tmp_path / "record.json"
    args = ["--model", f"policy={root / 'step-0'}", "--device", "cpu", "--world-size", "2", "--max-batch-tokens", "256",
            "--weights-root", str(root), "--weights-record", str(record)]
    body = {"sequences": [{"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "score_from": 2}]}

    def start() -> LocalServer:
        return LocalServer(args, env={"OMP_NUM_THREADS": "1"}, log_dir=tmp_path).wait_ready(timeout=300)

    first = start()
    try:
        update = httpx.post(first.url + "/v1/weights", json={"path": "step-1", "version": "step-1"}, timeout=300)
        assert update.status_code == 200, update.text
        before = httpx.post(first.url + "/score", json=body, timeout=60).json()
    finally:
        assert first.stop() == 0, first.log()
    second = start()
    try:
        after = httpx.post(second.url + "/score", json=body, timeout=60).json()
        models = httpx.get(second.url + "/v1/models", timeout=30).json()["data"]
    finally:
        assert second.stop() == 0, second.log()
    assert after["weights_version"] == "step-1" and models[0]["weights_version"] == "step-1", second.log()
    assert after["results"] == before["results"], "the restarted pool scores otherwise than before the restart"
    ids = np.array(body["sequences"][0]["input_ids"])
    want = Scorer(load_model(str(new), device="cpu")).score([SequenceInput(ids, 2)])
    diff = float(np.abs(np.array(after["results"][0]["logprobs"]) - want[0].logprobs).max())
    assert diff <= TOL, f"restored pool vs step-1 in one process: max |diff| {diff:.3e} > tol {TOL:.0e}"


def test_a_pool_server_whose_recorded_checkpoint_is_refused_waits_then_serves_the_next_update(checkpoints, tmp_path):
    """The restore runs through the pool's update, which refuses an incomplete checkpoint on every
    rank: the server waits, not ready, its workers alive on the base weights; the next update reaches
    every rank (FSDP: each forward needs every rank's shards) and makes it ready with those numbers."""
    import json
    import shutil

    import httpx

    from service.local_server import LocalServer

    old, new, incomplete = checkpoints
    root = tmp_path / "root"
    shutil.copytree(incomplete, root / "broken")
    shutil.copytree(new, root / "step-1")
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"format": 1, "models": {"policy": {"model": str(old), "path": "broken",
                                                                    "version": "b"}}}))
    args = ["--model", f"policy={old}", "--device", "cpu", "--world-size", "2", "--fsdp", "--max-batch-tokens", "256",
            "--weights-root", str(root), "--weights-record", str(record)]
    body = {"sequences": [{"input_ids": [3, 1, 4, 1, 5, 9, 2, 6], "score_from": 2}]}
    server = LocalServer(args, env={"OMP_NUM_THREADS": "1"}, log_dir=tmp_path)
    def loaded() -> httpx.Response | None:
        readyz = httpx.get(server.url + "/readyz", timeout=5)
        try:
            return readyz if readyz.json()["status"] not in ("loading",) else None
        except ValueError:
            return None

    try:
        readyz = server.wait_for(loaded, 300, what="past loading")
        assert readyz.status_code == 503 and readyz.json()["status"] == "awaiting_weights", readyz.text
        assert "incomplete_checkpoint" in readyz.json()["error"]["message"], readyz.text
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert "packscore_workers_alive 2.0" in metrics and "packscore_ready 0.0" in metrics, metrics
        assert httpx.post(server.url + "/score", json=body, timeout=60).status_code == 503
        update = httpx.post(server.url + "/v1/weights", json={"path": "step-1", "version": "step-1"}, timeout=300)
        assert update.status_code == 200, update.text
        server.wait_ready(timeout=300)
        after = httpx.post(server.url + "/score", json=body, timeout=60).json()
    finally:
        assert server.stop() == 0, server.log()
    assert after["weights_version"] == "step-1", after
    ids = np.array(body["sequences"][0]["input_ids"])
    want = Scorer(load_model(str(new), device="cpu")).score([SequenceInput(ids, 2)])
    diff = float(np.abs(np.array(after["results"][0]["logprobs"]) - want[0].logprobs).max())
    assert diff <= TOL, f"updated pool vs step-1 in one process: max |diff| {diff:.3e} > tol {TOL:.0e}"


def test_a_worker_lost_while_the_recorded_update_loads_delays_the_restore_not_withholds_it(checkpoints, tmp_path):
    """The recorded checkpoint is fine; a worker that dies while every rank loads it says nothing
    about it: once the pool restarted the restore runs again and the server is ready on it,
    instead of waiting (awaiting_weights) for an update nobody will send."""
    import json
    import os
    import shutil
    import signal

    import httpx

    from service.local_server import LocalServer
    from tests.distributed.test_serve_e2e import _worker_pids

    old, new, _ = checkpoints
    root = tmp_path / "root"
    shutil.copytree(new, root / "step-1")
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"format": 1, "models": {"policy": {"model": str(old), "path": "step-1", "version": "step-1"}}}))
    args = ["--model", f"policy={old}", "--device", "cpu", "--world-size", "2", "--max-batch-tokens", "256",
            "--weights-root", str(root), "--weights-record", str(record)]
    server = LocalServer(args, env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, log_dir=tmp_path)
    try:
        server.wait_for(lambda: "worker pool generation 1 up" in server.log_path.read_text(errors="replace"), 120,
                        interval=0.002, what="up (worker pool generation 1)")
        os.kill(_worker_pids(server.proc.pid)[0], signal.SIGKILL)  # the restore's load is under way
        server.wait_ready(timeout=120)
        assert "restoring policy from --weights-record" in server.log_path.read_text(), "the kill missed the restore"
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    finally:
        assert server.stop() == 0, server.log()
    assert models[0]["weights_version"] == "step-1", models


def test_a_rank_stopped_during_an_update_fails_it_at_the_stall_floor_and_the_old_version_comes_back(checkpoints):
    """A rank that stops answering (SIGSTOP here, a hung GPU in practice) while no row runs: the update's
    load used to wait for it up to the start timeout (30 min). Silent past the stall floor (60 s by default,
    3 s here), the rank is stuck: the update fails with 503 naming it, the world restarts with the old
    weights, and the next update lands."""
    import os
    import signal

    from model_runtime.scoring.backend import BackendUnavailableError

    old, new, _ = checkpoints
    pool = start_pool({**BASE, "model": str(old), "fsdp": False, "worker_stall_floor_s": 3.0})
    stopped = None
    try:
        row = make_rows(pool.info.vocab_size, 1)[0]
        first, before = pool.info.weights_version, pool.score_row(row)
        stopped = pool.worker_pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        outcome = {}

        def update() -> None:
            started = time.monotonic()
            try:
                pool.update_weights(new, "step-1")
            except BaseException as error:
                outcome["error"] = error
            outcome["seconds"] = time.monotonic() - started

        updating = threading.Thread(target=update)
        updating.start()
        updating.join(3.0 + 15)  # the floor, the reader's polling and a loaded machine's scheduling
        assert not updating.is_alive(), "the update still waits for the stopped rank past the stall floor"
        error = outcome.get("error")
        assert isinstance(error, BackendUnavailableError) and f"worker rank 1 (pid {stopped}) said nothing" in str(error), outcome
        assert f"changed nothing: the pool comes back with the weights of version {first!r}" in str(error), error
        assert outcome["seconds"] > 3.0 - 0.05, outcome
        assert pool.info.weights_version == first
        deadline = time.monotonic() + 90
        while not pool.is_alive():
            assert time.monotonic() < deadline, "the pool did not come back within 90s"
            time.sleep(0.2)
        assert stopped not in pool.worker_pids()
        for a, b in zip(pool.score_row(row), before):
            assert a.weights_version == first and np.array_equal(a.logprobs, b.logprobs), "the old version changed"
        assert pool.update_weights(new, "step-1").weights_version == "step-1"
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except (ProcessLookupError, TypeError):
            pass
        pool.close()
