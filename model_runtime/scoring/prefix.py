"""Shared prefixes: finding the sequences of a row that start with the same tokens.

GRPO-style groups score several responses to one prompt. ``find_groups`` finds, among a row's
sequences, those that share their first tokens; ``plan_row`` (``model_runtime.scoring.rows``) then
lays the shared part out once as a segment of its own, and every member's remainder as a segment
that continues that segment's state (``PackedBatch.links``).

A group's shared segment is its longest common prefix less one token, rounded down to a multiple of
``ALIGN`` tokens:
- less one: every member keeps at least one token of its own, so the shared segment's last
  position has one label for all members (the common token after it), and a member equal to the
  common prefix is a continuation of one token;
- rounded down: the delta rule's chunked kernels work in chunks of 64 tokens from a segment's
  start; a continuation that starts on a chunk boundary of the unshared sequence is cut into the
  same chunks, so sharing changes no chunk's arithmetic.
  (The kernels also run a parent that ends off a boundary exactly, ``StateChunks``; sharing those
  last tokens measured no faster, docs/prefix-sharing.md.)

With a ``RowRounding`` (measured on the GPU, ``model_runtime.scoring.rounding``), a group is also
cut where its members' lengths would round the prompt's rows of a narrow product differently
(cuBLAS picks their kernel by the row count): members then share only with those that compute
the prompt as they would alone, so sharing changes no number at all (docs/prefix-sharing.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from model_runtime.types import SequenceInput

ALIGN = 64  # fla's delta-rule chunk size (see the module docstring)


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences (indices into the row) whose first ``shared`` tokens are run once."""

    members: tuple[int, ...]
    shared: int

    @property
    def tokens_saved(self) -> int:
        return (len(self.members) - 1) * self.shared


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def shared_length(common: int, min_tokens: int) -> int:
    """The tokens a group whose members have ``common`` leading tokens in common runs once (0: none)."""
    shared = (common - 1) // ALIGN * ALIGN
    return shared if shared >= max(min_tokens, 1) else 0


def share(members: Sequence[int], lengths: Sequence[int], common: int, min_tokens: int, rounding=None) -> list[PrefixGroup]:
    """The groups that ``members`` (sequences starting with the same ``common`` tokens, of
    ``lengths`` in the order of ``members``) form: one, or with ``rounding`` those its row
    counts allow (``RowRounding.split``)."""
    shared = shared_length(common, min_tokens) if len(members) > 1 else 0
    if not shared:
        return []
    if rounding is None:
        return [PrefixGroup(tuple(sorted(members)), shared)]
    return [PrefixGroup(tuple(sorted(members[j] for j in part)), shared) for part in rounding.split(lengths)]


def head_key(input_ids, min_tokens: int) -> bytes | None:
    """What the sequences that may share a prefix have in common: their first
    ``max(min_tokens, ALIGN) + 1`` tokens (a shared segment of at least ``min_tokens`` and
    ``ALIGN`` tokens, plus one token of each member's own); None for a shorter sequence, or with
    sharing off."""
    need = max(min_tokens, ALIGN) + 1
    ids = np.asarray(input_ids)
    if min_tokens < 1 or ids.size < need:
        return None
    return ids[:need].astype(np.int64).tobytes()


def find_groups(sequences: Sequence[SequenceInput], min_tokens: int, rounding=None) -> list[PrefixGroup]:
    """Groups of at least two sequences whose shared segment has ``>= min_tokens`` tokens.

    Sequences are grouped by their first ``min_tokens`` tokens; a group shares the longest prefix
    common to all its members (less one token, rounded down to ``ALIGN``), or with ``rounding``
    (a ``RowRounding``) splits where its members' lengths round that prefix's rows differently.
    Groups come in the order of their first member; members in row order.
    """
    if min_tokens < 1:
        return []
    by_head: dict[bytes, list[int]] = {}
    ids = [np.asarray(s.input_ids, dtype=np.int64) for s in sequences]
    for i, x in enumerate(ids):
        if (key := head_key(x, min_tokens)) is not None:
            by_head.setdefault(key, []).append(i)
    groups = []
    for members in by_head.values():
        if len(members) < 2:
            continue
        first = ids[members[0]]
        common = min(common_prefix_length(first, ids[j]) for j in members[1:])
        groups += share(members, [ids[j].size for j in members], common, min_tokens, rounding)
    groups.sort(key=lambda g: g.members[0])
    return groups


