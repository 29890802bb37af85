"""The messages that cross the boundary between the HTTP process and its worker processes.

Each message is one msgpack map with a ``"type"`` key, sent as one length-prefixed frame of a
pipe (``multiprocessing.connection.Connection.send_bytes``). Arrays travel as raw
little-endian buffers with their dtype fixed here, never as pickles: a worker decodes bytes
into numbers and nothing else.

Flow: pool -> worker ``Start`` once; worker -> pool ``Joining`` as it enters the process group's
rendezvous and ``Joined`` once the group is formed, then ``Hello`` when its model is ready; then
pool -> worker ``ScoreRow`` / ``Idle`` steps, answered by the group leader's ``RowResult`` (or
any rank's ``Failure``); pool -> worker ``Shutdown`` at the end.

A weight update: pool -> every rank ``LoadWeights`` (read beside the served weights while steps
go on), every rank says ``LoadProgress`` every ``LOAD_TICK_S`` while it reads and answers
``WeightsDone``; then pool -> every rank ``SwapWeights`` between the
same two steps (commit, or drop after a failure anywhere), answered by ``WeightsDone`` again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import msgpack
import numpy as np

from model_runtime.types import SequenceInput

# Fixed wire dtypes (little-endian).
IDS = np.dtype("<i4")  # token ids: vocabularies are far below 2**31
INDEX = np.dtype("<i4")  # lengths, score_from, top_k
FLOAT = np.dtype("<f4")  # log-probabilities, entropies
FLOAT64 = np.dtype("<f8")  # temperatures: kept exact, the head converts them itself


def _bytes(array: np.ndarray, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def _array(buffer: bytes, dtype: np.dtype) -> np.ndarray:
    # frombuffer gives a read-only view; copy so callers own writable arrays.
    return np.frombuffer(buffer, dtype=dtype).copy()


@dataclass(frozen=True)
class Start:
    """pool -> worker, the first message: who the worker is and what it serves."""

    rank: int  # global rank of this worker, 0 .. world_size - 1
    world_size: int  # number of worker processes
    sp: int  # sequence-parallel degree (ranks per data-parallel group)
    fsdp: bool  # shard parameters over the whole world (FSDP2)
    master_port: int  # TCP port on 127.0.0.1 where rank 0 hosts the rendezvous store
    generation: int  # pool generation (bumped on every restart); echoed in Hello
    model: str  # checkpoint directory or preset name
    device: str  # "cpu" or "cuda" (each rank takes cuda:<rank>)
    dtype: str  # "auto", "float32", "bfloat16" or "float16"
    max_batch_tokens: int  # per-rank token budget of one forward (warm-up shapes)
    allow_slow_kernels: bool  # allow reference kernels on a GPU
    kernels: dict  # pinned kernel backends, family -> backend, as Settings parsed --kernels ({}: the defaults)
    served_model_name: str  # name shown in /v1/models ("" for the model's own)
    # The process group's timeout: its rendezvous's (past the pool's join bound, which names the rank
    # that kept it from forming) and a stuck collective's, which then raises instead of hanging.
    timeout_s: float
    prefix_min_tokens: int = 0  # shortest shared prefix run once (0: prefix sharing off)
    weights_version: str = ""  # version of the weights at ``model`` after an update ("": the model's own)
    updates: bool = False  # weight updates may come (--weights-root): their staging buffers are made at start
    expert_gemm: str = ""  # the experts' CUTLASS library (--expert-gemm; "": expert_gemm.library_path()'s default)
    log_level: str = "info"  # the server's --log-level: "critical", "error", "warning", "info" or "debug"
    master_listen_fd: int = -1  # rank 0: inherited socket the pool bound to ``master_port`` and listens on; others -1


@dataclass(frozen=True)
class Joining:
    """worker -> pool, as it enters the process group's rendezvous: it got this far (imports, device)."""

    rank: int  # the sender's global rank


@dataclass(frozen=True)
class Joined:
    """worker -> pool, once the process group is formed: what is left of its start is loading the model."""

    rank: int  # the sender's global rank


@dataclass(frozen=True)
class Hello:
    """worker -> pool, once the model is loaded and parallelized: facts for ModelInfo."""

    rank: int  # the sender's global rank
    generation: int  # the Start message's generation
    pid: int  # the worker's process id (for logs and tests)
    name: str  # served model name
    architecture: str  # model family
    vocab_size: int  # vocabulary size (token ids are validated against it in the pool)
    max_model_len: int  # longest sequence the model's config allows
    dtype: str  # compute dtype, e.g. "bfloat16"
    device: str  # device type, "cpu" or "cuda"
    weights_version: str  # version string of the loaded weights
    kernels: dict  # kernel backend per family, as in ModelInfo.kernels
    slow_kernels: list  # families that fell back to slow reference kernels
    cost_per_token: float  # forward FLOPs per token (balancing estimate)
    cost_per_token_squared: float  # attention FLOPs per squared segment length (balancing estimate)
    # With prefix sharing on a GPU: the measured RowRounding as ``[first row count, kind]`` runs
    # (``RowRounding.from_runs``), so that the pool's scheduler cuts groups as the workers will;
    # 0 rows: none measured
    prefix_max_rows: int = 0
    prefix_runs: list = field(default_factory=list)


