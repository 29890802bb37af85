"""Admission in time (service/scheduling/admission.py) and the row builder's bounded look-ahead."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import asynccontextmanager

import numpy as np
import pytest

from model_runtime.types import SequenceInput
from service.http.app import create_app
from service.scheduling.admission import Admission, QueueFullError
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.testing import FakeBackend, running_app, wait_until


def admission(**overrides) -> Admission:
    options = dict(gpus=1, row_tokens=100, queue_seconds=2.0, floor_rows=3, max_tokens=10_000, max_wait_s=5.0)
    return Admission(**{**options, **overrides})


def test_the_bound_is_the_row_floor_until_measured_then_seconds_of_work_capped_by_max_tokens():
    a = admission(gpus=2)
    assert a.bound == 3 * 100 * 2  # nothing measured: three rows per GPU
    a.observe(10, 0.01)  # a tenth of a row (the readiness pass): only a prior
    assert a.rate == pytest.approx(1000.0) and a.bound == 2 * 1000 * 2
    a.observe(10, 0.001)  # more small rows change nothing
    assert a.rate == pytest.approx(1000.0)
    a.observe(100, 0.2)  # the first full row replaces the prior: 500 tokens/s per GPU
    assert a.rate == pytest.approx(500.0) and a.bound == 2 * 500 * 2  # 2 s of work on each of 2 GPUs
    a.observe(100, 0.05)  # a second forward moves the average only as time passes (half-life 10 s)
    assert 500.0 < a.rate < 510.0
    a.rate = 50.0  # a slow GPU: the floor of three rows per GPU holds
    assert a.bound == 3 * 100 * 2
    a.rate = 100_000.0  # a fast GPU: the hard cap decides
    assert a.bound == 10_000
    assert admission(queue_seconds=None).bound == 10_000  # no time bound: the cap alone


def test_a_request_over_the_bound_waits_for_room_first_come_first_served():
    async def main():
        a = admission()
        assert a.try_admit(250)
        big = asyncio.ensure_future(a.admit(200))  # 450 > 300: waits
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(a.admit(10))  # would fit, but waits behind the big one
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done() and a.waiting == 210
        a.release(160)  # 90 + 200 + 10 fit the 300-token bound
        await asyncio.gather(big, small)
        return a.admitted, a.waiting

    assert asyncio.run(main()) == (300, 0)


def test_a_request_larger_than_the_bound_is_admitted_once_nothing_else_is():
    async def main():
        a = admission()
        assert a.try_admit(50)
        huge = asyncio.ensure_future(a.admit(5000))
        await asyncio.sleep(0.01)
        assert not huge.done()
        a.release(50)
        await huge
        return a.admitted

    assert asyncio.run(main()) == 5000


def test_the_wait_ends_in_queue_full_with_a_retry_after_that_keeps_the_gpu_busy():
    async def main():
        a = admission(max_wait_s=0.05)
        a.observe(100, 0.1)  # 1,000 tokens/s: the bound is the 300-token floor (2 s would be 2,000)
        a.queue_seconds = 0.1
        assert a.bound == 300
        assert a.try_admit(300)
        t0 = time.monotonic()
        with pytest.raises(QueueFullError) as refused:
            await a.admit(5000 - 300)  # would fit in 4.7 s, but the queue keeps the GPU busy 0.3 s
        return refused.value, time.monotonic() - t0, a.waiting

    error, waited, waiting = asyncio.run(main())
    assert 0.04 <= waited < 1.0 and waiting == 0
    assert error.retry_after_s == 1  # at most half the queued work, at least a second
    a = admission()
    a.observe(100, 0.1)
    assert a.try_admit(300) and a.try_admit(1700)  # 2 s of work admitted
    a.queue_seconds = 0.1  # now far over the bound
    assert a.retry_after_s(5000) == 1  # the queue lasts 2 s: back within half of that


def test_before_a_full_row_is_measured_a_429_says_retry_after_one_second():
    # the readiness pass's small row is mostly fixed cost: 20 tokens/s, where a full row runs far faster
    a = admission(max_tokens=100_000)
    a.observe(10, 0.5)
    assert a.try_admit(300)  # the 300-token floor: at the prior's rate 15 s of work, in truth much less
    assert a.retry_after_s(500) == 1  # not 7 s: a client sleeping that long would find the GPU idle
    a.observe(100, 0.1)  # a full row: 1,000 tokens/s, and the hint follows the measured rate again
    a.queue_seconds = 20.0
    assert a.try_admit(19_700)  # 20 s of work admitted
    a.queue_seconds = 0.1
    assert a.retry_after_s(5000) == 10  # half the 20 s the admitted work lasts


def test_the_waiting_line_is_bounded_and_a_caller_who_leaves_frees_its_place():
    async def main():
        a = admission(max_tokens=1000)
        assert a.try_admit(200)
        first = asyncio.ensure_future(a.admit(900))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            await a.admit(200)  # the line would hold 1,100 > 1,000 tokens: refused at once
        second = asyncio.ensure_future(a.admit(100))
        await asyncio.sleep(0.01)
        first.cancel()  # its client went away; the one behind it now fits
        await second
        return a.admitted, a.waiting

    assert asyncio.run(main()) == (300, 0)


def test_close_fails_the_waiting_requests():
    async def main():
        a = admission()
        assert a.try_admit(300)
        waiting = asyncio.ensure_future(a.admit(100))
        await asyncio.sleep(0.01)
        a.close(RuntimeError("stopping"))
        with pytest.raises(RuntimeError, match="stopping"):
            await waiting
        return a.waiting, a.admitted

    assert asyncio.run(main()) == (0, 300)


@asynccontextmanager
async def _first_request_held():
    """A server that admits 100 tokens, its forward held on a first request of 60 (the readiness pass
    ran already); yields the app, its client, the gate that releases the forward and that request,
    which leaving releases and awaits."""
    gate = threading.Event()
    backend = FakeBackend()
    settings = Settings(max_batch_tokens=100, max_wait_ms=0, max_queued_tokens=100, max_admission_wait_s=20)
    app = create_app(settings, backend)
    async with running_app(app) as client:
        backend.gate = gate
        first = asyncio.ensure_future(client.post("/score", json={"sequences": [{"input_ids": [1] * 60}]}))
        await wait_until(lambda: app.state.service.scheduler.queued_tokens == 60)
        try:
            yield app, client, gate, first
        finally:
            gate.set()
            await first


def test_over_http_a_request_beyond_the_bound_waits_server_side_instead_of_429():
    async def main():
        async with _first_request_held() as (app, client, gate, first):
            waits = asyncio.ensure_future(client.post("/score", json={"sequences": [{"input_ids": [2] * 60}]}))
            await wait_until(lambda: app.state.service.scheduler.admission.waiting == 60)
            gate.set()
            return await first, await waits

    first, waited = asyncio.run(main())
    assert first.status_code == 200 and waited.status_code == 200, waited.text


def test_a_deadline_shorter_than_the_wait_ends_the_wait_in_504():
    """The request's own deadline passed before its result was ready (API.md's 504); a 429 would
    tell the client to retry after a deadline that has already gone."""
    async def main():
        async with _first_request_held() as (_, client, _, _):
            t0 = time.monotonic()
            late = await client.post("/score", json={"sequences": [{"input_ids": [2] * 60}], "deadline_ms": 100})
            return late, time.monotonic() - t0

    late, waited = asyncio.run(main())
    assert late.status_code == 504 and late.json()["error"]["type"] == "deadline_exceeded", late.text
    assert late.json()["error"]["param"] == "deadline_ms" and 0.09 < waited < 5, (late.text, waited)


def _seqs(*lengths):
    return [SequenceInput(np.arange(1, n + 1) % 900) for n in lengths]


async def _first_row_held():
    """A started scheduler of 100-token rows whose forward holds its first row, one sequence of 100,
    until the gate returned is set; returns the gate, the backend, the scheduler and that row's ticket."""
    gate = threading.Event()
    backend = FakeBackend(gate=gate)
    scheduler = Scheduler(backend, max_batch_tokens=100, max_wait_ms=0, max_queued_tokens=10_000)
    await scheduler.start()
    hold = scheduler.submit(_seqs(100))
    await wait_until(lambda: len(backend.rows) == 1)
    return gate, backend, scheduler, hold


