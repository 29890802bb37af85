"""Padded batches as RL trainers hold them (verl, OpenRLHF) in, padded per-token arrays out.

A batch is ``input_ids`` [B, T], ``attention_mask`` [B, T] (1 on real tokens, left or right
padding) and ``response_mask`` [B, R] over the last R columns of ``input_ids`` (R == T: the whole
row; verl's ``response_mask`` and OpenRLHF's ``action_mask`` cover the response columns only).
Each row is sent as its real tokens up to its last response token, with ``score_from`` at its
first response token, so no pad is ever scored; the answers come back as [B, R] float32 arrays
aligned with ``response_mask``, 0 wherever it is 0.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generator

import numpy as np

from packscore_client.inputs import MAX_DEADLINE_MS
from packscore_client.protocol import ScoredSequence, ScoreError, renumbered


@dataclass
class PaddedScores:
    """Scores of a padded batch, aligned with its ``response_mask`` ([B, R], 0 where the mask is 0)."""

    logprobs: np.ndarray  # float32 [B, R]
    entropy: np.ndarray | None  # float32 [B, R], when return_entropy
    model: str | None  # None when no row had a response token (nothing was sent)
    weights_version: str | None


@dataclass
class PaddedBatch:
    """A checked padded batch: the sequences to send and where their answers go."""

    response_mask: np.ndarray  # bool [B, R]
    offset: int  # T - R: the column of input_ids that response_mask's column 0 is
    rows: list[int]  # the rows that have response tokens, in the order of ``sequences``
    starts: list[int]  # per sent row: the input_ids column of its first scored token
    sequences: list[dict]  # per sent row: {"id", "input_ids", "score_from"}

    @classmethod
    def from_arrays(cls, input_ids: Any, attention_mask: Any, response_mask: Any) -> "PaddedBatch":
        ids, attn, resp = (_numpy(input_ids, "input_ids"), _numpy(attention_mask, "attention_mask") != 0,
                           _numpy(response_mask, "response_mask") != 0)
        if ids.ndim != 2 or attn.shape != ids.shape:
            raise ValueError(f"input_ids and attention_mask must both be [B, T], got {ids.shape} and {attn.shape}")
        if resp.ndim != 2 or resp.shape[0] != ids.shape[0] or resp.shape[1] > ids.shape[1]:
            raise ValueError(f"response_mask must be [B, R] with R <= T over the last R columns of input_ids "
                             f"{ids.shape}, got {resp.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
        offset = ids.shape[1] - resp.shape[1]
        rows, starts, sequences = [], [], []
        for b in range(ids.shape[0]):
            real = np.flatnonzero(attn[b])
            scored = np.flatnonzero(resp[b]) + offset
            if scored.size == 0:
                continue  # nothing to score in this row: its answer stays 0
            if real.size == 0:
                raise ValueError(f"row {b}: response_mask marks tokens but attention_mask marks none as real")
            if real.size != real[-1] - real[0] + 1:
                raise ValueError(f"row {b}: attention_mask is not one contiguous run of 1s (left or right padding "
                                 "only); interleaved padding would be scored as tokens")
            if scored[0] < real[0] or scored[-1] > real[-1]:
                raise ValueError(f"row {b}: response_mask marks column {int(scored[0] if scored[0] < real[0] else scored[-1])}"
                                 f" of input_ids, which attention_mask says is padding")
            bad = np.flatnonzero((ids[b, real] < 0) | (ids[b, real] >= 2**31))
            if bad.size:  # msgpack sends int32: a wrapped id could pass as a valid one
                t = int(real[bad[0]])
                raise ValueError(f"input_ids[{b}, {t}]: token ids must be in [0, 2**31), got {int(ids[b, t])}")
            if scored[0] == real[0]:
                raise ValueError(f"row {b}: its first real token is marked as response; a token needs at least one "
                                 "before it to be predicted from")
            rows.append(b)
            starts.append(int(scored[0]))
            sequences.append({"id": f"row-{b}", "input_ids": ids[b, real[0] : scored[-1] + 1],
                              "score_from": int(scored[0] - real[0])})
        return cls(resp, offset, rows, starts, sequences)

    def named_by_place(self, error: ScoreError) -> ScoreError:
        """``error`` with the sent rows' fields (``sequences[k].input_ids[j]``) named by their place
        in the caller's arrays (``input_ids[b, t]``)."""
        def place(match: re.Match) -> str:
            k = int(match.group(1))
            if k >= len(self.rows):
                return match.group(0)
            first = self.starts[k] - self.sequences[k]["score_from"]  # the row's first real column
            b = self.rows[k]
            return f"input_ids[{b}, {first + int(match.group(2))}]" if match.group(2) else f"input_ids[{b}]"

        def row(match: re.Match) -> str:
            k = int(match.group(1))
            return f"Row {self.rows[k]}" if k < len(self.rows) else match.group(0)

        param = _SENT.sub(place, error.param) if error.param else error.param
        return error.renamed(_SEQUENCE.sub(row, _SENT.sub(place, error.message)), param)

    def scores(self, results: list[ScoredSequence], return_entropy: bool) -> PaddedScores:
        """The answers to ``sequences``, in order, placed as [B, R] arrays."""
        logprobs = np.zeros(self.response_mask.shape, np.float32)
        entropy = np.zeros(self.response_mask.shape, np.float32) if return_entropy else None
        for b, start, result in zip(self.rows, self.starts, results, strict=True):
            cols = slice(start - self.offset, start - self.offset + result.logprobs.size)
            logprobs[b, cols] = result.logprobs
            if entropy is not None:
                entropy[b, cols] = result.entropy
        logprobs[~self.response_mask] = 0.0  # positions inside a response the mask leaves out
        if entropy is not None:
            entropy[~self.response_mask] = 0.0
        first = results[0] if results else None
        return PaddedScores(logprobs, entropy, first and first.model, first and first.weights_version)


