"""Scheduler behaviour with a fake backend: packing, FIFO fairness, OOM split-retry, deadlines,
admission, disconnects, backend failures, concurrency."""

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager

import msgpack
import numpy as np
import orjson

from model_runtime.scoring.backend import BackendUnavailableError
from model_runtime.types import SequenceInput
from service.http.app import create_app
from service.http.errors import is_out_of_memory
from service.scheduling.scheduler import Scheduler
from service.settings import Settings
from service.testing import FakeBackend, expected_scores, running_app, wait_until


def seqs_of(*lengths, start=1):
    return [SequenceInput(np.arange(start, start + n) % 900) for n in lengths]


async def started(backend, **kwargs):
    options = dict(max_batch_tokens=100, max_wait_ms=0, max_queued_tokens=10_000)
    scheduler = Scheduler(backend, **{**options, **kwargs})
    await scheduler.start()
    return scheduler


def test_rows_respect_the_token_budget_and_results_come_back_per_request():
    async def main():
        gate = threading.Event()
        backend = FakeBackend(gate=gate)
        scheduler = await started(backend, max_batch_tokens=100)
        rng = np.random.default_rng(0)
        requests = [seqs_of(*rng.integers(1, 60, size=rng.integers(1, 5))) for _ in range(30)]
        tickets = [scheduler.submit(r) for r in requests]
        gate.set()
        results = await asyncio.gather(*(t.future for t in tickets))
        await scheduler.close()
        return backend, requests, results

    backend, requests, results = asyncio.run(main())
    assert all(sum(row) <= 100 for row in backend.rows), backend.rows
    assert sum(len(row) for row in backend.rows) == sum(len(r) for r in requests)
    for request, result in zip(requests, results):
        for seq, got in zip(request, result):
            np.testing.assert_array_equal(got.logprobs, expected_scores(seq).logprobs)


def test_a_sequence_longer_than_the_budget_gets_a_row_of_its_own():
    async def main():
        gate = threading.Event()
        backend = FakeBackend(gate=gate)
        scheduler = await started(backend, max_batch_tokens=50)
        tickets = [scheduler.submit(seqs_of(10)), scheduler.submit(seqs_of(120, 10)), scheduler.submit(seqs_of(20))]
        gate.set()
        await asyncio.gather(*(t.future for t in tickets))
        await scheduler.close()
        return backend.rows

    rows = asyncio.run(main())
    assert [120] in rows, rows
    assert all(sum(row) <= 50 for row in rows if row != [120])


def test_fifo_a_big_request_is_not_starved_by_a_stream_of_small_ones():
    async def main():
        backend = FakeBackend(seconds_per_token=0.0002)
        scheduler = await started(backend, max_batch_tokens=100, max_wait_ms=1)
        big = scheduler.submit(seqs_of(*[45] * 20, start=3))  # 900 tokens: 10 rows of 2
        small_done_before_big = 0
        smalls = []
        while not big.done:  # small requests keep arriving for as long as the big one runs
            smalls.append(scheduler.submit(seqs_of(45)))
            await asyncio.sleep(0.002)
        await big.future
        small_done_before_big = sum(t.done for t in smalls)
        await asyncio.gather(*(t.future for t in smalls))
        await scheduler.close()
        return backend.rows, small_done_before_big, len(smalls)

    rows, small_before, small_total = asyncio.run(main())
    # The big request's 20 sequences were first in line: they take the first 10 rows.
    first = [n for row in rows[:10] for n in row]
    assert len(first) == 20 and small_before <= 1, (rows[:12], small_before, small_total)


def test_out_of_memory_is_retried_in_halves_and_only_the_oversized_request_fails():
    async def main():
        backend = FakeBackend(oom_above_tokens=60)
        app = create_app(Settings(max_batch_tokens=200, max_wait_ms=50), backend)
        async with running_app(app) as client:
            ok = [{"input_ids": list(range(1, 31))} for _ in range(3)]
            too_big = [{"input_ids": list(range(1, 81))}]
            responses = await asyncio.gather(
                client.post("/score", json={"sequences": ok}),
                client.post("/score", json={"sequences": ok[:1] + too_big}),
                client.post("/score", json={"sequences": ok[:2]}),
            )
            after = await client.post("/score", json={"sequences": ok})
            ready = await client.get("/readyz")
            return backend.rows, responses, after, ready

    rows, responses, after, ready = asyncio.run(main())
    assert [r.status_code for r in responses] == [200, 413, 200], [r.text for r in responses]
    assert responses[1].json()["error"] == {
        "type": "sequence_too_large",
        "message": responses[1].json()["error"]["message"],
        "param": "sequences[1].input_ids",
    }
    # Like every 413, it names the limits to split under (here only max_model_len would not help).
    assert int(responses[1].headers["X-Packscore-Max-Model-Len"]) > 0, dict(responses[1].headers)
    assert any(sum(row) > 60 for row in rows), "the first row should have been too large"
    assert [80] in rows, "the oversized sequence must have been tried alone"
    assert after.status_code == 200 and ready.status_code == 200