@dataclass(frozen=True)
class ScoreRow:
    """pool -> every rank of one group: one packed row to score (all ranks get the same row)."""

    request_id: int  # echoed in the RowResult / Failure
    lengths: bytes  # INDEX [n]: length of every sequence, in row order
    input_ids: bytes  # IDS [sum(lengths)]: all sequences' tokens concatenated
    score_from: bytes  # INDEX [n]: first scored position of every sequence
    temperature: bytes  # FLOAT64 [n]: temperature of every sequence
    top_k: bytes  # INDEX [n]: top-k width of every sequence
    return_entropy: bytes  # uint8 [n]: 1 where the sequence wants entropies

    @staticmethod
    def of(request_id: int, sequences: Sequence[SequenceInput]) -> "ScoreRow":
        return ScoreRow(
            request_id=request_id,
            lengths=_bytes([s.length for s in sequences], INDEX),
            input_ids=_bytes(np.concatenate([np.asarray(s.input_ids) for s in sequences]), IDS),
            score_from=_bytes([s.score_from for s in sequences], INDEX),
            temperature=_bytes([s.temperature for s in sequences], FLOAT64),
            top_k=_bytes([s.top_k for s in sequences], INDEX),
            return_entropy=_bytes([s.return_entropy for s in sequences], np.dtype("u1")),
        )

    def sequences(self) -> list[SequenceInput]:
        lengths = _array(self.lengths, INDEX)
        ids = _array(self.input_ids, IDS).astype(np.int64)
        if lengths.sum() != ids.size or (lengths < 1).any():
            raise ValueError(f"row message has {ids.size} ids for lengths summing to {int(lengths.sum())}")
        score_from, top_k = _array(self.score_from, INDEX), _array(self.top_k, INDEX)
        temperature, entropy = _array(self.temperature, FLOAT64), _array(self.return_entropy, np.dtype("u1"))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        return [
            SequenceInput(
                ids[starts[i] : starts[i + 1]],
                score_from=int(score_from[i]),
                temperature=float(temperature[i]),
                top_k=int(top_k[i]),
                return_entropy=bool(entropy[i]),
            )
            for i in range(lengths.size)
        ]


@dataclass(frozen=True)
class Idle:
    """pool -> every rank of one group: run a dummy forward (FSDP lockstep without work)."""

    request_id: int  # echoed in the leader's RowResult (with no scored positions)


@dataclass(frozen=True)
class RowResult:
    """group leader -> pool: the head's output for the whole row, in row order."""

    request_id: int  # the ScoreRow / Idle it answers
    top_k: int  # K: widest top-k of the row (0: no top-k arrays)
    logprobs: bytes  # FLOAT [N]: log-probability of every scored position
    entropy: bytes  # FLOAT [N]: entropy of every scored position
    top_k_ids: bytes  # IDS [N * K], row-major
    top_k_logprobs: bytes  # FLOAT [N * K], row-major
    weights_version: str  # the version of the weights that scored the row


@dataclass(frozen=True)
class Failure:
    """any rank -> pool: the request failed on this rank."""

    request_id: int  # the request that failed (-1: none, e.g. during start-up)
    kind: str  # "oom", "invalid" or "internal"
    message: str  # one line for the log and the error answer
    fatal: bool  # the worker exits after sending this (its group's collectives are no longer in step)


@dataclass(frozen=True)
class LoadWeights:
    """pool -> every rank: read the checkpoint at ``path`` beside the served weights (each rank its
    own shards under FSDP), in the background while steps go on."""

    request_id: int  # echoed in every rank's WeightsDone
    path: str  # checkpoint directory, already resolved and allowed by the service


@dataclass(frozen=True)
class SwapWeights:
    """pool -> every rank, between two steps: serve the weights loaded for ``request_id`` as
    ``version`` (``commit``), or drop them (a rank failed to load)."""

    request_id: int  # echoed in every rank's WeightsDone
    load_id: int  # the request_id of the LoadWeights whose weights these are
    commit: bool  # True: swap; False: free the loaded weights and keep serving the old ones
    version: str  # the version the rows name from this step on (when committed)


@dataclass(frozen=True)
class WeightsDone:
    """every rank -> pool: the answer to LoadWeights or SwapWeights."""

    request_id: int  # the LoadWeights / SwapWeights it answers
    rank: int  # the sender's global rank
    ok: bool  # loaded (or swapped, or dropped)
    kind: str  # when not ok: "unsupported", "incomplete", "incompatible" (the checkpoint) or "internal"
    message: str  # when not ok: one line naming the problem
    seconds: float  # time the rank spent loading (LoadWeights) or with steps paused (SwapWeights)


# How often a rank reading an update says how far it got (``LoadProgress``): well below the stall floor.
LOAD_TICK_S = 1.0


@dataclass(frozen=True)
class LoadProgress:
    """every rank -> pool, every ``LOAD_TICK_S`` while it reads an update: the pool counts a rank
    silent past the stall floor (a stopped process), or whose bytes stop growing past the
    unmeasured bound (a hung GPU, a hung disk), as stuck (``updates.stuck_load``)."""

    request_id: int  # the LoadWeights being read
    rank: int  # the sender's global rank
    bytes_read: int  # of this rank's tensors, read so far


@dataclass(frozen=True)
class Shutdown:
    """pool -> worker: leave the loop, destroy the process group and exit 0."""


MESSAGES = {
    cls.__name__: cls
    for cls in (Start, Joining, Joined, Hello, ScoreRow, Idle, RowResult, Failure, LoadWeights, SwapWeights, WeightsDone,
                LoadProgress, Shutdown)
}


def encode(message) -> bytes:
    body = asdict(message)
    body["type"] = type(message).__name__
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes):
    body = msgpack.unpackb(frame, raw=False)
    if not isinstance(body, dict) or body.get("type") not in MESSAGES:
        raise ValueError(f"not a packscore worker message: {str(body)[:80]!r}")
    cls = MESSAGES[body.pop("type")]
    expected = {f.name for f in fields(cls)}
    if set(body) != expected:
        raise ValueError(f"{cls.__name__} message has fields {sorted(body)}, expected {sorted(expected)}")
    return cls(**body)
