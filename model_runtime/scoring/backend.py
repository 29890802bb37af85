"""What the HTTP service drives: something that scores one packed row at a time.

``LocalBackend`` runs the scorer in this process. The multi-process worker pool
(``model_runtime.pool.pool``) offers the same surface, with ``concurrency`` equal to its number of
data-parallel groups. The service never touches torch directly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from model_runtime.scoring.loading import LoadedModel
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput, SequenceScores


@dataclass(frozen=True)
class ModelInfo:
    """The facts /v1/models and the metrics report about the served model."""

    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    weights_version: str
    kernels: dict[str, str]
    parallel: dict = field(default_factory=lambda: {"world_size": 1, "dp": 1, "sp": 1, "fsdp": False})
    slow_kernels: tuple[str, ...] = ()

    @staticmethod
    def of(loaded: LoadedModel, parallel: dict | None = None) -> "ModelInfo":
        return ModelInfo(
            name=loaded.name,
            architecture=loaded.architecture,
            vocab_size=loaded.vocab_size,
            max_model_len=loaded.max_model_len,
            dtype=loaded.dtype_name,
            device=loaded.device.type,
            weights_version=loaded.weights_version,
            kernels=loaded.backends.names,
            parallel=parallel or {"world_size": 1, "dp": 1, "sp": 1, "fsdp": False},
            slow_kernels=loaded.backends.fallbacks,
        )


class BackendUnavailableError(RuntimeError):
    """The backend cannot score right now (a worker died, or it is restarting)."""


class ScoringBackend(Protocol):
    info: ModelInfo
    concurrency: int  # how many score_row calls may run at the same time
    max_row_tokens: int  # token budget of one row (sp x the per-GPU budget in a sequence-parallel group)

    def score_row(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        """Scores ``sequences`` as one packed forward. Blocking; thread-safe up to ``concurrency``.

        Raises ``InvalidSequenceError`` for bad input, ``torch.OutOfMemoryError`` (or another
        ``RuntimeError`` naming memory) when the row does not fit, ``BackendUnavailableError``
        when no worker can take it.
        """

    def warm_up(self) -> None:
        """Compiles and autotunes kernels for the configured budget (before readiness)."""

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


class LocalBackend:
    """The scorer in this process; one forward at a time."""

    concurrency = 1

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.info = ModelInfo.of(scorer.loaded)
        self.max_row_tokens = scorer.max_batch_tokens
        self._lock = threading.Lock()

    def score_row(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        with self._lock:
            return self.scorer.score_row(sequences)

    def warm_up(self) -> None:
        with self._lock:
            self.scorer.warm_up()

    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        pass
