"""A worker lost after every rank swapped, before the pool takes the new version: the restart
launches the weights before the update, so the pool must keep serving under their version.

Otherwise the restarted world would score with the old weights while every answer names the new
version: a pinned request would get other numbers under a version. The failure lands exactly
between the swap's replies and the update's end (no processes: the pool's bookkeeping only, and
for the answers the service in this process over it).
"""

import asyncio
import contextlib
import json
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from model_runtime.pool import messages as msg
from model_runtime.pool.pool import WorkerPool
from model_runtime.scoring.backend import BackendUnavailableError, ModelInfo
from tests.unit.test_pool_failure_race import RacingWorld

OLD, NEW = "v1", "v2"


class SwappingWorld(RacingWorld):
    """Every rank answers ``LoadWeights`` and ``SwapWeights`` at once; with ``die_on_swap``, a worker
    is lost right after the swap's replies came in, and with ``launch_first`` the restart's launch
    runs before the update goes on (else after it ended)."""

    def __init__(self, pool: WorkerPool, die_on_swap: bool, launch_first: bool = False):
        super().__init__(pool)
        self.armed = False
        self.die_on_swap, self.launch_first = die_on_swap, launch_first

    def send_every(self, frame: bytes) -> None:
        command = msg.decode(frame)
        for rank in range(self.pool.dims.world_size):
            self.pool._deliver(self, rank, msg.WeightsDone(command.request_id, rank, True, "", "", 0.01))
        if isinstance(command, msg.SwapWeights) and self.die_on_swap:
            self.pool._on_world_failure(self, "worker rank 0 (pid 1) exited (status -9)")
            if self.launch_first:
                self.pool._restart_thread.join(10.0)


class LaunchOnly:
    """A restart's world that records the fields it is launched with, and goes no further."""

    killed = False

    def __init__(self):
        self.fields = None

    def launch(self, fields: dict) -> None:
        self.fields = dict(fields)  # what the ranks' Start messages carry, sent during the launch
        raise BackendUnavailableError("launched (test)")


def checkpoint(path, value: float):
    path.mkdir()
    save_file({"w": np.full(4, value, dtype=np.float32)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "test"}))
    return path


@pytest.fixture
def pool(tmp_path, monkeypatch):
    pool = WorkerPool({"world_size": 1, "device": "cpu", "model": str(checkpoint(tmp_path / "old", 1.0))})
    pool._start_fields["weights_version"] = OLD
    pool.info = ModelInfo("m", "test", 8, 64, "float32", "cpu", OLD, {})
    pool._alive = True
    pool.launched = LaunchOnly()
    updating = threading.Lock()  # held while the update runs: a restart launches after it, unless joined first

    def restart():  # the restart loop's launch of a new world, and no further
        with updating if not pool._world.launch_first else contextlib.nullcontext():
            try:
                pool._launch_and_greet(pool.launched)
            except BackendUnavailableError:
                pass

    monkeypatch.setattr(pool, "_restart_loop", restart)
    original = pool.update_weights

    def update_weights(*args, **kwargs):
        with updating:
            return original(*args, **kwargs)

    monkeypatch.setattr(pool, "update_weights", update_weights)
    yield pool
    pool.close()


@pytest.mark.parametrize("launch_first", [True, False], ids=["restart-launched-first", "update-ended-first"])
def test_a_worker_lost_as_the_ranks_swapped_leaves_the_old_version_serving(pool, tmp_path, launch_first):
    new = checkpoint(tmp_path / "new", 2.0)
    pool._world = world = SwappingWorld(pool, die_on_swap=True, launch_first=launch_first)
    try:
        pool.update_weights(new, NEW)
        error = None
    except BackendUnavailableError as raised:
        error = raised
    assert world.failed and world.stopped and not pool._alive
    pool._restart_thread.join(10.0)
    assert pool.launched.fields is not None, "the restart never launched"
    assert pool.info.weights_version == pool.launched.fields["weights_version"], \
        "the answers name weights the restarted world does not hold"
    assert pool.launched.fields["weights_version"] == OLD and pool.launched.fields["model"] == str(tmp_path / "old")
    assert pool._start_fields["weights_version"] == OLD and pool._loaded is None
    assert error is not None and "a worker failed as the ranks swapped" in str(error), repr(error)
    assert "send the update again" in str(error)


def test_an_update_whose_world_stays_up_names_the_new_weights_for_restarts(pool, tmp_path):
    new = checkpoint(tmp_path / "new", 2.0)
    pool._world = world = SwappingWorld(pool, die_on_swap=False)
    update = pool.update_weights(new, NEW)
    assert (update.weights_version, update.previous_version) == (NEW, OLD)
    assert pool.info.weights_version == NEW
    assert pool._start_fields["weights_version"] == NEW and pool._start_fields["model"] == str(new)
    assert pool._loaded is not None and pool._loaded.path == new
    pool._on_world_failure(world, "worker rank 0 (pid 1) exited (status -9)")  # lost after the update: it restarts with it
    pool._restart_thread.join(10.0)
    assert pool.launched.fields["weights_version"] == NEW and pool.launched.fields["model"] == str(new)