def test_out_of_memory_detection():
    class OutOfMemoryError(RuntimeError):  # the name torch uses, without importing torch here
        pass

    assert is_out_of_memory(OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_backend_unavailable_answers_503_with_retry_after_and_readiness_drops(caplog):
    async def main():
        backend = FakeBackend()
        app = create_app(Settings(), backend)
        async with running_app(app) as client:
            backend.unavailable = True
            started_at = time.monotonic()
            response = await client.post("/score", json={"sequences": [{"input_ids": [1, 2, 3]}]})
            elapsed = time.monotonic() - started_at
            not_ready = await client.get("/readyz")
            backend.alive = False
            worker_down = await client.get("/readyz")
            refused = await client.post("/score", json={"sequences": [{"input_ids": [1, 2, 3]}]})
            backend.restart_error = "the checkpoint changed"  # as the worker pool says
            backend.restart_retry_after_s = 8  # the pool's back-off left: when it tries again
            restart_failed = await client.get("/readyz"), await client.post("/score", json={"sequences": [{"input_ids": [1]}]})
            backend.restart_retry_after_s = 3  # later in the same back-off: the message counts down with the header
            later = await client.post("/score", json={"sequences": [{"input_ids": [1]}]})
            restart_failed = (*restart_failed, later)
            backend.unavailable, backend.alive, backend.restart_error = False, True, None
            ready_again = await client.get("/readyz")
            return response, elapsed, not_ready, worker_down, ready_again, refused, restart_failed

    with caplog.at_level(logging.ERROR, logger="service.scheduling.scheduler"):
        response, elapsed, not_ready, worker_down, ready_again, refused, restart_failed = asyncio.run(main())
    assert "backend unavailable for a row of 1 sequence (requests" in caplog.text, caplog.text  # not "1 sequences"
    ready_failed, score_failed, score_later = restart_failed
    assert ready_failed.status_code == 503 and ready_failed.json()["status"] == "restart_failed", ready_failed.text
    assert "the checkpoint changed" not in ready_failed.text, "/readyz answers without a key: no details"
    assert ready_failed.headers["retry-after"] == "8", "/readyz: not when the pool next tries to restart"
    assert score_failed.status_code == 503 and "the checkpoint changed" in score_failed.json()["error"]["message"]
    assert score_failed.headers["retry-after"] == "8", "not when the pool next tries to restart"
    assert "the next attempt is in 8s." in score_failed.json()["error"]["message"], score_failed.text
    assert score_later.headers["retry-after"] == "3", score_later.headers
    assert "the next attempt is in 3s." in score_later.json()["error"]["message"], "the message and Retry-After disagree"
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "backend_unavailable"
    assert response.status_code == 503 and elapsed < 5
    assert response.json()["error"]["type"] == "backend_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    assert not_ready.status_code == 503 and not_ready.json()["status"] == "probe_failed"
    assert "'fake-model' (no result)" in not_ready.json()["error"]["message"], not_ready.text
    assert "worker 0 exited" not in not_ready.text, "/readyz answers without a key: the model, not the exception"
    assert worker_down.status_code == 503 and worker_down.json()["status"] == "worker_down"
    assert "retry-after" in worker_down.headers
    assert ready_again.status_code == 200 and ready_again.json()["status"] == "ready"


class _Overflowing(FakeBackend):
    """Scores non-finite log-probabilities once ``overflow`` is set, as finite weights whose logits
    overflow do."""

    overflow = False

    def score_row(self, sequences, group=None):
        scores = super().score_row(sequences, group)
        if self.overflow:
            for s in scores:
                s.logprobs[:] = np.nan
        return scores


def test_readyz_names_the_model_whose_readiness_pass_scored_non_finite_log_probabilities(monkeypatch):
    from service import readiness

    monkeypatch.setattr(readiness, "_READY_MAX_AGE_S", 0.0)  # every /readyz wants a fresh pass

    async def main():
        backend = _Overflowing(name="policy")
        async with running_app(create_app(Settings(), backend)) as client:
            assert (await client.get("/readyz")).status_code == 200
            backend.overflow = True
            return await client.get("/readyz")

    not_ready = asyncio.run(main())
    assert not_ready.status_code == 503 and not_ready.json()["status"] == "probe_failed", not_ready.text
    message = not_ready.json()["error"]["message"]
    assert "'policy' (non-finite log-probabilities)" in message, message


def test_readyz_while_restarts_fail_retries_after_the_last_failed_pool_tries_again():
    """Several served models: /readyz is not ready before every failed pool is back, so its Retry-After
    is the latest of their next attempts; a model whose pool serves, or restarts now, adds none."""
    async def main():
        backends = {"policy": FakeBackend(name="policy-ckpt"), "ref": FakeBackend(name="ref-ckpt"),
                    "critic": FakeBackend(name="critic-ckpt")}
        async with running_app(create_app(Settings(), backends)) as client:
            answers = []
            for failed in ({"policy": 3}, {"policy": 3, "ref": 17}, {"ref": 17}):
                for name, backend in backends.items():
                    backend.alive = name not in failed
                    backend.restart_error = "could not restart (next attempt in 9s)" if name in failed else None
                    backend.restart_retry_after_s = failed.get(name, 29)
                backends["critic"].alive = False  # down and restarting now: no failure, no time to wait for
                answers.append(await client.get("/readyz"))
            return answers

    answers = asyncio.run(main())
    assert [a.json()["status"] for a in answers] == ["restart_failed"] * 3, [a.text for a in answers]
    assert [a.headers["retry-after"] for a in answers] == ["3", "17", "17"], [dict(a.headers) for a in answers]


@asynccontextmanager
async def _forward_held(client, backend):
    """The forward held (the readiness pass ran already) on a first row, a request of 10 tokens; yields
    how many rows ran before it. Leaving releases the forward and awaits that request."""
    gate = threading.Event()
    backend.gate = gate
    rows_before = len(backend.rows)
    blocker = asyncio.ensure_future(client.post("/score", json={"sequences": [{"input_ids": [1] * 10}]}))
    await wait_until(lambda: len(backend.rows) > rows_before)
    try:
        yield rows_before
    finally:
        gate.set()
        await blocker


def test_deadline_passes_504_and_the_sequences_are_dropped():
    async def main():
        backend = FakeBackend()
        app = create_app(Settings(max_batch_tokens=10, max_wait_ms=0), backend)
        async with running_app(app) as client:
            async with _forward_held(client, backend) as rows_before:
                late = await client.post("/score", json={"sequences": [{"input_ids": [2] * 7}], "deadline_ms": 50})
                queued_after = app.state.service.scheduler.queued_tokens
            return late, queued_after, backend.rows[rows_before:]

    late, queued_after, rows = asyncio.run(main())
    assert late.status_code == 504
    assert late.json()["error"]["type"] == "deadline_exceeded" and late.json()["error"]["param"] == "deadline_ms"
    assert queued_after == 10  # only the blocker's tokens remain
    assert [7] not in rows


def test_admission_bound_answers_429_with_retry_after():
    async def main():
        gate = threading.Event()
        backend = FakeBackend()
        app = create_app(Settings(max_batch_tokens=100, max_wait_ms=0, max_queued_tokens=100, max_admission_wait_s=0), backend)
        async with running_app(app) as client:
            backend.gate = gate  # held from here on; the readiness pass ran already
            first = asyncio.ensure_future(client.post("/score", json={"sequences": [{"input_ids": [1] * 60}]}))
            await wait_until(lambda: app.state.service.scheduler.queued_tokens == 60)
            refused = await client.post("/score", json={"sequences": [{"input_ids": [1] * 60}]})
            fits = asyncio.ensure_future(client.post("/score", json={"sequences": [{"input_ids": [1] * 40}]}))
            await wait_until(lambda: app.state.service.scheduler.queued_tokens == 100)
            gate.set()
            metrics = (await client.get("/metrics")).text
            return refused, await first, await fits, metrics

    refused, first, fits, metrics = asyncio.run(main())
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "queue_full"
    assert refused.headers["retry-after"].isdigit() and int(refused.headers["retry-after"]) >= 1
    assert first.status_code == 200 and fits.status_code == 200
    assert 'packscore_rejections_total{reason="queue_full"} 1.0' in metrics


def test_a_client_that_disconnects_has_its_queued_sequences_dropped():
    async def main():
        backend = FakeBackend()
        app = create_app(Settings(max_batch_tokens=10, max_wait_ms=0), backend)
        async with running_app(app) as client:
            async with _forward_held(client, backend) as rows_before:
                service = app.state.service
                gone = asyncio.Event()
                sent = []
                body = orjson.dumps({"sequences": [{"input_ids": [3] * 9}, {"input_ids": [4] * 8}]})
                messages = [{"type": "http.request", "body": body, "more_body": False}]

                async def receive():
                    if messages:
                        return messages.pop()
                    await gone.wait()
                    return {"type": "http.disconnect"}

                async def send(message):
                    sent.append(message)

                scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                         "scheme": "http", "path": "/score", "raw_path": b"/score", "query_string": b"",
                         "root_path": "", "headers": [(b"content-type", b"application/json")],
                         "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
                call = asyncio.ensure_future(app(scope, receive, send))
                await wait_until(lambda: service.scheduler.queued_tokens == 27)
                gone.set()  # the client hangs up
                await call
                queued_after = service.scheduler.queued_tokens
            return queued_after, backend.rows[rows_before:], sent

    queued_after, rows, sent = asyncio.run(main())
    assert queued_after == 10
    assert [9] not in rows and [8] not in rows, rows
    assert sent[0]["status"] == 499


def test_partial_rows_wait_up_to_max_wait_ms_for_more_work():
    async def main():
        backend = FakeBackend()
        scheduler = await started(backend, max_batch_tokens=100, max_wait_ms=300)
        lone = scheduler.submit(seqs_of(5))  # after a quiet spell: runs at once, alone
        await asyncio.sleep(0.01)
        first = scheduler.submit(seqs_of(10))  # requests are arriving: its row waits to fill
        await asyncio.sleep(0.05)
        second = scheduler.submit(seqs_of(20))
        t0 = time.monotonic()
        await asyncio.gather(lone.future, first.future, second.future)
        waited = time.monotonic() - t0
        await scheduler.close()
        return backend.rows, waited

    rows, waited = asyncio.run(main())
    assert rows == [[5], [10, 20]] and waited < 1.0


def test_a_request_after_a_quiet_spell_does_not_wait_for_its_row_to_fill():
    async def main():
        backend = FakeBackend()
        scheduler = await started(backend, max_batch_tokens=100, max_wait_ms=5000)
        t0 = time.monotonic()
        await scheduler.submit(seqs_of(10)).future
        latency = time.monotonic() - t0
        await scheduler.close()
        return latency

    assert asyncio.run(main()) < 1.0


def test_rows_run_concurrently_up_to_the_backend_concurrency():
    async def main():
        backend = FakeBackend(concurrency=3, seconds_per_token=0.001)
        scheduler = await started(backend, max_batch_tokens=50)
        tickets = [scheduler.submit(seqs_of(50)) for _ in range(9)]
        await asyncio.gather(*(t.future for t in tickets))
        await scheduler.close()
        return backend.max_running

    assert asyncio.run(main()) == 3


def test_msgpack_requests_go_through_the_same_scheduler():
    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            body = {"sequences": [{"input_ids": np.arange(1, 9, dtype="<i4").tobytes(), "score_from": 3}]}
            return await client.post("/score", content=msgpack.packb(body),
                                     headers={"Content-Type": "application/msgpack"})

    response = asyncio.run(main())
    result = msgpack.unpackb(response.content)["results"][0]
    want = expected_scores(SequenceInput(np.arange(1, 9), score_from=3))
    np.testing.assert_array_equal(np.frombuffer(result["logprobs"], "<f4"), want.logprobs)


def test_a_huge_deadline_is_just_a_long_one():
    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            return await client.post("/score", json={"sequences": [{"input_ids": [1, 2]}], "deadline_ms": 10**15})

    assert asyncio.run(main()).status_code == 200


def test_readyz_says_updating_weights_while_an_update_copies_in_place():
    async def main():
        backend = FakeBackend()
        app = create_app(Settings(), backend)
        async with running_app(app) as client:
            backend.copying_in_place = True  # as LocalBackend during an update in place: nothing scores
            during = await client.get("/readyz")
            backend.copying_in_place = False
            return during, await client.get("/readyz")

    during, after = asyncio.run(main())
    assert during.status_code == 503 and during.json()["status"] == "updating_weights", during.text
    assert during.headers["retry-after"] == "2"
    assert after.status_code == 200, after.text



def test_close_returns_when_the_packer_was_woken_just_before():
    """close() cancels the packer while its timed wait for a row to fill has just been woken (a row
    finished): Python 3.11's wait_for can return the wake and drop the cancel, which would leave close()
    waiting on the packer forever (packscore score hanging where writing OUT fails)."""
    async def main():
        gate = threading.Event()
        scheduler = await started(FakeBackend(gate=gate), max_batch_tokens=50, max_wait_ms=10_000)
        tickets = [scheduler.submit(seqs_of(40)) for _ in range(2)]  # one row runs (held), one waits to fill
        await asyncio.sleep(0.05)
        scheduler._wake.set()  # as a runner does when a row ends; no await between it and close()
        try:
            await asyncio.wait_for(scheduler.close("closing"), 5)
        except TimeoutError:
            return "close() still waiting after 5 s"
        finally:
            gate.set()
        return [t.done for t in tickets]

    assert asyncio.run(main()) == [True, True]


def test_a_request_after_close_gets_a_closing_503_with_the_reason():
    """API.md: a 503 while draining carries Connection: close. A request reaching a closed scheduler
    (after the drain timeout) gets it too, with the reason close() was given."""
    from service.http.errors import ApiError

    async def main():
        scheduler = await started(FakeBackend())
        await scheduler.close("the server is shutting down (drain timeout)")
        refused = []
        try:
            scheduler.submit(seqs_of(5))
        except ApiError as error:
            refused.append(error)
        try:
            await scheduler.submit_when_room(seqs_of(5))
        except ApiError as error:
            refused.append(error)
        return refused

    refused = asyncio.run(main())
    assert len(refused) == 2, refused
    for error in refused:
        assert error.status == 503 and error.headers.get("Connection") == "close", (error.status, error.headers)
        assert "drain timeout" in error.message, error.message


def test_the_readiness_pass_is_not_counted_or_named_among_the_pending_requests():
    """The drain timeout's and a stop's lines count and name the requests still pending: the readiness
    pass's ticket (the server's own, no request id) made '1 unfinished request(s) ... (requests )'."""
    from service.http import request_id

    async def main():
        gate = threading.Event()
        scheduler = await started(FakeBackend(gate=gate))
        try:
            request_id.outside_request().run(scheduler.submit, seqs_of(8), probe=True)
            alone = scheduler.pending_requests, scheduler.pending_request_ids()
            token = request_id.current.set("client-1")
            try:
                scheduler.submit(seqs_of(5))
            finally:
                request_id.current.reset(token)
            return alone, (scheduler.pending_requests, scheduler.pending_request_ids())
        finally:
            gate.set()
            await scheduler.close()

    assert asyncio.run(main()) == ((0, ""), (1, "client-1"))


class _DiesUnderThePass(FakeBackend):
    """A worker pool whose worker dies under the readiness pass: the pool marks itself down and fails
    the pass's row, as ``model_runtime.pool`` does."""

    dying = False

    def score_row(self, sequences, group=None):
        if self.dying:
            self.alive = False
            raise BackendUnavailableError("a worker failed (worker rank 1 (pid 7) exited (status -9)); the pool is restarting")
        return super().score_row(sequences, group)


def test_a_readiness_pass_failed_by_a_lost_worker_says_worker_down():
    """A /readyz whose pass a worker's death failed answered 'probe_failed' (the next one 'worker_down'):
    the status names the pool being down, as a /readyz a moment later does."""
    backend = _DiesUnderThePass()

    async def main():
        async with running_app(create_app(Settings(), backend)) as client:
            backend.unavailable = True  # a row failed: the next /readyz runs a pass
            assert (await client.post("/score", json={"sequences": [{"input_ids": [1, 2, 3]}]})).status_code == 503
            backend.unavailable, backend.dying = False, True
            return await client.get("/readyz")

    answer = asyncio.run(main())
    assert answer.status_code == 503 and answer.json()["status"] == "worker_down", answer.text
    assert "retry-after" in answer.headers
