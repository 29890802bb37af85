"""Host-side layout of one packed row: validating sequences, planning the row, splitting results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from model_runtime.model.packing import PackedBatch
from model_runtime.types import MAX_TOP_K, InvalidSequenceError, SequenceInput, SequenceScores

PAD_TOKEN = 0  # token id of alignment padding; any valid id works, its segment is never scored


def validate_sequence(seq: SequenceInput, vocab_size: int, index: int = 0) -> None:
    p = f"sequences[{index}]"
    ids = np.asarray(seq.input_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidSequenceError("input_ids must be a non-empty list of token ids", f"{p}.input_ids")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidSequenceError("input_ids must hold integers", f"{p}.input_ids")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        j = int(bad[0])
        raise InvalidSequenceError(
            f"token id {int(ids[j])} is outside the vocabulary [0, {vocab_size})", f"{p}.input_ids[{j}]"
        )
    if not 1 <= seq.score_from <= ids.size:
        raise InvalidSequenceError(f"score_from must be in [1, {ids.size}], got {seq.score_from}", f"{p}.score_from")
    if not (np.isfinite(seq.temperature) and seq.temperature > 0):
        raise InvalidSequenceError(f"temperature must be finite and > 0, got {seq.temperature}", "temperature")
    if not 0 <= seq.top_k <= MAX_TOP_K:
        raise InvalidSequenceError(f"top_k must be in [0, {MAX_TOP_K}], got {seq.top_k}", "top_k")


@dataclass(frozen=True)
class RowPlan:
    """Host-side layout of one packed row: what to feed and which positions to score.

    Labels are the next token of the same sequence, taken on the global row (before any
    sequence-parallel split): position ``start + t - 1`` predicts token ``t`` for ``t`` in
    ``score_from .. L - 1``.
    """

    lengths: tuple[int, ...]
    ids_T: np.ndarray  # int64 [T]
    positions_N: np.ndarray  # int64 [N], row positions whose next token is scored
    targets_N: np.ndarray  # int64 [N]
    temperature_N: np.ndarray  # float32 [N]
    top_k: int  # widest top-k asked for in the row

    def padded_row(self, multiple: int, device) -> tuple[PackedBatch, np.ndarray]:
        """The row's ``PackedBatch``, padded with a segment of its own (never scored) to a
        multiple of ``multiple`` tokens, and its ids with the padding's (``PAD_TOKEN``)."""
        packed, pad = PackedBatch.from_lengths_padded(self.lengths, multiple, device=device)
        ids_T = np.concatenate([self.ids_T, np.full(pad, PAD_TOKEN, dtype=np.int64)]) if pad else self.ids_T
        return packed, ids_T


def plan_row(sequences: Sequence[SequenceInput]) -> RowPlan:
    lengths = tuple(s.length for s in sequences)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    positions, targets, temps = [], [], []
    for seq, start in zip(sequences, starts):
        positions.append(np.arange(start + seq.score_from - 1, start + seq.length - 1, dtype=np.int64))
        targets.append(np.asarray(seq.input_ids[seq.score_from :], dtype=np.int64))
        temps.append(np.full(seq.num_scored, seq.temperature, dtype=np.float32))
    return RowPlan(
        lengths=lengths,
        ids_T=np.concatenate([np.asarray(s.input_ids, dtype=np.int64) for s in sequences]),
        positions_N=np.concatenate(positions),
        targets_N=np.concatenate(targets),
        temperature_N=np.concatenate(temps),
        top_k=max(s.top_k for s in sequences),
    )


def split_results(sequences: Sequence[SequenceInput], head, top_k: int) -> list[SequenceScores]:
    """Cuts the row's head output back into per-sequence numpy arrays (in row order)."""
    logp = head.logprobs_N.cpu().numpy()
    ent = head.entropy_N.cpu().numpy()
    ids = head.top_k_ids_NK.to(torch.int32).cpu().numpy() if top_k else None
    top_logp = head.top_k_logprobs_NK.cpu().numpy() if top_k else None
    out, offset = [], 0
    for seq in sequences:
        n, k = seq.num_scored, seq.top_k
        window = slice(offset, offset + n)
        out.append(
            SequenceScores(
                logprobs=logp[window].copy(),
                entropy=ent[window].copy() if seq.return_entropy else None,
                top_k_ids=ids[window, :k].copy() if k else None,
                top_k_logprobs=top_logp[window, :k].copy() if k else None,
            )
        )
        offset += n
    return out
