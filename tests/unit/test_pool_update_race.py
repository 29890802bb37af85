"""A worker lost after every rank swapped, before the pool takes the new version: the restart
launches the weights before the update, so the pool must keep serving under their version.

Otherwise the restarted world would score with the old weights while every answer names the new
version: a pinned request would get other numbers under a version. The failure lands exactly
between the swap's replies and the update's end (no processes: the pool's bookkeeping only).
"""

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
