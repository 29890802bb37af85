"""Concurrency corners of the serving path, with a controllable fake backend where timing must be
forced: what a request that ends early leaves counted, a drain beginning between a check and the
admission it guards, a thread's state read by the event loop mid-change, and an error that asyncio
refuses to hand from a thread to the loop (which stalled whoever awaited it)."""

import asyncio
import re
import threading
import time

import numpy as np

from model_runtime.scoring.backend import STALL_UNMEASURED_S
from model_runtime.types import SequenceInput
from service.http.app import create_app
from service.http.errors import ApiError, draining_error
from service.scheduling.forward_thread import ForwardThread, forward_state
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.testing import FakeBackend, running_app


def _ids(n: int, start: int = 1) -> list[int]:
    return (np.arange(start, start + n) % 900).tolist()


def _tokens_scored(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^packscore_tokens_scored_total\{[^}]*\} (\S+)$", text, re.M))


def test_tokens_scored_counts_only_tokens_returned_to_clients():
    """A request whose first row was scored but which then failed (a sequence too large alone: 413) or
    passed its deadline (504) returned no log-probability: packscore_tokens_scored_total must not
    count its delivered sequences (else it drifts above the 200s' usage.scored_tokens)."""
    async def main():
        # 413: a row of 10 + 60 tokens fails, is split; the 10 is scored and delivered, the 60 fails alone.
        backend = FakeBackend(oom_above_tokens=50, seconds_per_token=0.01)
        app = create_app(Settings(max_batch_tokens=100, max_wait_ms=50), backend)
        async with running_app(app) as client:
            base = _tokens_scored((await client.get("/metrics")).text)
            too_large = await client.post("/score", json={"sequences": [{"input_ids": _ids(10)}, {"input_ids": _ids(60)}]})
            # 504: a row of 45 + 45 fails and runs again in halves (0.45 s each): the first half is
            # delivered, the deadline falls during the second.
            late = await client.post("/score", json={"sequences": [{"input_ids": _ids(45)}, {"input_ids": _ids(45, 7)}],
                                                      "deadline_ms": 700})
            ok = await client.post("/score", json={"sequences": [{"input_ids": _ids(5)}]})
            await asyncio.sleep(0.5)  # the late request's second row ends
            return too_large, late, ok, _tokens_scored((await client.get("/metrics")).text) - base, backend.rows

    too_large, late, ok, counted, rows = asyncio.run(main())
    assert too_large.status_code == 413, too_large.text
    assert late.status_code == 504, (late.text, rows)
    assert ok.status_code == 200 and ok.json()["usage"]["scored_tokens"] == 4, ok.text
    assert counted == 4, f"packscore_tokens_scored_total grew by {counted}; the only 200 returned 4 scored tokens (rows {rows})"


def test_a_request_that_starts_waiting_for_room_after_the_drain_began_gets_the_drains_503():
    """score_request checks the phase, then its admission runs in a task of its own: a drain that
    begins in between (SIGTERM's callback is already queued) has already failed the waiters. A
    request that only then starts waiting for room must get the drain's 503 at once, as the waiters
    did (docs/admission.md), not wait out --max-admission-wait-s and then get 429 or run."""
    async def main():
        gate = threading.Event()
        scheduler = Scheduler(FakeBackend(gate=gate), max_batch_tokens=100, max_wait_ms=0, max_queued_tokens=100,
                              max_admission_wait_s=2.0)
        await scheduler.start()
        scheduler.submit([SequenceInput(np.arange(1, 101))])  # the whole bound, held in its forward
        scheduler.stop_admitting(draining_error())
        started = time.monotonic()
        try:
            await scheduler.submit_when_room([SequenceInput(np.arange(1, 11))])
            outcome = "admitted"
        except ApiError as exc:
            outcome = exc.status
        waited = time.monotonic() - started
        gate.set()
        await scheduler.close()
        return outcome, waited

    outcome, waited = asyncio.run(main())
    assert outcome == 503 and waited < 0.5, f"after the drain began: {outcome} after waiting {waited:.2f} s for room"


class _SwitchingThread:
    """A forward thread whose reader is interrupted, right after its first read, by the thread starting
    a forward (the interleaving a thread switch may produce). It speaks both ways of publishing that
    state: ``started_at`` then ``running`` (two attributes), or ``since`` (one)."""

    def __init__(self, idle_since: float):
        self._started_at, self.running, self.expected_s, self._since, self._switched = idle_since, False, None, None, False

    def _switch(self):
        if not self._switched:
            self._switched = True
            self._started_at, self.running = time.monotonic(), True
            self._since = self._started_at

    @property
    def started_at(self):
        value = self._started_at
        self._switch()
        return value

    @property
    def since(self):
        value = self._since
        self._switch()
        return value


