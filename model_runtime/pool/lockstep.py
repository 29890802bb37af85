"""FSDP lockstep: the stepper thread that sends every group a row (or an idle step) at once.

With FSDP every rank takes part in every layer's all-gather, so the groups must run their rows in
step. One thread alone sends steps, so every rank sees them, and their collectives, in one order;
a weight swap is sent between two steps (``replies.Swap``). ``Lockstep`` is a part of
``pool.WorkerPool``: it uses the pool's ``dims``, ``_steps`` queue, ``_world``, ``_closed``,
``_rows_done``, ``_last_step_end``, ``step_counts``, ``_lock``, ``row_cost``, ``_row_timeout_s``,
``_measure_rate``, ``_send_all``, ``_new_pending`` and ``_await``.
"""

from __future__ import annotations

import queue
import time
from typing import Sequence

from model_runtime.pool import messages as msg
from model_runtime.pool.replies import Swap, split_reply
from model_runtime.scoring.backend import BackendUnavailableError
from model_runtime.types import SequenceInput, SequenceScores


class Lockstep:
    """The pool's lockstep steps (see the module docstring)."""

    # How long a step waits to fill its other groups while rows keep coming (a step that ended
    # less than DEMAND_WINDOW_S ago); a lone request after a quiet spell goes at once. Steps of a
    # full row take seconds on a GPU, so the wait costs well under 1%.
    STEP_GATHER_S = 0.02
    DEMAND_WINDOW_S = 1.0

    def _run_in_steps(self, rows: list[Sequence[SequenceInput]]) -> list[list[SequenceScores]]:
        """Lockstep: hands ``rows`` (at most dp, kept in one step) to the stepper and waits."""
        tickets = [queue.Queue(maxsize=1) for _ in rows]
        self._steps.put(list(zip(rows, tickets)))
        results = []
        for row, ticket in zip(rows, tickets):
            outcome = ticket.get()
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(split_reply(row, outcome))
        return results

    def _step_loop(self) -> None:
        """FSDP lockstep: every step gives every group a row or a dummy, then waits for all replies.

        Queue items are bundles of ``(row, ticket)`` that must share a step; rows join a step in
        arrival order until every group has one. This thread alone sends steps, so every rank
        sees them, and their collectives, in one order.
        """
        held = None  # a bundle that did not fit the previous step
        while not self._closed.is_set():
            bundle = held if held is not None else self._steps.get()
            held = None
            if bundle is None:
                break
            if isinstance(bundle, Swap):  # between two steps: every rank swaps before the next one
                world = self._world
                if world is None or world.failed:
                    bundle.pending.settle(error=BackendUnavailableError("the worker pool is restarting"))
                else:
                    self._send_all(world, bundle.pending, bundle.frame)
                    try:
                        self._await(bundle.pending)  # no step starts before every rank has swapped
                    except BaseException:
                        pass  # the updating thread sees the same outcome
                continue
            batch = list(bundle)
            busy = time.monotonic() - self._last_step_end < self.DEMAND_WINDOW_S
            deadline = time.monotonic() + (self.STEP_GATHER_S if busy else 0.0)
            while len(batch) < self.dims.dp:
                left = deadline - time.monotonic()
                try:
                    extra = self._steps.get(timeout=max(0.0, left))
                except queue.Empty:
                    break
                if extra is None:
                    self._steps.put(None)  # shutting down: seen once this step is done
                    break
                if isinstance(extra, Swap) or len(batch) + len(extra) > self.dims.dp:
                    held = extra
                    break
                batch.extend(extra)
            self._run_step(batch)
        for bundle in [held] + _drain(self._steps):  # fail whatever is still queued at shutdown
            if isinstance(bundle, Swap):
                bundle.pending.settle(error=BackendUnavailableError("the worker pool is shutting down"))
                continue
            for _, ticket in bundle or ():
                ticket.put(BackendUnavailableError("the worker pool is shutting down"))

    def _run_step(self, batch: list) -> None:
        world = self._world
        if world is None or world.failed:
            self._step_done(batch, [BackendUnavailableError("the worker pool is restarting after a worker failure")] * len(batch))
            return
        step_cost = max((self.row_cost([s.length for s in rows]) for rows, _ in batch), default=0.0)
        with self._lock:
            timeout_s = self._row_timeout_s(step_cost)  # the step's rows run side by side
        started = time.monotonic()
        pendings = [self._new_pending(world, timeout_s=timeout_s) for _ in range(self.dims.dp)]
        try:
            for group, pending in enumerate(pendings):
                if group < len(batch):
                    frame = msg.encode(msg.ScoreRow.of(pending.request_id, batch[group][0]))
                    self._rows_done[group] += 1
                else:
                    frame = msg.encode(msg.Idle(pending.request_id))
                world.send_group(group, frame)
        except OSError as error:
            for pending in pendings:
                pending.settle(error=BackendUnavailableError(f"cannot reach the workers: {error}"))
        outcomes: list = []
        for pending in pendings:
            try:
                outcomes.append(self._await(pending))
            except BaseException as error:  # delivered to the caller's thread
                outcomes.append(error)
        if not any(isinstance(o, BaseException) for o in outcomes):
            self._measure_rate(step_cost, time.monotonic() - started)
        self._step_done(batch, outcomes)

    def _step_done(self, batch: list, outcomes: list) -> None:
        """Counts the step, then hands each caller its outcome: a caller that returns finds its step
        in ``step_counts`` and its rate measured (the next row's time bound reads that rate)."""
        self._last_step_end = time.monotonic()
        self.step_counts["steps"] += 1
        self.step_counts["rows"] += len(batch)
        for (_, ticket), outcome in zip(batch, outcomes):
            ticket.put(outcome)


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
