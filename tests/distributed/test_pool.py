"""The worker pool in this process (no HTTP): routing, lockstep steps and recovery from a dead worker."""

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from model_runtime.pool import supervisor
from model_runtime.pool.pool import start_pool
from model_runtime.pool.procs import WorkerWorld
from model_runtime.pool.supervisor import FIRST_WORLD_ATTEMPTS, WorkerLost
from model_runtime.scoring.backend import STALL_FACTOR, BackendUnavailableError, LocalBackend
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import InvalidSequenceError, SequenceInput
from tests import warm_start
from tests.signals import process_state

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
        # A step waits this long for the second caller's row, not 20 ms: a loaded machine may not
        # run that caller so soon, and the step would leave without it.
        pool.STEP_GATHER_S = 1.0
        with ThreadPoolExecutor(2) as ex:
            results = list(ex.map(pool.score_row, work))
        del pool.STEP_GATHER_S
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
        # The warm-up's shape: its bound is the floor unless a loaded machine measured a slow warm-up.
        row = [SequenceInput(np.arange(16) % pool.info.vocab_size)]
        bound = max(3.0, STALL_FACTOR * pool.row_cost([16]) * pool._seconds_per_cost)
        stopped = pool.worker_pids()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError):
            pool.score_row(row)
        waited = time.monotonic() - started
        # Slack for the reader's polling and a loaded machine's scheduling, far below worker_timeout_s.
        assert bound - 0.05 < waited < bound + 10, f"the row failed after {waited:.1f}s; its bound is {bound:.1f}s (floor 3 s)"
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


def test_a_lockstep_caller_returns_with_its_step_counted_and_its_rate_measured():
    """The stepper counts a step and folds its time into the measured rate before the callers get
    their rows: one that returns (a benchmark reading the occupancy, the next row's time bound) sees both."""
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": True})
    try:
        measure = pool._measure_rate

        def descheduled(cost: float, seconds: float) -> None:
            time.sleep(0.5)  # the stepper thread descheduled after its step, as on a loaded machine
            measure(cost, seconds)

        pool._measure_rate = descheduled
        before = dict(pool.step_counts)
        pool.warm_up()
        assert pool._seconds_per_cost is not None, "warm_up() returned before its step's rate was measured"
        assert pool.step_counts == {"steps": before["steps"] + 1, "rows": before["rows"] + 2}, (before, pool.step_counts)
    finally:
        pool.close()


def _spawn_killing(monkeypatch, doomed) -> list:
    """Workers start as usual, except that the ``i``-th launched (counting from 0) is killed by
    SIGKILL as soon as it exists, for every ``i`` where ``doomed(i)``: lost before its world is up.
    Returns the launched processes."""
    launched = []
    spawn = WorkerWorld.spawn

    def killing(*args, **kwargs):
        proc = spawn(*args, **kwargs)
        if doomed(len(launched)):
            proc.kill()  # our own child, by its handle
        launched.append(proc)
        return proc

    monkeypatch.setattr(WorkerWorld, "spawn", staticmethod(killing))
    return launched


def _spawn_stopping(monkeypatch, doomed) -> list:
    """As ``_spawn_killing``, with SIGSTOP: the ``i``-th launched runs on, but never gets as far as
    the process group's rendezvous (its imports take seconds)."""
    launched = []
    spawn = WorkerWorld.spawn

    def stopping(*args, **kwargs):
        proc = spawn(*args, **kwargs)
        if doomed(len(launched)):
            os.kill(proc.pid, signal.SIGSTOP)
        launched.append(proc)
        return proc

    monkeypatch.setattr(WorkerWorld, "spawn", staticmethod(stopping))
    return launched


def _running(procs) -> list[int]:
    return [p.pid for p in procs if process_state(p.pid) not in ("gone", "Z")]


def test_a_worker_lost_while_the_first_world_forms_is_replaced(local, monkeypatch, caplog):
    """A rank killed before the start's world is up does not fail the start: the world is formed
    again (its peer, waiting for it in the rendezvous, goes too) and scores as one process."""
    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", 0.05)
    launched = _spawn_killing(monkeypatch, lambda i: i == 0)
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False})
    try:
        assert len(launched) == 4 and pool.worker_pids() == [p.pid for p in launched[2:]], pool.worker_pids()
        assert pool.restarts == 0 and pool.is_alive()
        assert "worker pool generation 1 not formed: worker rank 0" in caplog.text and "killed by SIGKILL" in caplog.text
        work = rows(pool.info.vocab_size, 2, seed=5)
        for i, row in enumerate(work):
            assert_same(pool.score_row(row), local.score_row(row), f"row {i}")
        assert not _running(launched[:2]), "the first world's workers outlived it"
    finally:
        pool.close()


