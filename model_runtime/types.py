"""The value types the scorer, the worker pool and the HTTP layer share (numpy only, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_K = 20  # widest top-k a request may ask for


@dataclass(frozen=True)
class SequenceInput:
    """One sequence to score; options are per sequence because a row may mix requests."""

    input_ids: np.ndarray  # int [L], the prompt and the response
    score_from: int = 1  # first position whose log-probability is returned
    temperature: float = 1.0
    top_k: int = 0
    return_entropy: bool = True

    @property
    def length(self) -> int:
        return int(len(self.input_ids))

    @property
    def num_scored(self) -> int:
        return self.length - self.score_from


@dataclass
class SequenceScores:
    logprobs: np.ndarray  # float32 [n_scored]
    entropy: np.ndarray | None  # float32 [n_scored], when asked for
    top_k_ids: np.ndarray | None  # int32 [n_scored, k], when top_k > 0
    top_k_logprobs: np.ndarray | None  # float32 [n_scored, k]
    weights_version: str | None = None  # the version of the weights that scored the whole sequence


class InvalidSequenceError(ValueError):
    """A sequence the model cannot score; ``param`` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
