"""The worker pool in this process (no HTTP): routing, lockstep steps and recovery from a dead worker."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from model_runtime.pool.pool import start_pool
from model_runtime.scoring.backend import BackendUnavailableError, LocalBackend
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import InvalidSequenceError, SequenceInput

TOL = 1e-5
BASE = dict(model="tiny", device="cpu", dtype="auto", max_batch_tokens=256, allow_slow_kernels=False)


@pytest.fixture(scope="module")
def local():
    return LocalBackend(Scorer(load_model("tiny", device="cpu")))


def rows(vocab: int, count: int, seed: int = 0) -> list[list[SequenceInput]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        lengths = rng.integers(1, 90, size=1 + i % 3)
        out.append([SequenceInput(rng.integers(0, vocab, n), score_from=1 + (n > 2), top_k=i % 3) for n in lengths])
    return out


def assert_same(got, want, where: str) -> None:
    for j, (a, b) in enumerate(zip(got, want)):
        diff = float(np.abs(a.logprobs - b.logprobs).max()) if a.logprobs.size else 0.0
        assert diff <= TOL, f"{where} sequence {j}: max |diff| {diff:.3e} > tol {TOL:.0e}"
        if b.top_k_ids is not None:
            np.testing.assert_array_equal(a.top_k_ids, b.top_k_ids, err_msg=f"{where} sequence {j} top-k ids")


def test_independent_groups_match_one_process_and_share_the_work(local):
    # --kernels reaches the workers: SDPA (math on CPU) instead of the reference attention.
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False, "kernels": {"attention": "sdpa"},
                       "extra_service_key": object()})
    try:
        assert pool.info.parallel == {"world_size": 2, "dp": 2, "sp": 1, "fsdp": False}
        assert pool.info.kernels["attention"] == "sdpa"
        assert pool.concurrency == 2 and pool.max_row_tokens == 256
        assert pool.row_cost([100]) > 2 * pool.row_cost([50]) > 0  # the quadratic attention term
        pool.warm_up()
        assert pool.is_alive() and pool.workers_alive() == 2
        work = rows(pool.info.vocab_size, 8)
        with ThreadPoolExecutor(pool.concurrency) as ex:
            results = list(ex.map(pool.score_row, work))
        for i, (row, got) in enumerate(zip(work, results)):
            assert_same(got, local.score_row(row), f"row {i}")
        assert min(pool.rows_per_group) >= 2, f"rows per group {pool.rows_per_group}: one group idled"
        with pytest.raises(InvalidSequenceError):
            pool.score_row([SequenceInput(np.array([pool.info.vocab_size]))])
    finally:
        pool.close()
    assert not pool.is_alive()


def test_lockstep_fsdp_groups_survive_a_killed_worker(local):
    """dp=2 groups with FSDP over both ranks: a killed rank fails in-flight rows, the pool comes back."""
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": True})
    try:
        assert pool.info.parallel == {"world_size": 2, "dp": 2, "sp": 1, "fsdp": True}
        pool.warm_up()
        work = rows(pool.info.vocab_size, 6, seed=1)
        before = dict(pool.step_counts)
        with ThreadPoolExecutor(2) as ex:
            results = list(ex.map(pool.score_row, work))
        for i, (row, got) in enumerate(zip(work, results)):
            assert_same(got, local.score_row(row), f"lockstep row {i}")
        # Two callers keep both groups busy: a step waits for the second caller's row instead of
        # running one group against a dummy (which halved FSDP throughput on 2 GPUs).
        steps = pool.step_counts["steps"] - before["steps"]
        per_step = (pool.step_counts["rows"] - before["rows"]) / steps
        assert per_step >= 1.5, f"{len(work)} rows from 2 callers took {steps} steps ({per_step:.2f} rows per step)"
        # A lone row still steps both groups (the other one runs a dummy row).
        assert_same(pool.score_row(work[0]), local.score_row(work[0]), "lone row")

        old_pids = pool.worker_pids()
        long_row = [SequenceInput(np.arange(200) % pool.info.vocab_size)]
        outcomes = []
        stop = threading.Event()

        def load():
            while not stop.is_set():
                started = time.monotonic()
                try:
                    pool.score_row(long_row)
                    outcomes.append(("ok", time.monotonic() - started))
                except BackendUnavailableError:
                    outcomes.append(("unavailable", time.monotonic() - started))

        with ThreadPoolExecutor(3) as ex:
            futures = [ex.submit(load) for _ in range(3)]
            time.sleep(0.5)
            os.kill(old_pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pool.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not pool.is_alive(), "the pool still claims to be alive after a worker was killed"
            time.sleep(0.3)
            stop.set()
            for f in futures:
                f.result(timeout=60)  # never a hang
        kinds = {k for k, _ in outcomes}
        assert "unavailable" in kinds, f"killing a worker during load failed nothing: {outcomes}"
        assert max(t for _, t in outcomes) < 30, outcomes
        deadline = time.monotonic() + 90
        while not pool.is_alive():
            assert time.monotonic() < deadline, "the pool did not come back within 90s"
            time.sleep(0.2)
        assert pool.restarts == 1
        assert set(pool.worker_pids()).isdisjoint(old_pids)
        assert_same(pool.score_row(work[2]), local.score_row(work[2]), "after restart")
    finally:
        pool.close()


@pytest.mark.parametrize("fsdp", [False, True], ids=["groups", "lockstep"])
def test_a_stopped_worker_fails_its_rows_once_they_outrun_the_measured_rate(local, fsdp):
    """A worker that hangs (SIGSTOP here, a hung GPU in practice) without exiting: once a row has
    run ten times what the group's measured rate says, at least the floor (60 s by default, 3 s
    here), the world is restarted and the row fails with 503, not after ``worker_timeout_s``."""
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": fsdp, "worker_stall_floor_s": 3.0})
    stopped = None
    try:
        pool.warm_up()  # measures the rate
        work = rows(pool.info.vocab_size, 2, seed=4)
        assert pool.request_timeout_s >= 600 and pool._seconds_per_cost is not None
        stopped = pool.worker_pids()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError):
            pool.score_row(work[0])
        waited = time.monotonic() - started
        assert 2.5 < waited < 20, f"the row failed after {waited:.1f}s; the floor is 3 s"
        deadline = time.monotonic() + 90
        while not pool.is_alive():
            assert time.monotonic() < deadline, "the pool did not come back within 90s"
            time.sleep(0.2)
        assert_same(pool.score_row(work[1]), local.score_row(work[1]), "after the restart")
    finally:
        for pid in stopped or []:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        pool.close()