def test_rows_start_with_the_oldest_and_fill_largest_first_within_the_window():
    async def main():
        gate, backend, scheduler, hold = await _first_row_held()  # the rest queue up meanwhile
        # FIFO would give [30, 30, 30], [60, 20], [70]; largest-first after the head fills 100s.
        tickets = [scheduler.submit(_seqs(n)) for n in (30, 30, 30, 60, 20, 70)]
        gate.set()
        await asyncio.gather(hold.future, *(t.future for t in tickets))
        await scheduler.close()
        return backend.rows[1:]

    rows = asyncio.run(main())
    assert rows == [[30, 70], [30, 60], [30, 20]], rows


def test_newer_sequences_beyond_the_age_window_do_not_overtake(monkeypatch):
    import service.scheduling.row_queue as row_queue

    monkeypatch.setattr(row_queue, "_LOOKAHEAD_AGE_S", 0.05)

    async def main():
        gate, backend, scheduler, hold = await _first_row_held()
        filler = scheduler.submit(_seqs(100))  # a second row formed at once: no third until one ends
        old = [scheduler.submit(_seqs(n)) for n in (40, 70)]
        await asyncio.sleep(0.2)
        new = scheduler.submit(_seqs(60))  # would fill the 40's row exactly, but arrived too late
        gate.set()
        await asyncio.gather(hold.future, filler.future, *(t.future for t in old), new.future)
        await scheduler.close()
        return backend.rows[1:]

    assert asyncio.run(main()) == [[100], [40], [70], [60]]


