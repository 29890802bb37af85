"""The end of a burst on several GPUs: long sequences do not wait to be the oldest, and the last
rows are shared out across idle GPUs instead of one GPU taking a full row while others idle."""

import asyncio
import threading
import time

import pytest

from service.scheduling.rows import gpu_loads, water_level
from service.testing import FakeBackend
from tests.unit.test_http_scheduler import seqs_of, started


@pytest.mark.parametrize("amount, loads, want", [
    (10, [0, 0], 5), (10, [0, 4], 7), (2, [0, 4], 2), (12, [1, 1, 1], 4), (3, [2, 5, 9], 3), (0, [0, 3], 0),
])
def test_water_level_is_what_the_least_loaded_takes_to_level_them(amount, loads, want):
    got = water_level(amount, loads)
    assert abs(got - want) < 1e-9, f"water_level({amount}, {loads}) = {got}, want {want}"


def rows_of(concurrency, deadline_s=None):
    """The rows of a request of four 50-token sequences followed by one holding a 150 and a 120
    (neither fits beside a 50 in a row of 100), all queued while the GPUs are held."""

    async def main():
        gate = threading.Event()
        # rows take 1 ms a token, so the second pair starts 50 ms apart, in a fixed order
        backend = FakeBackend(gate=gate, concurrency=concurrency, seconds_per_token=0.001)
        scheduler = await started(backend)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        tickets = [scheduler.submit(seqs_of(50, 50, 50, 50), deadline=deadline), scheduler.submit(seqs_of(150, 120, 60, start=7))]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*(t.future for t in tickets))
        await scheduler.close()
        return backend.rows

    return asyncio.run(main())


def test_a_long_sequence_leads_every_other_row_on_several_gpus():
    rows = rows_of(2)
    # Pairs started together (either order): the oldest's row, then the longest it could not take.
    assert sorted(rows[:2]) == [[50, 50], [150]] and sorted(rows[2:4]) == [[50, 50], [120]], rows
    assert rows[4:] == [[60]], rows


def test_one_gpu_and_a_deadline_keep_strict_arrival_order():
    fifo = [[50, 50], [50, 50], [150], [120], [60]]
    assert rows_of(1) == fifo  # one GPU: the order cannot shorten a burst
    assert sorted(rows_of(2, deadline_s=30)[:2]) == [[50, 50], [50, 50]]  # the oldest has a deadline


def test_the_last_rows_are_shared_out_across_idle_gpus():
    async def main():
        backend = FakeBackend(concurrency=4, seconds_per_token=0.001)  # a row of 100 tokens: 0.1 s
        scheduler = await started(backend)
        # Two waves of full rows on 4 GPUs, then 100 tokens left: one row's worth.
        ticket = scheduler.submit(seqs_of(*[50] * 16, *[10] * 10))
        await ticket.future
        await scheduler.close()
        return backend.rows

    rows = asyncio.run(main())
    full, tail = rows[:8], rows[8:]
    assert all(row == [50, 50] for row in full), rows
    # Not one row of 100 on one GPU while three idle: each idle GPU takes a share (at least a
    # quarter of the budget, so rows of two or three 10s).
    assert sum(map(sum, tail)) == 100 and len(tail) >= 3 and all(sum(row) <= 30 for row in tail), rows


def test_gpu_loads_count_rows_formed_but_not_started():
    # GPU 0 took 100 tokens 0.02 s ago at 1000 tokens/s (80 left), GPU 1 is idle; of the two rows
    # formed and not taken, the first goes to GPU 1 (idle), the next to the least loaded then.
    got = gpu_loads([(9.98, 100), None], [30, 40], rate=1000.0, now=10.0)
    assert [round(x, 6) for x in got] == [80.0, 70.0], got


def test_tail_rows_formed_back_to_back_are_the_same_size():
    """Several GPUs idle at once: each tail row is sized counting the rows formed just before it,
    not as if they were not there (which gave rows of 50, 40, 30, then a second wave of 20s)."""

    async def main():
        # 5 ms a token: the GPUs' finishes drift apart by a few tokens' worth at most.
        backend = FakeBackend(concurrency=4, seconds_per_token=0.005)
        scheduler = await started(backend)
        await scheduler.submit(seqs_of(100)).future  # a measured rate
        backend.rows.clear()
        gate = threading.Event()
        backend.gate = gate
        # 8 rows of two 50s (4 running, 4 waiting for a runner), then 220 tokens of 10s: the tail.
        # A share of 55 a GPU leaves 5 tokens of slack above the rows of 50 (sizes go by 10s), so
        # a GPU ending a little after another does not turn a row of 50 into 40.
        ticket = scheduler.submit(seqs_of(*[50] * 16, *[10] * 22))
        await asyncio.sleep(0.1)
        gate.set()
        await ticket.future
        await scheduler.close()
        return backend.rows

    rows = asyncio.run(main())
    tail = [sum(row) for row in rows[8:12]]
    assert tail == [50] * 4, [sum(row) for row in rows]
