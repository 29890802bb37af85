"""The start's log while a model loads and warms up: a line every ``still_lines.EVERY_S`` while either
runs on (the log of a 9B's start is otherwise silent for minutes), none once it ended."""

import asyncio
import logging
import time
from dataclasses import replace

import pytest

import model_runtime.still_lines as still_lines
from service import cli
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

pytestmark = pytest.mark.usefixtures("no_packscore_env")

_EVERY_S = 0.1


class _SlowWarmUp(FakeBackend):
    def warm_up(self) -> None:
        time.sleep(3.5 * _EVERY_S)


def test_a_slow_load_and_warm_up_say_they_still_run_and_stop_once_ended(monkeypatch, caplog):
    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="service.runtime")

    def load():  # a source that takes its time, as a checkpoint read from a network disk does
        time.sleep(5.5 * _EVERY_S)  # room for two lines on a loaded machine
        return _SlowWarmUp()

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "service.runtime"]

    async def main():
        app = create_app(Settings(served_model_name="slow"), load)
        async with running_app(app):
            phase, at_ready = app.state.service.phase, said()
            await asyncio.sleep(4 * _EVERY_S)  # a line past the end would have come by now
            return phase, at_ready, said()

    phase, at_ready, at_end = asyncio.run(main())
    assert phase == "ready", at_end
    assert at_end == at_ready, at_end  # nothing once both ended
    loading = [m for m in at_ready if m.startswith("still loading")]
    warming = [m for m in at_ready if m.startswith("still warming up")]
    assert loading[:2] == ["still loading slow: 0.1 s", "still loading slow: 0.2 s"], at_ready
    assert warming[:1] == ["still warming up slow: 0.1 s"], at_ready
    begins = next(i for i, m in enumerate(at_ready) if m.startswith("warming up slow: "))
    took = next(i for i, m in enumerate(at_ready) if m.startswith("warm-up of slow took"))
    # each in its own span: the load's lines before the warm-up began, the warm-up's before it ended
    assert max(at_ready.index(m) for m in loading) < begins < min(at_ready.index(m) for m in warming), at_ready
    assert max(at_ready.index(m) for m in warming) < took, at_ready
    assert at_ready[begins] == "warming up slow: one short scoring pass (nothing to compile)", at_ready



@pytest.mark.parametrize("cache", [None, "kernels"])
def test_the_warm_up_line_on_cuda_says_it_compiles_and_what_keeps_the_kernels(tmp_path, caplog, cache):
    caplog.set_level(logging.INFO, logger="service.runtime")
    backend = FakeBackend(name="gpu-model")
    backend.info = replace(backend.info, device="cuda")  # what a GPU's warm-up says, on this machine
    settings = Settings(triton_cache_dir=tmp_path / cache) if cache else Settings()

    async def main():
        app = create_app(settings, lambda: backend)
        async with running_app(app):
            return app.state.service.phase

    assert asyncio.run(main()) == "ready"
    kept = f"those already in {tmp_path / cache} are not compiled again" if cache else \
        "--triton-cache-dir keeps them for the next start"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warming up ")]
    assert said == [f"warming up gpu-model: compiling and running its kernels for the served shapes (about a minute "
                    f"with an empty kernel cache; {kept})"], caplog.text


def test_a_slow_load_of_score_says_it_still_runs_until_it_ended(monkeypatch, tmp_path, caplog):
    """``packscore score`` loads before any event loop: the same line every interval, from the load's start to its end."""
    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="service.offline")
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "service.offline"]

    at_loaded = []

    def load(settings):  # a checkpoint read from a network disk: minutes, here a few intervals
        time.sleep(5.5 * _EVERY_S)
        at_loaded.extend(said())
        return FakeBackend()

    monkeypatch.setattr("service.backends.load_backend", load)
    assert cli.main(["score", str(source), "-o", str(out), "--served-model-name", "slow"]) == 0
    time.sleep(4 * _EVERY_S)  # a line past the end would have come by now
    still = [m for m in said() if m.startswith("still ")]
    assert still[:2] == ["still loading slow: 0.1 s", "still loading slow: 0.2 s"], said()
    assert still == [m for m in at_loaded if m.startswith("still ")], said()  # none once the load ended