def test_a_worker_lost_at_every_start_fails_it_after_a_few_worlds_in_one_line(monkeypatch):
    """A checkpoint that kills a worker every time (the host's memory, a crash in a kernel) must
    not retry forever: the start fails after ``FIRST_WORLD_ATTEMPTS`` worlds, naming the signal."""
    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", 0.05)
    launched = _spawn_killing(monkeypatch, lambda i: i % 2 == 1)
    started = time.monotonic()
    with pytest.raises(WorkerLost) as caught:
        start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False})
    took = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and f"lost at each of {FIRST_WORLD_ATTEMPTS} attempts" in message, message
    assert "worker rank 1" in message and "killed by SIGKILL" in message, message
    assert len(launched) == 2 * FIRST_WORLD_ATTEMPTS, f"{len(launched)} workers launched"
    assert took < 60, f"the start took {took:.0f}s to give up"
    assert not _running(launched), "workers outlived the failed start"


def test_the_first_world_is_formed_again_after_a_growing_pause(monkeypatch, caplog):
    """A checkpoint that kills every worker (the host's memory) is not loaded back to back: each
    world after a lost one launches ``FIRST_WORLD_PAUSE_S`` (then twice that) after the loss is logged."""
    pause = 0.4
    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", pause)
    launched = _spawn_killing(monkeypatch, lambda i: i % 2 == 1)
    spawned_at = []
    spawn = WorkerWorld.spawn

    def timed(*args, **kwargs):
        spawned_at.append(time.time())  # the clock of log records
        return spawn(*args, **kwargs)

    monkeypatch.setattr(WorkerWorld, "spawn", staticmethod(timed))
    with pytest.raises(WorkerLost):
        start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False})
    lost = [r for r in caplog.records if "not formed" in r.getMessage()]
    assert len(lost) == FIRST_WORLD_ATTEMPTS - 1 and len(spawned_at) == 2 * FIRST_WORLD_ATTEMPTS, [r.getMessage() for r in lost]
    for attempt, record in enumerate(lost, start=2):
        want = pause * 2 ** (attempt - 2)
        gap = spawned_at[2 * (attempt - 1)] - record.created
        assert f"forming it again in {want:g}s (attempt {attempt} of" in record.getMessage(), record.getMessage()
        assert gap >= want - 0.02, f"world {attempt} launched {gap:.3f}s after the loss was logged; the pause is {want}s"
    assert not _running(launched), "workers outlived the failed start"


def test_close_during_the_pause_between_first_worlds_ends_the_start_at_once(monkeypatch, caplog):
    """The server's exit (a SIGTERM) while the start waits to form its world again is not held by the pause."""
    from model_runtime.pool.pool import WorkerPool

    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", 60.0)
    launched = _spawn_killing(monkeypatch, lambda i: i == 1)
    pool = WorkerPool({**BASE, "world_size": 2, "sp": 1, "fsdp": False})
    outcome = []
    starter = threading.Thread(target=lambda: outcome.append(_outcome(pool.start)))
    starter.start()
    deadline = time.monotonic() + 60
    while "forming it again in 60s" not in caplog.text:
        assert time.monotonic() < deadline and starter.is_alive(), (outcome, caplog.text)
        time.sleep(0.01)
    closed = time.monotonic()
    pool.close()
    starter.join(timeout=5)
    took = time.monotonic() - closed
    assert not starter.is_alive() and took < 2, f"the start ended {took:.1f}s after close(), during a 60 s pause"
    assert isinstance(outcome[0], BackendUnavailableError) and "closed while starting" in str(outcome[0]), outcome
    assert len(launched) == 2, "a world was formed again after close()"
    assert not _running(launched), "workers outlived the closed start"


# The join bound of the tests below: past a healthy rank's start to its rendezvous (seconds of imports where it
# starts cold; a fork from the zygote under a loaded CI machine's scheduling otherwise).
JOIN_S = 60.0 if warm_start.cold_only() else 10.0