class ScoringWorld(SwappingWorld):
    """A world that also scores rows by the weights its ranks hold: every scored position's log-prob is
    -1 under ``OLD``, -2 once they swapped. With ``lose``, a worker is lost once it is set, after every
    rank swapped and before the pool takes the new version; the restart runs before the update goes on."""

    def __init__(self, pool: WorkerPool, lose: threading.Event | None = None):
        super().__init__(pool, die_on_swap=False)
        self.version, self.lose, self.swapped = pool.info.weights_version, lose, threading.Event()
        self.scored: list[str] = []  # the version of every row it scored

    def all_running(self) -> bool:
        return not self.failed

    def send_group(self, group: int, frame: bytes) -> None:
        sequences = msg.decode(frame).sequences()
        self.scored.append(self.version)
        n, k = sum(s.num_scored for s in sequences), max(s.top_k for s in sequences)
        scored = np.full(n, -1.0 if self.version == OLD else -2.0, dtype=msg.FLOAT)
        self.pool._deliver(self, 0, msg.RowResult(msg.decode(frame).request_id, k, scored.tobytes(), scored.tobytes(),
                                                  np.zeros(n * k, msg.IDS).tobytes(), np.repeat(scored, k).tobytes(),
                                                  self.version))

    def send_every(self, frame: bytes) -> None:
        super().send_every(frame)
        command = msg.decode(frame)
        if isinstance(command, msg.SwapWeights) and command.commit:
            self.version = command.version  # rows sent from now on are scored by the new weights
            self.swapped.set()
            if self.lose is not None:
                self.lose.wait(30)
                self.pool._on_world_failure(self, "worker rank 0 (pid 1) exited (status -9)")
                self.pool._restart_thread.join(10.0)


def test_rows_a_swapped_world_scored_before_it_was_lost_are_never_answered_under_the_new_version(pool, tmp_path,
                                                                                                 monkeypatch):
    """Guards the premise that a later update may reuse the name of one the pool lost as its ranks swapped:
    rows scored meanwhile by the new weights come back named ``NEW`` while the pool still serves ``OLD``,
    and the scoring route scores them again, so no answer ever names ``NEW`` for those weights. A later
    update naming ``NEW`` with other files is therefore accepted (as "send the update again" needs)."""
    from service.http.app import create_app
    from service.settings import Settings
    from service.testing import running_app, wait_until

    checkpoint(tmp_path / "new", 2.0)
    checkpoint(tmp_path / "other", 3.0)
    pool._vocab_size, pool._costs = 8, (1.0, 0.0)
    lose = threading.Event()
    pool._world = world = ScoringWorld(pool, lose)

    def restart():  # the restarted world holds the weights before the update
        pool._world, pool._alive, pool._restarting = ScoringWorld(pool), True, False

    monkeypatch.setattr(pool, "_restart_loop", restart)
    app = create_app(Settings(weights_root=tmp_path), pool)
    sequence = {"input_ids": [1, 2, 3, 4], "score_from": 2}

    async def main():
        async with running_app(app) as client:
            update = asyncio.ensure_future(client.post("/v1/weights", json={"path": "new", "version": NEW}))
            await wait_until(world.swapped.is_set)
            scored = asyncio.ensure_future(client.post("/score", json={"sequences": [sequence]}))
            # scored by the new weights twice, it waits for the update's end to hold the next swap off
            await wait_until(lambda: scored.done() or app.state.service.default.hold_waiters > 0)
            lose.set()
            failed, scored = await update, await scored
            again = await client.post("/v1/weights", json={"path": "other", "version": NEW})
            after = await client.post("/score", json={"sequences": [sequence]})
            return failed, scored, again, after

    failed, scored, again, after = asyncio.run(main())
    assert failed.status_code == 503 and failed.json()["error"]["type"] == "backend_unavailable", failed.text
    assert scored.status_code == 200 and scored.json()["weights_version"] == OLD, scored.text
    assert world.scored.count(NEW) == 2, world.scored  # the request's rows the swapped world scored
    assert scored.json()["results"][0]["logprobs"] == [-1.0, -1.0], scored.text
    assert again.status_code == 200 and again.json()["weights_version"] == NEW, again.text
    assert after.json()["weights_version"] == NEW and after.json()["results"][0]["logprobs"] == [-2.0, -2.0], after.text


def test_an_update_whose_hash_for_restarts_cannot_start_is_answered_200_and_recorded(pool, tmp_path, monkeypatch,
                                                                                      caplog):
    """The thread hashing a named version's checkpoint for restarts starts after the new version serves:
    refused by the process's thread limit, it must not fail the landed update (422 unreadable_checkpoint,
    not written to --weights-record) nor make close() raise joining it. It is logged, and the update is answered."""
    import logging

    from service.http.app import create_app
    from service.settings import Settings
    from service.testing import running_app

    checkpoint(tmp_path / "new", 2.0)
    pool._vocab_size, pool._costs = 8, (1.0, 0.0)
    pool._world = ScoringWorld(pool)
    record = tmp_path / "state" / "record.json"
    record.parent.mkdir()
    app = create_app(Settings(weights_root=tmp_path, weights_record=record), pool)
    start = threading.Thread.start

    def limited(thread):
        if thread.name == "pool-content-hash":
            raise RuntimeError("can't start new thread")
        return start(thread)

    async def main():
        async with running_app(app) as client:
            with monkeypatch.context() as patched:
                patched.setattr(threading.Thread, "start", limited)
                update = await client.post("/v1/weights", json={"path": "new", "version": NEW})
            scored = await client.post("/score", json={"sequences": [{"input_ids": [1, 2, 3, 4], "score_from": 2}]})
            return update, scored

    with caplog.at_level(logging.WARNING, logger="model_runtime.pool"):
        update, scored = asyncio.run(main())
    assert update.status_code == 200 and update.json()["weights_version"] == NEW, update.text
    assert scored.json()["weights_version"] == NEW and scored.json()["results"][0]["logprobs"] == [-2.0, -2.0], scored.text
    recorded = json.loads(record.read_text())["models"]["m"]
    assert (recorded["path"], recorded["version"]) == ("new", NEW), recorded
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith("model_runtime.pool")]
    assert "can't start new thread" in warning and "for restarts" in warning, warning
    assert pool._loaded.path == tmp_path / "new" and pool._loaded.content is None and pool._hashes == []
    pool.close()  # joins no thread that never started