def test_a_forward_starting_while_readiness_reads_its_thread_is_not_stalled():
    """forward_state read a thread's start time, then whether it runs: a forward starting in between
    (after a long idle spell) read as one running since the previous forward, 'stalled', and /readyz
    answered 503 for a healthy server."""
    thread = _SwitchingThread(idle_since=time.monotonic() - 10 * STALL_UNMEASURED_S)
    state = forward_state([thread])
    assert state in ("idle", "busy"), f"a forward that had just started read as {state!r}"


def test_a_forward_queued_behind_another_does_not_run_once_its_runner_was_cancelled():
    """A scheduler's close cancels its runners, then stops their threads: a forward one of them had queued
    behind the forward under way must not run after it, for nobody: it would keep the offline run's exit
    waiting (or, where the exit does not wait, run torch under the interpreter's teardown: SIGABRT)."""
    release, ran = threading.Event(), []

    async def main():
        thread = ForwardThread("test-forward")
        first = asyncio.create_task(thread.run(release.wait))
        queued = asyncio.create_task(thread.run(ran.append, "queued"))
        await asyncio.sleep(0.05)  # the first runs, the second waits in the thread's queue
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        release.set()
        await first
        thread.stop()
        for _ in range(200):
            if not thread.alive:
                break
            await asyncio.sleep(0.01)
        return thread.alive

    assert asyncio.run(main()) is False
    assert ran == [], "a cancelled runner's forward ran"


class _StopIterationOnce(FakeBackend):
    """A backend whose first forward fails with StopIteration (a bug in it: next() on an empty iterator)."""

    def score_row(self, sequences, group=None):
        if not getattr(self, "failed_once", False):
            self.failed_once = True
            raise StopIteration
        return super().score_row(sequences, group)


def test_a_forward_failing_with_stop_iteration_fails_its_request_and_the_queue_moves_on():
    """asyncio refuses StopIteration into a future: handing it over from the forward thread raised
    TypeError in the loop's callback, the runner waited forever and no row ran again (every request
    then 504 or 429, forever). Its request must fail alone (500), as any failing forward's does."""
    async def main():
        scheduler = Scheduler(_StopIterationOnce(), max_batch_tokens=100, max_wait_ms=0, max_queued_tokens=1000)
        await scheduler.start()
        outcomes = []
        for _ in range(2):
            ticket = scheduler.submit([SequenceInput(np.arange(1, 9))])
            try:
                await asyncio.wait_for(asyncio.shield(ticket.future), 5)
                outcomes.append(200)
            except ApiError as exc:
                outcomes.append(exc.status)
            except TimeoutError:
                outcomes.append("hung")
        await scheduler.close()
        return outcomes

    assert asyncio.run(main()) == [500, 200]


def test_a_load_failing_with_stop_iteration_fails_the_start():
    """The same hand-over from the load thread: a load that raised StopIteration left the service
    'loading' forever (/readyz 503, never exiting) instead of failing the start with the reason."""
    def load():
        raise StopIteration

    async def main():
        app = create_app(Settings(), load)
        async with app.router.lifespan_context(app):
            service = app.state.service
            for _ in range(200):
                if service.phase != "loading":
                    break
                await asyncio.sleep(0.02)
            return service.phase, service.fatal_error

    phase, why = asyncio.run(main())
    assert phase == "failed" and "StopIteration" in (why or ""), (phase, why)


def test_an_update_failing_with_stop_iteration_is_answered_and_the_next_one_runs(tmp_path):
    """The update's thread hands its outcome over through asyncio.to_thread, which refuses StopIteration
    the same way: unanswered, the model would stay 'updating', every later update would get 409
    update_in_progress and a drain would wait its whole timeout for it."""
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-2").mkdir()
    failed = []

    def check(path):
        if not failed:
            failed.append(path)
            raise StopIteration

    async def main():
        app = create_app(Settings(weights_root=tmp_path), FakeBackend(check_checkpoint=check))
        async with running_app(app) as client:
            first = asyncio.ensure_future(client.post("/v1/weights", json={"path": "step-1"}))
            await asyncio.wait({first}, timeout=3)  # not cancelled: a server never cancels a waiting handler
            second = await asyncio.wait_for(client.post("/v1/weights", json={"path": "step-2"}), 5)
            outcome = first.result().status_code if first.done() else "unanswered"
            first.cancel()
            return outcome, second.status_code

    first, second = asyncio.run(main())
    assert first not in ("unanswered", 409) and second == 200, (first, second)


