"""Packing: many sequences in one THD row, and the metadata every packed forward receives.

Legend: T = tokens in the packed row, N = sequences (segments) in the row.

A row is a flat token dimension; ``cu_seqlens`` marks where each segment starts. Boundaries
come from request lengths only (never from position ids or token values) and travel as the
``PackedBatch`` argument of every forward: nothing is left on modules between forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch


@dataclass(frozen=True)
class PackedBatch:
    """Boundaries of one packed row; immutable, built once per forward.

    Attributes:
        lengths: length of every segment, in row order.
        cu_seqlens: int32 ``[N + 1]`` cumulative lengths on the compute device.
        cu_seqlens_host: the same offsets as a Python tuple (no device sync to read them).
        max_seqlen: length of the longest segment.
        position_ids: int64 ``[T]`` positions that restart at 0 in every segment.
        padding_segments: indices of segments that only align the row (never scored).

    Example:
        >>> p = PackedBatch.from_lengths([3, 2])
        >>> p.cu_seqlens_host, p.position_ids.tolist()
        ((0, 3, 5), [0, 1, 2, 0, 1])
    """

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    cu_seqlens_host: tuple[int, ...]
    max_seqlen: int
    position_ids: torch.Tensor
    padding_segments: tuple[int, ...] = field(default=())

    @staticmethod
    def from_lengths(
        lengths: Sequence[int],
        device: torch.device | str = "cpu",
        padding_segments: Sequence[int] = (),
    ) -> "PackedBatch":
        lengths = tuple(int(n) for n in lengths)
        if not lengths:
            raise ValueError("a packed row needs at least one segment, got none")
        bad = [n for n in lengths if n < 1]
        if bad:
            raise ValueError(f"every segment needs at least one token, got lengths {bad}")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        # FLA caches index helpers by tensor identity: a fresh tensor per forward keeps every
        # forward on the path that matches its own boundaries.
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
        position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).to(device)
        return PackedBatch(
            lengths=lengths,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=tuple(offsets),
            max_seqlen=max(lengths),
            position_ids=position_ids,
            padding_segments=tuple(padding_segments),
        )

    @staticmethod
    def from_lengths_padded(
        lengths: Sequence[int], multiple: int, device: torch.device | str = "cpu"
    ) -> tuple["PackedBatch", int]:
        """The row of ``lengths`` with a trailing padding segment (never scored) so that its
        token count is a multiple of ``multiple``; returns the batch and the padding added (0:
        none, and no padding segment)."""
        pad = (-sum(int(n) for n in lengths)) % multiple
        if pad == 0:
            return PackedBatch.from_lengths(lengths, device=device), 0
        return PackedBatch.from_lengths((*lengths, pad), device=device, padding_segments=(len(lengths),)), pad

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens_host[-1]

    # Derived views, built at most once per forward and shared by every layer. fla keys its
    # index helpers on tensor identity, so handing all 24 GDN layers the same int64 tensor lets
    # it build chunk indices once per forward instead of once per layer (each with a host sync).
    @cached_property
    def cu_seqlens_long(self) -> torch.Tensor:
        """int64 ``[N + 1]`` offsets on the compute device (fla's kernels index with them)."""
        return self.cu_seqlens.long()

    @cached_property
    def cu_seqlens_host_long(self) -> torch.Tensor:
        """int64 ``[N + 1]`` offsets on the host: lets fla plan chunks without a device sync."""
        return torch.tensor(self.cu_seqlens_host, dtype=torch.long)

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    def segments(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of every segment (``segment_bounds``)."""
        return self.segment_bounds

    @cached_property
    def segment_bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of every segment, built once per forward for all layers."""
        offsets = self.cu_seqlens_host
        return tuple(zip(offsets[:-1], offsets[1:]))

    def segments_within(self, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """The segments' parts inside tokens ``[lo, hi)`` (a sequence-parallel shard), as
        ``(start, end)`` relative to ``lo``; they tile ``[0, hi - lo)``.

        >>> PackedBatch.from_lengths([3, 5]).segments_within(2, 6)
        ((0, 1), (1, 4))

        Kept per shard, so every layer of a forward reuses the first one's.
        """
        cache = self._segments_within
        if (lo, hi) not in cache:
            cache[(lo, hi)] = tuple(
                (max(start, lo) - lo, min(end, hi) - lo) for start, end in self.segment_bounds if start < hi and end > lo
            )
        return cache[(lo, hi)]

    @cached_property
    def _segments_within(self) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
        return {}


def pack_first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Places sequences into rows of at most ``budget`` tokens, first-fit decreasing.

    Returns, for every row, the indices of the sequences it holds (longest first). A sequence
    longer than the budget gets a row of its own: the caller decides whether it may run.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(budget - n)
    return rows