def test_a_worker_that_never_joins_the_process_group_has_the_world_formed_again(local, monkeypatch, caplog):
    """A rank alive but stopped before the rendezvous (SIGSTOP here; a hung import or device in
    practice) is caught by the join bound, not the start's (which covers loading a checkpoint): it
    counts as lost, the world is formed again at once, and the log names the rank."""
    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", 0.05)
    launched = _spawn_stopping(monkeypatch, lambda i: i == 1)
    started = time.monotonic()
    # The start's bound, lowered from 1800 s only so that a start without the join bound fails here instead of hanging.
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False, "worker_join_timeout_s": JOIN_S,
                       "worker_start_timeout_s": JOIN_S + 40})
    took = time.monotonic() - started
    try:
        assert took < JOIN_S + 40, f"the start took {took:.0f}s"
        assert len(launched) == 4 and pool.worker_pids() == [p.pid for p in launched[2:]], pool.worker_pids()
        want = (f"worker pool generation 1 not formed: worker rank 1 (pid {launched[1].pid}) did not reach the "
                f"process group's rendezvous within {JOIN_S:g}s of the launch (still running); rank 0 waited there")
        assert want in caplog.text, caplog.text
        work = rows(pool.info.vocab_size, 1, seed=7)
        assert_same(pool.score_row(work[0]), local.score_row(work[0]), "row 0")
        assert not _running(launched[:2]), "the first world's workers outlived it"
    finally:
        pool.close()


def test_a_join_bound_above_the_worker_timeout_still_names_the_rank_that_never_joined(monkeypatch, caplog):
    """``worker_timeout_s`` (the rows' bound before a rate is measured) set below the join bound:
    torch's own bound on the rendezvous must not end it first (rank 0's store giving up on its
    clients fails the start at once, naming no absent rank); the join bound catches the rank."""
    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", 0.05)
    launched = _spawn_stopping(monkeypatch, lambda i: i == 1)
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False, "worker_join_timeout_s": JOIN_S,
                       "worker_timeout_s": JOIN_S / 2, "worker_start_timeout_s": JOIN_S + 40})
    try:
        want = (f"worker pool generation 1 not formed: worker rank 1 (pid {launched[1].pid}) did not reach the "
                f"process group's rendezvous within {JOIN_S:g}s of the launch (still running); rank 0 waited there")
        assert want in caplog.text, caplog.text
        assert pool.is_alive() and pool.worker_pids() == [p.pid for p in launched[2:]], pool.worker_pids()
    finally:
        pool.close()


def test_a_worker_that_never_joins_at_any_attempt_fails_the_start_naming_it(monkeypatch):
    monkeypatch.setattr(supervisor, "FIRST_WORLD_PAUSE_S", 0.05)
    launched = _spawn_stopping(monkeypatch, lambda i: i % 2 == 0)
    started = time.monotonic()
    with pytest.raises(WorkerLost) as caught:
        start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False, "worker_join_timeout_s": JOIN_S,
                    "worker_start_timeout_s": JOIN_S + 40})
    took = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message and f"lost at each of {FIRST_WORLD_ATTEMPTS} attempts" in message, message
    assert (f"worker rank 0 (pid {launched[-2].pid}) did not reach the process group's rendezvous within {JOIN_S:g}s "
            "of the launch (still running); rank 1 waited there") in message, message
    bound = FIRST_WORLD_ATTEMPTS * (JOIN_S + 10)
    assert len(launched) == 2 * FIRST_WORLD_ATTEMPTS and took < bound, f"{len(launched)} workers in {took:.0f}s"
    assert not _running(launched), "workers outlived the failed start"


def test_a_load_error_a_worker_reports_fails_the_start_at_once(checkpoint_dir, tmp_path, monkeypatch):
    """A checkpoint refused while the ranks read it (NaN here) is no lost worker: one world, no retry."""
    from model_runtime.scoring.checkpoint_error import CheckpointError
    from tests.checkpoints import rewrite_checkpoint

    name = "model.layers.3.self_attn.q_proj.weight"
    nan = rewrite_checkpoint(checkpoint_dir("qwen3_5"), tmp_path / "nan", lambda t: {**t, name: t[name] * float("nan")})
    launched = _spawn_killing(monkeypatch, lambda i: False)
    with pytest.raises(CheckpointError) as caught:
        start_pool({**BASE, "model": str(nan), "world_size": 2, "sp": 1, "fsdp": True})
    assert caught.value.kind == "non_finite" and name in str(caught.value), caught.value
    assert len(launched) == 2, f"{len(launched)} workers launched for a checkpoint every rank refuses"
    assert not _running(launched), "workers outlived the failed start"