def test_a_partial_row_waits_for_more_sequences_no_longer_than_a_deadline_allows():
    """--max-wait-ms holds a partial row for more sequences; one whose deadline is nearer must
    still be scored in time rather than answered 504 by an idle server."""

    async def main():
        backend = FakeBackend()
        scheduler = Scheduler(backend, max_batch_tokens=100, max_wait_ms=10_000, max_queued_tokens=10_000)
        await scheduler.start()
        first = scheduler.submit(_seqs(10))  # after a quiet spell: runs at once
        await wait_until(lambda: len(backend.rows) == 1)
        started = time.monotonic()
        # It would wait 10 s for company; its row starts at half its 2 s (a loaded machine's margin).
        second = scheduler.submit(_seqs(10), deadline=started + 2.0)
        got = await asyncio.wait_for(second.future, 5.0)
        took = time.monotonic() - started
        await first.future
        await scheduler.close()
        return got, took

    got, took = asyncio.run(main())
    assert len(got) == 1 and took < 2.0, f"scored after {took:.2f} s against a 2 s deadline"


def test_the_default_body_limit_holds_the_largest_admissible_json_request():
    """Every admissible token at its longest in JSON (json.dumps' separators, a 6-digit id, a rollout
    log-prob of 24 characters) over the most sequences a request may hold fits the default limit."""
    settings = Settings()
    n_seq = settings.max_sequences_per_request
    length = settings.queued_tokens // n_seq
    sequence = json.dumps({"id": "traj-000017", "input_ids": [248319] * length, "score_from": 1,
                           "rollout_logprobs": [-2.2250738585072014e-308] * (length - 1)})
    body = json.dumps({"model": "policy", "sequences": [], "temperature": 1.0, "return_entropy": True, "top_k": 20,
                       "deadline_ms": 60000, "weights_version": "step-000120"}).replace('"sequences": []', '"sequences": ['
                                                                                        + ", ".join([sequence] * n_seq) + "]")
    assert n_seq * length == settings.queued_tokens
    assert len(body.encode()) <= settings.request_bytes, (len(body.encode()), settings.request_bytes)