def test_a_rank_reading_its_shards_says_when_it_begins_still_and_when_it_ended(monkeypatch, tmp_path, caplog):
    """With --fsdp the "loaded" line comes once the model is built empty; each rank's shard read follows it."""
    import torch

    from model_runtime.pool import worker
    from model_runtime.scoring import weights
    from model_runtime.scoring.loading import load_model
    from tests.checkpoints import save_checkpoint

    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="packscore.worker")
    path = save_checkpoint("qwen3_5", tmp_path / "ck")
    loaded = load_model(str(path), device="cpu", weights_later=True)
    real, at_read = weights.materialize, []

    def materialize(*args):  # a large checkpoint's shards: minutes, here a few intervals
        time.sleep(3.5 * _EVERY_S)
        real(*args)
        at_read.extend(said())

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "packscore.worker"]

    monkeypatch.setattr(weights, "materialize", materialize)
    worker._read_shards(loaded, path, torch.device("cpu"))
    time.sleep(4 * _EVERY_S)
    lines = said()
    assert lines[0].startswith(f"reading its shards of ck from {path}: ") and lines[0].endswith(" GiB, as float32 on cpu"), lines
    assert lines[1:3] == ["still reading its shards of ck: 0.1 s", "still reading its shards of ck: 0.2 s"], lines
    assert lines[:-1] == at_read and lines[-1].startswith("read its shards of ck in "), lines  # none once it ended
    assert all(not p.is_meta for p in loaded.model.parameters())


def test_a_rank_measuring_its_prefix_rounding_says_when_it_begins_still_and_when_it_ended(monkeypatch, caplog):
    """With prefix sharing on a GPU each rank measures where the narrow products round by row count before it says
    Hello: seconds on the 9B, which the rank's log passed over in silence between its loaded line and the pool's."""
    import torch

    from model_runtime.parallel.dims import ParallelDims
    from model_runtime.pool import messages as msg
    from model_runtime.pool import worker
    from model_runtime.scoring import rounding
    from model_runtime.scoring.loading import load_model

    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="packscore.worker")
    loaded = load_model("tiny", device="cpu", served_name="tiny")
    start = msg.Start(rank=0, world_size=2, sp=1, fsdp=True, master_port=1, generation=1, model="tiny",
                      device="cuda", dtype="auto", max_batch_tokens=512, allow_slow_kernels=False, kernels={},
                      served_model_name="tiny", timeout_s=60.0, prefix_min_tokens=64)
    measured, at_measured = rounding.RowRounding.exact(512), []

    def measure(model, max_rows, device=None):  # a GPU's probes up to the row budget: seconds, here a few intervals
        time.sleep(3.5 * _EVERY_S)
        at_measured.extend(said())
        return measured

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "packscore.worker"]

    monkeypatch.setattr(rounding, "measure", measure)
    got = worker._prefix_rounding(start, ParallelDims.from_world(2, 1, True), loaded, torch.device("cuda", 0))
    time.sleep(4 * _EVERY_S)
    lines = said()
    assert got is measured, got
    assert lines and lines[0] == ("measuring the prefix rounding of tiny on cuda:0: which lengths share a prompt bit for bit, "
                        "up to 512 rows"), lines
    assert lines[1:3] == ["still measuring the prefix rounding of tiny: 0.1 s",
                          "still measuring the prefix rounding of tiny: 0.2 s"], lines
    assert lines[:-1] == at_measured, lines  # none once it ended
    assert lines[-1].startswith("measured the prefix rounding of tiny in ") and lines[-1].endswith("s: 1 kinds of length"), lines


