"""Test support: a fake backend that scores without a model, and an in-process app runner.

``FakeBackend`` makes HTTP tests run in milliseconds. Its numbers depend only on the sequence
itself (never on its row), so a test can check that results were reassembled correctly, and it
records every row it was given, so a test can check how the scheduler packed them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

import httpx
import numpy as np
import xxhash

from model_runtime.scoring.backend import BackendUnavailableError, ModelInfo, WeightsUpdate, begin_update
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.rows import validate_sequence
from model_runtime.scoring.weights import CONTENT_VERSION_PREFIX
from model_runtime.types import SequenceInput, SequenceScores


FAKE_VERSION = "fake#1"
VERSION_OFFSET = 0.125  # each weight update of FakeBackend lowers every log-prob by this much


def expected_scores(seq: SequenceInput, generation: int = 0, version: str = FAKE_VERSION) -> SequenceScores:
    """What FakeBackend returns for ``seq`` after ``generation`` weight updates: simple functions
    of the ids and options."""
    ids = np.asarray(seq.input_ids, dtype=np.int64)
    targets = ids[seq.score_from :]
    positions = np.arange(seq.score_from, seq.length, dtype=np.float32)
    logprobs = (-(targets % 97).astype(np.float32) / 10.0 - 0.01 - VERSION_OFFSET * generation) / np.float32(seq.temperature)
    entropy = positions / 100.0 + 1.0
    k = seq.top_k
    top_ids = (targets[:, None] + np.arange(k)[None, :]).astype(np.int32) if k else None
    top_logp = (logprobs[:, None] - np.arange(k, dtype=np.float32)[None, :]) if k else None
    return SequenceScores(
        logprobs=logprobs.astype(np.float32),
        entropy=entropy.astype(np.float32) if seq.return_entropy else None,
        top_k_ids=top_ids,
        top_k_logprobs=top_logp.astype(np.float32) if k else None,
        weights_version=version,
    )


class FakeBackend:
    """A ScoringBackend without a model.

    Args:
        seconds_per_token: simulated forward time.
        oom_above_tokens: a row with more tokens raises a CUDA-style out-of-memory RuntimeError.
        concurrency: how many score_row calls may overlap.
        gate: when given, every forward waits until it is set (lets a test hold the pipeline).
        load_gate: when given, every weight update waits until it is set before its swap.
        check_checkpoint: called with an update's path before its swap; raises CheckpointError
            to refuse it (the default accepts any directory).

    A weight update (``update_weights``) swaps between forwards: each row is scored by one
    version, and after ``n`` updates every log-prob is ``n * VERSION_OFFSET`` lower.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 1000,
        max_model_len: int = 4096,
        seconds_per_token: float = 0.0,
        oom_above_tokens: int | None = None,
        concurrency: int = 1,
        gate: threading.Event | None = None,
        name: str = "fake-model",
        load_gate: threading.Event | None = None,
        check_checkpoint: Callable[[Path], None] | None = None,
    ):
        self.info = ModelInfo(
            name=name,
            architecture="qwen3_5",
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            dtype="float32",
            device="cpu",
            weights_version=FAKE_VERSION,
            kernels={"linear_attention": "reference", "conv1d": "reference", "attention": "reference"},
        )
        self.concurrency = concurrency
        self.seconds_per_token = seconds_per_token
        self.oom_above_tokens = oom_above_tokens
        self.gate = gate
        self.unavailable = False
        self.alive = True
        self.rows: list[list[int]] = []  # lengths of the sequences of every row attempted
        self.groups: list[int | None] = []  # the data-parallel group each row was sent to (None: the backend's choice)
        self.pins_groups = concurrency > 1  # as WorkerPool: score_row takes the group to run on
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()
        self.load_gate = load_gate
        self.check_checkpoint = check_checkpoint
        self.generation = 0  # weight updates so far
        self.versions = [FAKE_VERSION]  # every version served, by generation
        self._updating = threading.Lock()

    def score_row(self, sequences: Sequence[SequenceInput], group: int | None = None) -> list[SequenceScores]:
        for i, seq in enumerate(sequences):
            validate_sequence(seq, self.info.vocab_size, i)
        if group is not None and not 0 <= group < self.concurrency:  # as WorkerPool: its groups only
            raise ValueError(f"group {group} is not one of this backend's {self.concurrency} data-parallel groups")
        with self._lock:
            self.rows.append([s.length for s in sequences])
            self.groups.append(group)
            generation, version = self.generation, self.info.weights_version  # the row's version, read once
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if self.gate is not None:
                self.gate.wait(timeout=30)
            if self.unavailable:
                raise BackendUnavailableError("worker 0 exited")
            tokens = sum(s.length for s in sequences)
            if self.oom_above_tokens is not None and tokens > self.oom_above_tokens:
                raise RuntimeError(f"CUDA out of memory. Tried to allocate {tokens} MiB")
            if self.seconds_per_token:
                time.sleep(tokens * self.seconds_per_token)
            return [expected_scores(s, generation, version) for s in sequences]
        finally:
            with self._lock:
                self.running -= 1

    def update_weights(self, path: Path, version: str | None = None) -> WeightsUpdate:
        path = Path(path)
        started = begin_update(self._updating, self.info.name)
        try:
            if not path.is_dir():
                raise CheckpointError("unsupported", f"{path.name} is not a checkpoint directory")
            if self.check_checkpoint is not None:
                self.check_checkpoint(path)
            if self.load_gate is not None:
                self.load_gate.wait(timeout=30)
            if version is None:  # a content hash, as the real backends compute
                digest = xxhash.xxh3_128()
                for f in sorted(path.iterdir()):
                    digest.update(f.name.encode() + (f.read_bytes() if f.is_file() else b""))
                version = f"{CONTENT_VERSION_PREFIX}{digest.hexdigest()[:12]}"
            load_s = time.perf_counter() - started
            with self._lock:  # between rows: a row reads its version once, under this lock
                previous = self.info.weights_version
                self.generation += 1
                self.versions.append(version)
                self.info = replace(self.info, weights_version=version)
            return WeightsUpdate(version, previous, load_s, 0.0)
        finally:
            self._updating.release()

    def warm_up(self) -> None:
        pass

    def is_alive(self) -> bool:
        return self.alive

    def close(self) -> None:
        pass


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.005)


@asynccontextmanager
async def running_app(app, *, ready: bool = True, headers: dict | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """Runs ``app``'s lifespan in this event loop and yields a client bound to it (no sockets)."""
    async with app.router.lifespan_context(app):
        if ready:
            # the readiness pass is a real forward: on a loaded 2-core machine it can take more than 10 s
            await wait_until(lambda: app.state.service.phase in ("ready", "failed"), timeout=60.0)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://packscore.test", headers=headers) as client:
            yield client
