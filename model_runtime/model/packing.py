"""Packing: many sequences in one THD row, and the metadata every packed forward receives.

Legend: T = tokens in the packed row, N = sequences (segments) in the row, Tw = tokens of the
row's whole sequences (a continuation's parent's tokens, then its own) for attention over a row
with prefix links.

A row is a flat token dimension; ``cu_seqlens`` marks where each segment starts. Boundaries
come from request lengths only (never from position ids or token values) and travel as the
``PackedBatch`` argument of every forward: nothing is left on modules between forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class PrefixLinks:
    """Segments that continue another segment instead of starting from nothing.

    ``parents[i]`` is the segment whose end state segment ``i`` continues (its GDN recurrent
    state, its conv window, its attention keys and values), or -1. Segments ``[0, roots)`` have
    no parent and every parent is one of them, so one pass over the roots gives every state the
    others need.
    """

    parents: tuple[int, ...]
    roots: int

    def __post_init__(self):
        n, roots = len(self.parents), self.roots
        if not 0 <= roots <= n:
            raise ValueError(f"roots must be in [0, {n}], got {roots}")
        if any(p != -1 for p in self.parents[:roots]):
            raise ValueError(f"the first {roots} segments are roots and cannot have parents: {self.parents[:roots]}")
        bad = [p for p in self.parents[roots:] if not -1 <= p < roots]
        if bad:
            raise ValueError(f"a parent must be one of the {roots} root segments, got {bad}")


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``. To a GPU through pinned memory without blocking: a plain copy from
    pageable memory waits for every kernel already queued, which would leave the GPU idle while
    the host prepares the next row (``Scorer.score`` queues a row before collecting the last)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
        links: which segments continue another (a shared prefix), or None: every segment
            starts from nothing. A continuation's positions go on from its parent's length.

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
    links: PrefixLinks | None = None

    @staticmethod
    def from_lengths(
        lengths: Sequence[int],
        device: torch.device | str = "cpu",
        padding_segments: Sequence[int] = (),
        links: PrefixLinks | None = None,
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
        starts = [0] * len(lengths)
        if links is not None:
            if len(links.parents) != len(lengths):
                raise ValueError(f"links name {len(links.parents)} segments for a row of {len(lengths)}")
            # A continuation's rotary positions go on from its parent's end.
            starts = [lengths[p] if p >= 0 else 0 for p in links.parents]
        # FLA caches index helpers by tensor identity: a fresh tensor per forward keeps every
        # forward on the path that matches its own boundaries.
        cu_seqlens = upload(torch.tensor(offsets, dtype=torch.int32), device)
        position_ids = upload(torch.cat([torch.arange(a, a + n, dtype=torch.long) for a, n in zip(starts, lengths)]), device)
        return PackedBatch(
            lengths=lengths,
            cu_seqlens=cu_seqlens,
            cu_seqlens_host=tuple(offsets),
            max_seqlen=max(lengths),
            position_ids=position_ids,
            padding_segments=tuple(padding_segments),
            links=links,
        )

    @staticmethod
    def from_lengths_padded(
        lengths: Sequence[int],
        multiple: int,
        device: torch.device | str = "cpu",
        links: PrefixLinks | None = None,
        minimum: int = 0,
    ) -> tuple["PackedBatch", int]:
        """The row of ``lengths`` with a trailing padding segment (never scored) so that its
        token count is a multiple of ``multiple`` and at least ``minimum``; returns the batch and
        the padding added (0: none, and no padding segment). The padding segment continues nothing."""
        total = sum(int(n) for n in lengths)
        pad = (-max(total, minimum)) % multiple + max(0, minimum - total)
        if pad == 0:
            return PackedBatch.from_lengths(lengths, device=device, links=links), 0
        if links is not None:
            links = PrefixLinks((*links.parents, -1), links.roots)
        padded = PackedBatch.from_lengths((*lengths, pad), device=device, padding_segments=(len(lengths),), links=links)
        return padded, pad

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

    def chunk_table(self, size: int) -> torch.Tensor:
        """int64 ``[chunks, 2]`` on the compute device: ``(segment, chunk within it)`` of every
        ``size``-token chunk, segment by segment (fla's ``chunk_indices``). fla would build it in
        each forward with a blocking upload, which waits for every kernel already queued and so
        stops the next row from being queued behind this one; here it is one asynchronous upload."""
        cache = self._chunk_tables
        if size not in cache:
            counts = -(-np.asarray(self.lengths, dtype=np.int64) // size)
            segment = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
            within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
            cache[size] = upload(torch.from_numpy(np.stack([segment, within], axis=1)), self.cu_seqlens.device)
        return cache[size]

    @cached_property
    def _chunk_tables(self) -> dict[int, torch.Tensor]:
        return {}

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

    @cached_property
    def linked(self) -> "LinkedLayout":
        """What the kernels need to run a row with prefix links, built once for all layers."""
        if self.links is None:
            raise ValueError("this row has no prefix links")
        return LinkedLayout.of(self)


@dataclass(frozen=True)
class ConvWindows:
    """Gather ``gather_rows`` of the conv input as the segments of ``packed``, convolve, and
    copy output rows ``in_rows`` of that small row onto rows ``out_rows`` of the big one."""

    gather_rows: torch.Tensor
    packed: PackedBatch
    out_rows: torch.Tensor
    in_rows: torch.Tensor


@dataclass(frozen=True)
class LinkedLayout:
    """Derived views of a row with ``PrefixLinks``, shared by every layer of a forward.

    Attributes:
        root_tokens: tokens of the root segments (they come first in the row).
        roots: the root segments as a row of their own; ``rest``: the other segments.
        state_index: int64 ``[N - roots]``: for every non-root segment, the row of the roots'
            final states it starts from; ``roots`` (one past them) for a zero state.
        parents: per segment, the root it continues, or -1 (``PrefixLinks.parents``).
        parent_bounds: per segment, ``(start, end)`` of its parent, or None.
        whole: the row's sequences as they are unshared, a row of its own without links: every
            segment that no other continues, a continuation as its parent's tokens then its own.
        whole_index_Tw: int64 ``[Tw]``: the row positions that make up ``whole``.
        own_rows_T: int64 ``[T]``: for every token of the row, its row in ``whole`` (a
            continuation's own tokens are the tail of its sequence; a parent's tokens are the
            head of its first continuation's).
        own_index_Tw: int64 ``[Tw]``: the inverse, for every row of ``whole`` the token whose own
            row it is, or -1 (a parent's tokens in its later continuations' sequences).
        local_positions: int64 ``[T]`` tokens since the segment's own start (0 at every segment).
        queries: per sequence of ``whole``, the rows that are some token's own row (``own_index_Tw``
            not -1), a suffix of it: all of it for a parent's first continuation and for a sequence
            of no group, a continuation's own tokens for the others. Every row token is in exactly
            one (``on_own_queries``).
        query_tokens_T: int64 ``[T]``: the token of every query row, in ``queries``' order.
        token_queries_T: int64 ``[T]``: the inverse, every token's row among the queries.
    """

    root_tokens: int
    roots: PackedBatch
    rest: PackedBatch
    state_index: torch.Tensor
    parents: tuple[int, ...]
    parent_bounds: tuple[tuple[int, int] | None, ...]
    whole: PackedBatch
    whole_index_Tw: torch.Tensor
    own_rows_T: torch.Tensor
    own_index_Tw: torch.Tensor
    local_positions: torch.Tensor
    queries: PackedBatch
    query_tokens_T: torch.Tensor
    token_queries_T: torch.Tensor

    @staticmethod
    def of(packed: PackedBatch) -> "LinkedLayout":
        links, bounds, device = packed.links, packed.segment_bounds, packed.cu_seqlens.device
        r = links.roots
        if r == 0 or r == packed.num_segments:
            raise ValueError(f"a linked row needs roots and continuations, got {r} roots of {packed.num_segments}")
        parent_bounds = tuple(bounds[p] if p >= 0 else None for p in links.parents)
        # Every segment that no other continues, as its whole sequence; a parent's own rows are
        # read from its first continuation's (the call that unshared sequence makes). Built with
        # NumPy and uploaded at once: per-token Python lists cost milliseconds a row, which the
        # GPU spent idle at the first layer that reads the layout.
        pieces, whole_lengths, own_at, parents, tw = [], [], {}, set(links.parents), 0
        for i, ((start, end), parent) in enumerate(zip(bounds, parent_bounds)):
            if i in parents:  # its rows appear in its continuations' sequences
                continue
            head = 0 if parent is None else parent[1] - parent[0]
            if parent is not None:
                own_at.setdefault(links.parents[i], tw)
                pieces.append(np.arange(*parent))
            own_at[i] = tw + head
            pieces.append(np.arange(start, end))
            whole_lengths.append(head + end - start)
            tw += head + end - start
        whole_rows = np.concatenate(pieces)
        own_rows = np.concatenate([np.arange(own_at[i], own_at[i] + end - start) for i, (start, end) in enumerate(bounds)])
        own_index = np.full(tw, -1, dtype=np.int64)
        own_index[own_rows] = np.arange(own_rows.size)
        state_index = np.array([p if p >= 0 else r for p in links.parents[r:]], dtype=np.int64)
        local = np.concatenate([np.arange(n) for n in packed.lengths])
        is_query = own_index >= 0
        query_tokens = own_index[is_query]
        token_queries = np.empty_like(query_tokens)
        token_queries[query_tokens] = np.arange(query_tokens.size)
        query_lengths = np.add.reduceat(is_query.astype(np.int64), np.cumsum([0, *whole_lengths[:-1]])).tolist()
        parts = (whole_rows, own_rows, own_index, state_index, local, query_tokens, token_queries)
        table = upload(torch.from_numpy(np.concatenate(parts).astype(np.int64)), device)
        cuts = np.cumsum([0, *(p.size for p in parts)])
        whole_index, own_rows_T, own_index_Tw, state_index_t, local_positions, query_tokens_T, token_queries_T = (
            table[a:b] for a, b in zip(cuts[:-1], cuts[1:]))
        return LinkedLayout(
            root_tokens=packed.cu_seqlens_host[r],
            roots=PackedBatch.from_lengths(packed.lengths[:r], device=device),
            rest=PackedBatch.from_lengths(packed.lengths[r:], device=device),
            state_index=state_index_t,
            parents=links.parents,
            parent_bounds=parent_bounds,
            whole=PackedBatch.from_lengths(whole_lengths, device=device),
            whole_index_Tw=whole_index,
            own_rows_T=own_rows_T,
            own_index_Tw=own_index_Tw,
            local_positions=local_positions,
            queries=PackedBatch.from_lengths(query_lengths, device=device),
            query_tokens_T=query_tokens_T,
            token_queries_T=token_queries_T,
        )

    def on_whole_sequences(self, fn, *xs_T: torch.Tensor) -> torch.Tensor:
        """``fn(*xs_Tw, whole)`` with every ``x_T`` read at ``whole``'s tokens, its output (a tensor
        or a tuple of them) read back at the row's own tokens: a kernel whose numbers depend on a
        sequence's length (attention, the narrow gate products) computes every row token exactly
        as for the unshared sequences."""
        out = fn(*(x.index_select(0, self.whole_index_Tw) for x in xs_T), self.whole)
        if isinstance(out, tuple):
            return tuple(o.index_select(0, self.own_rows_T) for o in out)
        return out.index_select(0, self.own_rows_T)

    def on_own_queries(self, fn, q_T: torch.Tensor, k_T: torch.Tensor, v_T: torch.Tensor) -> torch.Tensor:
        """``fn(q_Tq, k_Tw, v_Tw, queries, whole)``: every token's query once, as the suffix of its
        sequence of ``whole`` (``queries``), against that whole sequence's keys and values (a
        bottom-right causal kernel), read back in the row's order. Unlike ``on_whole_sequences``
        a parent's queries run once, not once per continuation."""
        k_Tw, v_Tw = (x.index_select(0, self.whole_index_Tw) for x in (k_T, v_T))
        out = fn(q_T.index_select(0, self.query_tokens_T), k_Tw, v_Tw, self.queries, self.whole)
        return out.index_select(0, self.token_queries_T)

    def conv_windows(self, width: int) -> "ConvWindows":
        """How to recompute the first ``width - 1`` conv outputs of every continuation from its
        parent's last inputs (cached per width)."""
        cache = self._conv_cache
        if width not in cache:
            gather, lengths, out_rows, in_rows = [], [], [], []
            offsets = self.rest.cu_seqlens_host
            for i, parent in enumerate(self.parent_bounds[self.roots.num_segments :]):
                if parent is None:
                    continue
                start = self.root_tokens + offsets[i]
                own = min(width - 1, offsets[i + 1] - offsets[i])
                tail = min(width - 1, parent[1] - parent[0])
                base = len(gather)
                gather += list(range(parent[1] - tail, parent[1])) + list(range(start, start + own))
                lengths.append(tail + own)
                out_rows += range(start, start + own)
                in_rows += range(base + tail, base + tail + own)
            device = self.state_index.device
            as_index = lambda rows: upload(torch.tensor(rows, dtype=torch.long), device)  # noqa: E731
            cache[width] = ConvWindows(
                as_index(gather), PackedBatch.from_lengths(lengths, device=device), as_index(out_rows), as_index(in_rows)
            )
        return cache[width]

    @cached_property
    def _conv_cache(self) -> dict:
        return {}

    def state_chunks(self, size: int) -> "StateChunks":
        """How a recurrence computed in chunks of ``size`` tokens from each segment's start runs
        this row as its unshared sequences would (cached per size; ``StateChunks``)."""
        cache = self._chunk_cache
        if size not in cache:
            cache[size] = StateChunks.of(self, size)
        return cache[size]

    @cached_property
    def _chunk_cache(self) -> dict:
        return {}