def test_close_during_the_first_world_kills_its_loading_workers_at_once(monkeypatch):
    """The server's exit during the start (a SIGTERM) closes the pool still starting: its workers
    go with it, not seconds later when they notice the server is gone."""
    from model_runtime.pool.pool import WorkerPool

    launched = _spawn_killing(monkeypatch, lambda i: False)
    pool = WorkerPool({**BASE, "world_size": 2, "sp": 1, "fsdp": False})
    outcome = []
    starter = threading.Thread(target=lambda: outcome.append(_outcome(pool.start)))
    starter.start()
    deadline = time.monotonic() + 60
    while len(launched) < 2:
        assert time.monotonic() < deadline and starter.is_alive(), outcome
        time.sleep(0.001)
    pool.close()
    assert _gone_within(launched, 2.0), f"workers {_running(launched)} outlived close()"
    starter.join(timeout=30)
    assert isinstance(outcome[0], BackendUnavailableError) and "closed while starting" in str(outcome[0]), outcome
    assert len(launched) == 2, "a world was formed again after close()"


def _outcome(fn):
    try:
        return fn()
    except Exception as error:
        return error


def _gone_within(procs, seconds: float) -> bool:
    """SIGKILL is sent at once; its process disappears a moment later."""
    deadline = time.monotonic() + seconds
    while _running(procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_close_during_a_restart_returns_once_the_restart_loop_has_ended(caplog):
    """A worker lost while serving starts a restart loop in a daemon thread; close() (the server's
    exit) kills the world it forms and returns only once that loop has ended: a line it logged
    while the server's interpreter finalised aborted the process ("could not acquire lock for
    <stderr>", status -6)."""
    caplog.set_level(logging.INFO, logger="model_runtime.pool.supervisor")
    pool = start_pool({**BASE, "world_size": 2, "sp": 1, "fsdp": False})
    try:
        pool.warm_up()
        victim = pool.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pool._starting is None:  # the restart's world is loading
            assert time.monotonic() < deadline, "no restart began after a worker was killed"
            time.sleep(0.01)
    finally:
        pool.close()
    restart = pool._restart_thread
    assert restart is not None and not restart.is_alive(), "the restart loop outlived close()"
    assert "worker pool restart abandoned" in caplog.text, caplog.text[-2000:]


def test_a_restart_whose_thread_was_refused_is_started_by_the_pools_next_use(local, monkeypatch, caplog):
    """A restart loop whose thread the process's thread limit refuses is started by the next use of
    the pool past a pause, so the pool is not left down (503, /readyz not ready) until packscore restarts."""
    caplog.set_level(logging.INFO, logger="model_runtime.pool.supervisor")
    pool = start_pool({**BASE, "world_size": 1, "sp": 1, "fsdp": False})
    try:
        (row,) = rows(pool.info.vocab_size, 1, seed=3)
        refused: list[threading.Thread] = []
        real_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            if thread.name == "pool-restart" and not refused:  # the first restart loop only
                refused.append(thread)
                raise RuntimeError("can't start new thread")
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", start)
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not refused or pool._restarting:
            assert time.monotonic() < deadline, "the killed worker's failure refused no restart loop"
            time.sleep(0.01)
        why = pool.restart_error  # /readyz says restart_failed, /score's 503 names it
        with pytest.raises(BackendUnavailableError):
            pool.score_row(row)
        deadline = time.monotonic() + 90
        while not pool.is_alive():  # the service's submit and readiness check ask this
            assert time.monotonic() < deadline, f"the pool did not come back within 90s: {pool.restart_error}"
            time.sleep(0.2)
        assert pool.restarts == 1 and pool.restart_error is None
        assert why is not None and "thread limit" in why, why
        assert "its restart started, after its thread was refused" in caplog.text, caplog.text[-2000:]
        assert_same(pool.score_row(row), local.score_row(row), "after the refused restart")
    finally:
        pool.close()
