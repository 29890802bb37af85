"""Several models in one deployment sharing the forward slots (docs/weights.md "Several models in
one deployment"), with the fake backend: what a row of one model waiting for another's forward
does, and on which data-parallel group it runs."""

import asyncio
import contextlib
import threading
import time

import pytest

from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app, wait_until

SEQ = {"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 2}

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def _score(body: dict, **extra) -> dict:
    return {"sequences": [SEQ], **extra, **body}


@contextlib.asynccontextmanager
async def _policy_forward_held(backends: dict, gate: threading.Event):
    """A served app whose policy forward is running and held at ``gate``: (app, client, the policy's request)."""
    gate.set()  # the readiness passes run
    app = create_app(Settings(max_wait_ms=0), backends)
    async with running_app(app) as client:
        gate.clear()
        policy = asyncio.create_task(client.post("/score", json=_score({"model": "policy"})))
        await wait_until(lambda: backends["policy"].running == 1)
        yield app, client, policy


def test_the_queue_wait_of_a_model_counts_its_wait_for_anothers_forward():
    # packscore_queue_wait_seconds: "between admission and the start of its forward"; the ref's
    # forward starts only once the policy's ends (one set of forward slots).
    policy_gate = threading.Event()
    backends = {"policy": FakeBackend(gate=policy_gate), "ref": FakeBackend()}
    held_s = 0.3

    async def main():
        async with _policy_forward_held(backends, policy_gate) as (app, client, policy):
            ref = asyncio.create_task(client.post("/score", json=_score({"model": "ref"})))
            await wait_until(lambda: app.state.service.models["ref"].scheduler.queued_sequences == 1)
            queued = time.monotonic()
            await asyncio.sleep(held_s)
            assert backends["ref"].running == 0, "the ref ran beside the policy's forward"
            held = time.monotonic() - queued
            policy_gate.set()
            assert (await policy).status_code == 200 and (await ref).status_code == 200
            registry = app.state.service.metrics.registry
            return registry.get_sample_value("packscore_queue_wait_seconds_sum", {"model": "ref"}), held

    waited, held = asyncio.run(main())
    assert waited >= held, f"the ref's queue wait {waited:.3f} s leaves out its {held:.3f} s wait for a forward slot"


def test_a_request_that_ends_while_its_row_waits_for_anothers_forward_never_runs():
    # A deadline (504) or a disconnect drops the sequences whose forward has not started; with
    # several models a row may wait for another model's forward: it must not run for nobody.
    policy_gate = threading.Event()
    backends = {"policy": FakeBackend(gate=policy_gate), "ref": FakeBackend()}

    async def main():
        async with _policy_forward_held(backends, policy_gate) as (app, client, policy):
            late = await client.post("/score", json=_score({"model": "ref", "deadline_ms": 100}))
            ref_queue = app.state.service.models["ref"].scheduler.queued_tokens
            policy_gate.set()
            assert (await policy).status_code == 200
            after = await client.post("/score", json=_score({"model": "ref"}))
            return late, ref_queue, after

    late, ref_queue, after = asyncio.run(main())
    assert late.status_code == 504, late.text
    assert ref_queue == 0, "the tokens of the request that timed out still count against admission"
    assert after.status_code == 200
    ref_rows = backends["ref"].rows[1:]  # rows[0] is the readiness pass
    assert ref_rows == [[4]], f"the ref ran rows {ref_rows}: the timed-out request's row ran after it was answered 504"


def test_a_model_runs_on_a_group_no_other_models_forward_holds():
    # Two pools of two data-parallel groups each on the same two GPUs: the ref's row must go to
    # the GPUs the policy's forward leaves free, not to its own pool's first idle group (GPU 0,
    # where the policy runs): two rows' activations on one GPU, the other GPU idle.
    gate = threading.Event()
    backends = {"policy": FakeBackend(gate=gate, concurrency=2), "ref": FakeBackend(concurrency=2)}

    async def main():
        async with _policy_forward_held(backends, gate) as (_, client, policy):
            ref = await client.post("/score", json=_score({"model": "ref"}))
            gate.set()
            return await policy, ref

    policy, ref = asyncio.run(main())
    assert policy.status_code == 200 and ref.status_code == 200
    policy_group, ref_group = backends["policy"].groups[-1], backends["ref"].groups[-1]
    assert (policy_group, ref_group) == (0, 1), f"policy on group {policy_group}, ref on group {ref_group}"


class _RecordingWorld:
    """A worker world that records the group each row is sent to, then fails the send."""

    generation, failed = 1, False

    def __init__(self):
        self.sent: list[int] = []

    def send_group(self, group: int, frame: bytes) -> None:
        self.sent.append(group)
        raise OSError("test: nothing behind the pipe")


def test_the_pool_sends_a_row_to_the_group_named():
    import numpy as np

    from model_runtime.parallel.dims import ParallelDims
    from model_runtime.scoring.backend import BackendUnavailableError
    from model_runtime.types import SequenceInput
    from tests.unit.test_pool_failure_race import bare_pool

    pool = bare_pool()
    pool.dims = ParallelDims.from_world(2, 1, False)
    pool._lane_cost, pool._rows_done, pool._vocab_size = [0.0, 0.0], [0, 0], 100
    pool._world = world = _RecordingWorld()
    assert pool.pins_groups
    for group in (1, None):
        with pytest.raises(BackendUnavailableError):
            pool.score_row([SequenceInput(np.array([1, 2, 3]))], group=group)
    assert world.sent == [1, 0], "a named group, then the idle group of least cost"
    assert not _lockstep_pool().pins_groups, "with FSDP every rank takes every step: no group to name"


def _lockstep_pool():
    from model_runtime.parallel.dims import ParallelDims
    from tests.unit.test_pool_failure_race import bare_pool

    pool = bare_pool()
    pool.dims = ParallelDims.from_world(2, 1, True)  # FSDP: every rank takes every step
    return pool


@pytest.mark.parametrize("group", [2, -1])
def test_the_pool_refuses_a_group_it_does_not_have(group):
    # group=2 of two raised IndexError; -1 ran as the last group's row in the books, then failed to
    # send and left its row registered: past its time bound the reader restarted every worker.
    import numpy as np

    from model_runtime.parallel.dims import ParallelDims
    from model_runtime.types import SequenceInput
    from tests.unit.test_pool_failure_race import bare_pool

    pool = bare_pool()
    pool.dims = ParallelDims.from_world(2, 1, False)
    pool._lane_cost, pool._rows_done, pool._vocab_size = [0.0, 0.0], [0, 0], 100
    pool._world = world = _RecordingWorld()
    with pytest.raises(ValueError, match=r"group .* of this pool's 2"):
        pool.score_row([SequenceInput(np.array([1, 2, 3]))], group=group)
    assert (world.sent, pool._pending, pool._rows_done) == ([], {}, [0, 0])


def test_a_model_with_fewer_groups_than_the_forward_slots_runs_on_its_own():
    # The slots are the largest pool's groups: a lane past a smaller pool's groups is none of its
    # GPUs, and naming it failed the row (IndexError in WorkerPool) instead of running it.
    gate = threading.Event()
    backends = {"policy": FakeBackend(gate=gate, concurrency=3), "ref": FakeBackend(concurrency=2)}

    async def main():
        async with _policy_forward_held(backends, gate) as (_, client, policy):
            second = asyncio.create_task(client.post("/score", json=_score({"model": "policy"})))
            await wait_until(lambda: backends["policy"].running == 2)  # lanes 0 and 1 held: the ref gets lane 2
            ref = await client.post("/score", json=_score({"model": "ref"}))
            gate.set()
            return await policy, await second, ref

    policy, second, ref = asyncio.run(main())
    assert [r.status_code for r in (policy, second, ref)] == [200, 200, 200], ref.text
    assert backends["ref"].groups[-1] is None, f"the ref's row was sent to group {backends['ref'].groups[-1]}, not left to its pool"