@dataclass(frozen=True)
class StateChunks:
    """A linked row for a chunked recurrence (fla's delta rule), whose arithmetic follows where
    its ``size``-token chunks fall: an unshared sequence's chunks start at multiples of ``size``,
    so a parent that ends off a chunk boundary (its tail, ``length % size`` tokens) cannot hand
    its final state on as it is. Each root runs cut at its last chunk boundary, and the chunk that
    straddles the parent's end runs per continuation (its head: the parent's tail, then the
    continuation's first ``size - tail`` tokens) from the state at that boundary. The rest of
    the continuation starts from the head's final state, on a chunk boundary again. A
    continuation's head outputs come from its head; the parent's tail outputs from its first
    continuation's (a chunk's row depends only on the rows before it, so every continuation
    computes the tail alike: tests/gpu/test_prefix_sharing_gpu.py).

    Attributes:
        roots: the root segments, each cut as ``[aligned part, tail]`` (the tail where there is one).
        root_states: int64 ``[roots]``: per root, the row of ``roots``' final states at its last
            chunk boundary; one past them (a zero state) for a root shorter than a chunk.
        heads: the heads as a row of their own, or None where every parent ends on a boundary
            (then ``roots``, ``rest`` and ``rest_states`` are the plain linked layout's, and the
            fields about heads and ``root_states`` are None).
        head_rows: int64 ``[Th]``: the row's tokens that make up ``heads``.
        head_states: int64 ``[heads]``: the root whose boundary state each head starts from.
        rest: the non-root segments, a continuation with a head cut after it (that first piece's
            outputs are replaced by the head's).
        rest_states: int64 ``[segments of rest]``: each one's initial state among the roots' boundary
            states, then the heads' final states, then a zero state.
        out_rows, in_rows: int64: copy the heads' output rows ``in_rows`` onto row tokens ``out_rows``.
    """

    roots: PackedBatch
    root_states: torch.Tensor | None
    heads: PackedBatch | None
    head_rows: torch.Tensor | None
    head_states: torch.Tensor | None
    rest: PackedBatch
    rest_states: torch.Tensor
    out_rows: torch.Tensor | None
    in_rows: torch.Tensor | None

    @staticmethod
    def of(layout: "LinkedLayout", size: int) -> "StateChunks":
        root_lengths = layout.roots.lengths
        r, device = len(root_lengths), layout.state_index.device
        continued = layout.parents[r:]
        parents = set(continued)
        tails = [n % size if i in parents else 0 for i, n in enumerate(root_lengths)]  # a loose sequence runs whole
        if not any(tails):
            return StateChunks(layout.roots, None, None, None, None, layout.rest, layout.state_index, None, None)
        cut, root_states = [], []
        for n, tail in zip(root_lengths, tails):
            root_states.append(len(cut) if n - tail else -1)
            cut += [m for m in (n - tail, tail) if m]
        root_states = [len(cut) if s < 0 else s for s in root_states]  # -1: the zero state past them
        rest_offsets = layout.rest.cu_seqlens_host
        root_offsets = layout.roots.cu_seqlens_host
        head_rows, head_states, head_lengths, rest_lengths, rest_states = [], [], [], [], []
        out_rows, in_rows, tail_done = [], [], set()
        zero = r + sum(1 for p in continued if p >= 0 and tails[p])  # one past the heads' final states
        for i, p in enumerate(continued):
            n = layout.rest.lengths[i]
            if p < 0 or not tails[p]:
                rest_lengths.append(n)
                rest_states.append(p if p >= 0 else zero)
                continue
            tail, start = tails[p], layout.root_tokens + rest_offsets[i]
            own = min(size - tail, n)
            base = len(head_rows)
            head_rows += range(root_offsets[p + 1] - tail, root_offsets[p + 1])
            head_rows += range(start, start + own)
            head_lengths.append(tail + own)
            head_states.append(p)
            out_rows += range(start, start + own)
            in_rows += range(base + tail, base + tail + own)
            if p not in tail_done:  # the parent's tail outputs, from its first continuation's head
                tail_done.add(p)
                out_rows += range(root_offsets[p + 1] - tail, root_offsets[p + 1])
                in_rows += range(base, base + tail)
            rest_lengths.append(own)
            rest_states.append(zero)  # replaced by the head's outputs
            if n > own:
                rest_lengths.append(n - own)
                rest_states.append(r + len(head_lengths) - 1)  # this head's final state
        as_index = lambda rows: upload(torch.tensor(rows, dtype=torch.long), device)  # noqa: E731
        return StateChunks(
            roots=PackedBatch.from_lengths(cut, device=device),
            root_states=as_index(root_states),
            heads=PackedBatch.from_lengths(head_lengths, device=device),
            head_rows=as_index(head_rows),
            head_states=as_index(head_states),
            rest=PackedBatch.from_lengths(rest_lengths, device=device),
            rest_states=as_index(rest_states),
            out_rows=as_index(out_rows),
            in_rows=as_index(in_rows),
        )


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