def test_a_rank_measuring_its_narrow_products_runs_says_when_it_begins_still_and_when_it_ended(monkeypatch, caplog):
    """With the ``runs`` gate-projection backend on a GPU each rank measures how many rows one narrow product may
    span before it says Hello: seconds on the 9B where the prefix rounding did not measure the same tables just
    before (``--sp`` > 1, sharing off), which the rank's log said only as a per-shape line and the limits."""
    import torch

    from model_runtime.kernels.gate_projection import RunLimits
    from model_runtime.pool import messages as msg
    from model_runtime.pool import worker
    from model_runtime.scoring import rounding
    from model_runtime.scoring.loading import load_model

    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="packscore.worker")
    loaded = load_model("tiny", device="cpu", served_name="tiny", kernel_overrides={"gate_projection": "runs"})
    start = msg.Start(rank=0, world_size=2, sp=2, fsdp=False, master_port=1, generation=1, model="tiny",
                      device="cuda", dtype="auto", max_batch_tokens=512, allow_slow_kernels=False,
                      kernels={"gate_projection": "runs"}, served_model_name="tiny", timeout_s=60.0, prefix_min_tokens=0)
    at_measured = []

    def run_limits(model, max_rows, cache_dir=None, device=None):  # a GPU's probes per shape: seconds, here a few intervals
        time.sleep(3.5 * _EVERY_S)
        at_measured.extend(said())
        return RunLimits({RunLimits.shape(w): max_rows for w in rounding.narrow_weights(model)})

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "packscore.worker"]

    monkeypatch.setattr(rounding, "run_limits", run_limits)
    worker._narrow_runs(start, loaded, torch.device("cuda", 0))
    time.sleep(4 * _EVERY_S)
    lines = said()
    assert lines and lines[0] == ("measuring the narrow products' runs of tiny on cuda:0: how many rows one product may "
                                  "span, up to 512 rows"), lines
    assert lines[1:3] == ["still measuring the narrow products' runs of tiny: 0.1 s",
                          "still measuring the narrow products' runs of tiny: 0.2 s"], lines
    assert lines[:-1] == at_measured, lines  # none once it ended
    narrow = len(rounding.narrow_weights(loaded.model))
    assert lines[-1].startswith("measured the narrow products' runs of tiny in ") and lines[-1].endswith(
        f"s: {narrow} of {narrow} products span several segments"), lines
    assert all(m.run_limits.rows for m in loaded.model.modules() if hasattr(m, "narrow_weights")), "limits not handed over"

    caplog.clear()  # per segment (or on the CPU) nothing is measured, and nothing said
    worker._narrow_runs(start, load_model("tiny", device="cpu", served_name="tiny"), torch.device("cuda", 0))
    assert said() == [], said()


def test_a_restarted_worker_pool_says_when_its_warm_up_begins_still_and_when_it_ended(monkeypatch, caplog):
    """A worker pool that lost a worker starts fresh processes, whose warm-up compiles their kernels again (seconds
    with a kept kernel cache, a minute without): the log said nothing between "worker pool generation N up" and
    "worker pool restarted; a scoring pass succeeded"."""
    from model_runtime.pool.pool import WorkerPool

    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="model_runtime.pool.supervisor")
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    at_warmed = []

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "model_runtime.pool.supervisor"]

    def warm_up() -> None:  # the new world's first passes: here a few intervals
        time.sleep(3.5 * _EVERY_S)
        at_warmed.extend(said())

    monkeypatch.setattr(pool, "_check_checkpoint_unchanged", lambda: None)
    monkeypatch.setattr(pool, "_start_world", lambda: None)  # its ranks say their own load lines
    monkeypatch.setattr(pool, "warm_up", warm_up)
    try:
        pool._restart_until_up()
        time.sleep(4 * _EVERY_S)
        lines = said()
    finally:
        pool.close()
    assert lines[0] == "warming up the restarted worker pool: one pass of the served shapes per group", lines
    assert lines[1:3] == ["still warming up the restarted worker pool: 0.1 s",
                          "still warming up the restarted worker pool: 0.2 s"], lines
    assert lines[:-1] == at_warmed and lines[-1] == "worker pool restarted; a scoring pass succeeded", lines
