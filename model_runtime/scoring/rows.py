"""Host-side layout of one packed row: validating sequences, planning the row, splitting results.

Legend: T = tokens in the packed row, N = scored positions (the head's rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from model_runtime.kernels.logprob_head import MAX_TEMPERATURE
from model_runtime.model.packing import PackedBatch, PrefixLinks, upload
from model_runtime.scoring.head import HeadOutput
from model_runtime.scoring.prefix import find_groups
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
    if not 0 <= seq.top_k <= min(MAX_TOP_K, vocab_size):
        raise InvalidSequenceError(f"top_k must be in [0, {min(MAX_TOP_K, vocab_size)}], got {seq.top_k}", "top_k")


def _temperature32(temperature: float) -> float:
    """A temperature float32 can hold: one above its largest (T > 3.4e38, a uniform distribution
    all the same) as that largest, the head's own clamp, without numpy's overflow warning per request."""
    return min(temperature, MAX_TEMPERATURE)


@dataclass(frozen=True)
class RowPlan:
    """Host-side layout of one packed row: what to feed and which positions to score.

    Labels are the next token of the same sequence, taken on the global row (before any
    sequence-parallel split): position ``start + t - 1`` predicts token ``t`` for ``t`` in
    ``score_from .. L - 1``.

    With shared prefixes (``links``), a position of a shared segment is scored once for all the
    sequences that ask for it at one temperature; ``expand_N`` then maps the sequences' scored
    positions, in sequence order, to the head's rows.
    """

    lengths: tuple[int, ...]
    ids_T: np.ndarray  # int64 [T]
    positions_N: np.ndarray  # int64 [N], row positions whose next token is scored (increasing)
    targets_N: np.ndarray  # int64 [N]
    temperature_N: np.ndarray  # float32 [N]
    top_k: int  # widest top-k asked for in the row
    links: PrefixLinks | None = None  # shared prefixes: which segments continue which
    expand_N: np.ndarray | None = None  # int64 [sum of num_scored]: head row of each result
    tokens_saved: int = 0  # tokens the shared prefixes removed from the row

    def padded_row(self, multiple: int, device, minimum: int = 0) -> tuple[PackedBatch, np.ndarray]:
        """The row's ``PackedBatch``, padded with a segment of its own (never scored) to a
        multiple of ``multiple`` tokens and at least ``minimum``, and its ids with the
        padding's (``PAD_TOKEN``)."""
        packed, pad = PackedBatch.from_lengths_padded(self.lengths, multiple, device=device, links=self.links, minimum=minimum)
        ids_T = np.concatenate([self.ids_T, np.full(pad, PAD_TOKEN, dtype=np.int64)]) if pad else self.ids_T
        return packed, ids_T

    def expand(self, head: HeadOutput) -> HeadOutput:
        """The head's rows in sequence order (one per scored position of every sequence)."""
        if self.expand_N is None:
            return head
        # Asynchronous: a blocking upload would wait for this row's kernels, and the next row
        # could not be queued behind them (``Scorer.score``).
        index = upload(torch.from_numpy(self.expand_N), head.logprobs_N.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return HeadOutput(pick(head.logprobs_N), pick(head.entropy_N), pick(head.top_k_ids_NK), pick(head.top_k_logprobs_NK))


def plan_row(sequences: Sequence[SequenceInput], prefix_min_tokens: int = 0, rounding=None) -> RowPlan:
    """The row of ``sequences``; with ``prefix_min_tokens`` > 0, sequences that share at least that
    many leading tokens run them once (``model_runtime.scoring.prefix``; ``rounding``: only among
    members whose lengths compute them alike)."""
    groups = find_groups(sequences, prefix_min_tokens, rounding) if prefix_min_tokens > 0 else []
    if groups:
        return _plan_shared_row(sequences, groups)
    lengths = tuple(s.length for s in sequences)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    positions, targets, temps = [], [], []
    for seq, start in zip(sequences, starts):
        positions.append(np.arange(start + seq.score_from - 1, start + seq.length - 1, dtype=np.int64))
        targets.append(np.asarray(seq.input_ids[seq.score_from :], dtype=np.int64))
        temps.append(np.full(seq.num_scored, _temperature32(seq.temperature), dtype=np.float32))
    return RowPlan(
        lengths=lengths,
        ids_T=np.concatenate([np.asarray(s.input_ids, dtype=np.int64) for s in sequences]),
        positions_N=np.concatenate(positions),
        targets_N=np.concatenate(targets),
        temperature_N=np.concatenate(temps),
        top_k=max(s.top_k for s in sequences),
    )


def _plan_shared_row(sequences: Sequence[SequenceInput], groups) -> RowPlan:
    """Layout: every group's shared segment, then the sequences of no group, then every member's
    own remainder (a continuation of its group's shared segment)."""
    ids = [np.asarray(s.input_ids, dtype=np.int64) for s in sequences]
    member_of = {i: g for g, group in enumerate(groups) for i in group.members}
    loose = [i for i in range(len(sequences)) if i not in member_of]
    pieces = [ids[g.members[0]][: g.shared] for g in groups] + [ids[i] for i in loose]
    roots = len(pieces)
    starts: list[int] = list(np.cumsum([0] + [p.size for p in pieces])[:-1])
    seg_start: dict[int, int] = {i: starts[len(groups) + j] for j, i in enumerate(loose)}
    parents = [-1] * roots
    offset = sum(p.size for p in pieces)
    for g, group in enumerate(groups):
        for i in group.members:
            own = ids[i][group.shared :]
            pieces.append(own)
            parents.append(g)
            seg_start[i] = offset
            offset += own.size
    # Every scored position of every sequence, as (row position, target, temperature).
    rows, targets, temps = [], [], []
    for i, seq in enumerate(sequences):
        t = np.arange(seq.score_from, seq.length, dtype=np.int64)  # scored tokens; t - 1 predicts t
        if i in member_of:
            group = groups[member_of[i]]
            prefix_start = starts[member_of[i]]
            inside = t - 1 < group.shared
            row = np.where(inside, prefix_start + t - 1, seg_start[i] + t - 1 - group.shared)
        else:
            row = seg_start[i] + t - 1
        rows.append(row)
        targets.append(ids[i][seq.score_from :])
        temps.append(np.full(t.size, _temperature32(seq.temperature), dtype=np.float32))
    rows_all, targets_all, temps_all = np.concatenate(rows), np.concatenate(targets), np.concatenate(temps)
    # A shared position asked for by several sequences at one temperature is scored once.
    keys = np.stack([rows_all, temps_all.view(np.int32).astype(np.int64)], axis=1)
    if keys.shape[0]:
        unique, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    else:  # nothing scored in the row
        unique, first, inverse = keys, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return RowPlan(
        lengths=tuple(int(p.size) for p in pieces),
        ids_T=np.concatenate(pieces),
        positions_N=unique[:, 0].copy(),
        targets_N=targets_all[first],
        temperature_N=temps_all[first],
        top_k=max(s.top_k for s in sequences),
        links=PrefixLinks(tuple(parents), roots),
        expand_N=inverse.reshape(-1).astype(np.int64),
        tokens_saved=sum(g.tokens_saved for g in groups),
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