# A sent row's field as the server names it, and the row in its messages ("Sequence 3 has ...").
_SENT = re.compile(r"sequences\[(\d+)\](?:\.input_ids(?:\[(\d+)\])?)?")
_SEQUENCE = re.compile(r"\bSequence (\d+)")


def _numpy(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, on any device: no torch import needed
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim == 0 and arr.dtype == object:  # None, a dict, any object numpy cannot read as an array
        hint = f": pass the batch's arrays (batch[{name!r}]), not the batch" if isinstance(x, Mapping) else ""
        given = "None" if x is None else f"a {type(x).__name__}"
        raise TypeError(f"{name} must be a 2-D array (numpy, torch or nested lists), got {given}{hint}")
    return arr


_VERSION_TRIES = 3  # rescorings of a padded batch whose weights changed while it was scored


def _one_version(results: list[ScoredSequence]) -> bool:
    return len({r.weights_version for r in results}) <= 1


def _to_rescore(results: list[ScoredSequence], models: list[dict]) -> tuple[str, list[int]]:
    """The version served now and the results to score again with it (a split batch whose parts
    met a weight update)."""
    name = results[0].model
    served = [m["weights_version"] for m in models if m.get("id") == name]
    if len(served) != 1:
        raise ScoreError(404, "model_not_found", f"/v1/models does not list {name!r}, which scored the batch", "model")
    return served[0], [i for i, r in enumerate(results) if r.weights_version != served[0]]


def _left_ms(end: float | None) -> int | None:
    """What is left of a call's deadline for another request, or ScoreError 504 once it passed."""
    if end is None:
        return None
    left = min(MAX_DEADLINE_MS, math.ceil((end - time.monotonic()) * 1000.0))  # a float's rounding: not past the bound
    if left <= 0:
        raise ScoreError(504, "deadline_exceeded", "deadline_ms passed while the batch was scored again by one "
                         "weights version.", "deadline_ms")
    return left


def by_one_version(results: list[ScoredSequence], sequences: list, end: float | None) -> Generator[tuple, Any, list]:
    """``results`` of a padded batch, those of a version other than the one served after an update
    scored again with it (``score_padded``). Yields ``("models",)`` (and receives ``/v1/models``'
    list) or ``("score", sequences, weights_version, deadline_ms)`` (and receives the results, or
    the ScoreError raised instead), as ``Protocol.exchange`` drives its I/O through each client.
    A rescoring's error other than a version mismatch is raised, its sequence numbers those of ``sequences``."""
    for _ in range(_VERSION_TRIES):
        if _one_version(results):
            return results
        served, rows = _to_rescore(results, (yield ("models",)))
        again = yield ("score", [sequences[i] for i in rows], served, _left_ms(end))
        if isinstance(again, ScoreError):
            if again.type != "weights_version_mismatch":  # changed again meanwhile: the next try
                raise renumbered(again, rows)  # numbered within the rows re-sent: turned into places in ``sequences``
            continue
        for i, r in zip(rows, again):
            results[i] = r
    if not _one_version(results):
        raise ScoreError(409, "weights_version_mismatch", f"the weights of {results[0].model!r} changed "
                         f"{_VERSION_TRIES} times while one padded batch was scored; pin weights_version= to score "
                         "it by one version", "weights_version")
    return results