def tokens_saved(sequences: Sequence[SequenceInput], min_tokens: int, rounding=None) -> int:
    """How many tokens sharing prefixes removes from a row of ``sequences``."""
    return sum(g.tokens_saved for g in find_groups(sequences, min_tokens, rounding))


def pack_groups_first_fit(sequences: Sequence[SequenceInput], budget: int, min_tokens: int,
                          rounding=None) -> list[list[int]]:
    """Rows of at most ``budget`` run tokens (shared prefixes counted once), first-fit decreasing.

    The sequences that share a prefix go as one unit when it fits a row; a group larger than the
    budget is cut into units that do, each still sharing its prefix. Without sharing
    (``min_tokens`` 0) this is ``pack_first_fit_decreasing``.
    """
    from model_runtime.model.packing import pack_first_fit_decreasing

    lengths = [s.length for s in sequences]
    groups = find_groups(sequences, min_tokens, rounding)
    grouped = {i for g in groups for i in g.members}
    units: list[list[int]] = [[i] for i in range(len(sequences)) if i not in grouped]
    costs: list[int] = [lengths[i] for i in range(len(sequences)) if i not in grouped]
    for g in groups:
        unit: list[int] = []
        cost = g.shared
        for i in sorted(g.members, key=lambda i: -lengths[i]):
            own = lengths[i] - g.shared
            if unit and cost + own > budget:
                units.append(unit)
                costs.append(cost if len(unit) > 1 else lengths[unit[0]])
                unit, cost = [], g.shared
            unit.append(i)
            cost += own
        units.append(unit)
        costs.append(cost if len(unit) > 1 else lengths[unit[0]])
    rows = pack_first_fit_decreasing(costs, budget)
    return [[i for u in row for i in units[u]] for row in rows]


class RowTokens:
    """Tokens a row will run as sequences join it, shared prefixes counted once.

    Follows ``find_groups``'s rule (with the same ``rounding``) for sequences added in row order,
    so a row the scheduler fills to ``budget`` with it runs at most ``budget`` tokens.

    >>> row = RowTokens(min_tokens=64)
    >>> prompt = np.arange(100)
    >>> row.add(np.concatenate([prompt, [1, 2]])), row.add(np.concatenate([prompt, [3]]))
    (True, True)
    >>> row.total  # 102 + 101 - 64 shared
    139
    """

    def __init__(self, min_tokens: int, rounding=None):
        self.min_tokens = int(min_tokens)
        self.rounding = rounding
        self.total = 0
        # first tokens -> [first member's ids, members' lengths, shortest common prefix with the first, tokens saved]
        self._groups: dict[bytes, list] = {}

    def cost_with(self, input_ids) -> int:
        """``total`` once ``input_ids`` has joined."""
        return self._cost(np.asarray(input_ids))[0]

    def add(self, input_ids, budget: int | None = None) -> bool:
        """Joins ``input_ids`` to the row, unless ``total`` would then pass ``budget``; whether it
        joined (what it saves is worked out once, for the test and the join alike)."""
        ids = np.asarray(input_ids)
        total, key, group, joined = self._cost(ids)
        if budget is not None and total > budget:
            return False
        self.total = total
        if key is None:
            return True
        if group is None:
            self._groups[key] = [ids, [ids.size], ids.size, 0]
        else:
            group[1].append(ids.size)
            group[2], group[3] = joined
        return True

    def _cost(self, ids: np.ndarray):
        """``(total with ids, its group's key, the group, (common, saved) with ids in it)``; a
        question: no group is made for it."""
        key = head_key(ids, self.min_tokens)
        group = None if key is None else self._groups.get(key)
        if group is None:
            return self.total + ids.size, key, None, None
        joined = self._joined(group, ids)
        return self.total + ids.size - (joined[1] - group[3]), key, group, joined

    def _joined(self, group, ids: np.ndarray) -> tuple[int, int]:
        """``(common, saved)`` of ``group`` with ``ids`` in it."""
        first, lengths, common, _ = group
        common = min(common, common_prefix_length(first, ids))
        members = list(range(len(lengths) + 1))
        saved = sum(g.tokens_saved for g in share(members, lengths + [ids.size], common, self.min_tokens, self.rounding))
        return common, saved