def test_a_request_waiting_to_hold_swaps_is_not_overtaken_by_the_next_update(tmp_path):
    """A request due to re-score after two swaps waits (``_hold_swaps``, polling) for the running update
    to end: an update sent as that one ended started first, and back-to-back updates kept it waiting up
    to its deadline. Once the running update ends, the waiting request holds before any new one starts."""
    from service.http.scoring import _hold_swaps
    from service.http.weights import update_weights
    from service.testing import running_app

    (tmp_path / "step-1").mkdir()
    load = threading.Event()

    async def main():
        app = create_app(Settings(weights_root=tmp_path), FakeBackend(load_gate=load))
        async with running_app(app) as client:
            model = app.state.service.default
            model.updating = True  # an update runs
            holding = asyncio.ensure_future(_hold_swaps(model, None))
            await asyncio.sleep(0.05)  # the request waits for its end
            for _ in range(2):  # a poll of the request's due now runs first (its next is 10 ms away)
                await asyncio.sleep(0)
            model.updating = False  # it ended, and the next update comes at once (before the request's next poll)
            update = asyncio.ensure_future(update_weights(app.state.service, {"path": "step-1", "version": "v1"}, tmp_path))
            await asyncio.wait({holding}, timeout=2)
            held = holding.done() and model.swap_holds == 1
            started_first = model.updating
            if held:
                model.swap_holds -= 1  # the request's re-score is done: its hold is given back
            load.set()
            holding.cancel()
            return held, started_first, await asyncio.wait_for(update, 10), (await client.get("/readyz")).status_code

    held, started_first, update, ready = asyncio.run(main())
    assert held and not started_first, f"the request held: {held}; the next update started before it: {started_first}"
    assert update["weights_version"] == "v1" and ready == 200, (update, ready)


def _update_without_a_load_thread(tmp_path, monkeypatch):
    """An update whose load thread the process's thread limit refuses ("can't start new thread"), then
    the same update with threads again: (the first's answer, "updating" after it, the second's, metrics)."""
    from service.load_thread import LOAD_THREAD

    (tmp_path / "step-1").mkdir()
    start = threading.Thread.start

    def refused(thread):
        if thread.name == LOAD_THREAD:
            raise RuntimeError("can't start new thread")
        return start(thread)

    async def main():
        app = create_app(Settings(weights_root=tmp_path), FakeBackend())
        async with running_app(app) as client:
            with monkeypatch.context() as patched:
                patched.setattr(threading.Thread, "start", refused)
                first = await asyncio.wait_for(client.post("/v1/weights", json={"path": "step-1"}), 5)
            updating = app.state.service.default.updating
            second = await asyncio.wait_for(client.post("/v1/weights", json={"path": "step-1"}), 5)
            return first, updating, second, (await client.get("/metrics")).text

    return asyncio.run(main())


def test_an_update_whose_load_thread_cannot_start_is_answered_and_the_next_one_runs(tmp_path, monkeypatch):
    """A load thread refused by the process's thread limit ("can't start new thread") raises before
    ``ended`` is set to run: unanswered, the model would stay 'updating' for good, every later update
    would get 409 update_in_progress and a drain would wait its whole timeout for it."""
    first, updating, second, _ = _update_without_a_load_thread(tmp_path, monkeypatch)
    assert first.status_code not in (200, 409, 500) and not updating, (first.status_code, first.text, updating)
    assert second.status_code == 200, (second.status_code, second.text)


def test_an_update_whose_load_thread_cannot_start_is_the_servers_503_not_a_bad_checkpoint(tmp_path, monkeypatch):
    """The thread limit's RuntimeError fell into the failed load's branch: 422 unreadable_checkpoint, which
    tells the trainer its checkpoint is bad. It is the server's momentary condition: 503 backend_unavailable
    with Retry-After, counted so, and the same checkpoint is served once threads start again."""
    first, _, second, metrics = _update_without_a_load_thread(tmp_path, monkeypatch)
    error = first.json()["error"]
    assert (first.status_code, error["type"]) == (503, "backend_unavailable"), first.text
    assert first.headers.get("retry-after") == "5" and "checkpoint was not read" in error["message"], (first.headers, error)
    counted = re.findall(r'^packscore_weights_updates_total\{model="fake-model",outcome="(\w+)"\} (\S+)$', metrics, re.M)
    outcomes = {outcome: float(value) for outcome, value in counted}
    assert (outcomes["backend_unavailable"], outcomes["unreadable_checkpoint"], outcomes["ok"]) == (1, 0, 1), outcomes
    assert second.status_code == 200, second.text
