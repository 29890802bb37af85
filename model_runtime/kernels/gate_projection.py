"""The Gated DeltaNet's gate projections (``in_proj_a``/``in_proj_b``, Qwen3-Next's
``in_proj_ba``): the small products whose outputs become the decay and the beta gate.

Legend: T = tokens of the (local) row, D = hidden size, N = the projection's outputs (one per
value head, or two for Qwen3-Next's fused pair).

Both backends compute ``linear(x_TD)``; they differ in how many rows one matrix product sees.
A bf16 product's kernel, and with it its summation order, follows the row count, and for these
narrow products (N = 32 or 64) it changes the rounding of a sequence's rows with the size of the
row it is packed in. The decay is then accumulated over the whole sequence, so those roundings
add up, and a sequence packed with others would part from the same sequence alone
(tests/gpu/test_isolation.py).

- ``row``: one product over the whole row (the plain reference).
- ``segment``: one product per segment, the call a sequence scored alone makes (and Hugging
  Face's for one sequence), so a segment's numbers do not depend on its neighbours.
- ``runs``: ``segment``'s numbers with fewer products. Where a product's rounding was measured
  not to depend on the row count or on a row's place (``uniform_rows``, kept by weight shape in
  the ``RunLimits`` that ``scoring.rounding.prepare_runs`` hands to the layers), consecutive
  segments go through one product of at most that many rows; elsewhere, and before any
  measurement, one product per segment.
- ``tiles``: one product over the whole row whose every row is computed alike whatever the row
  count (``gate_projection_triton``, fixed tiles; on the CPU the row in zero-padded tiles of a
  fixed size). A segment then gets its own product's rows from a product of any rows, so a shared
  prompt rounds alike for every member of a group and every member may share it
  (docs/prefix-sharing.md); but the rounding is the kernel's, not cuBLAS's (Hugging Face's), so
  a sequence moves about as far from Hugging Face one at a time as Hugging Face's own padded
  batches are. Opt-in.

On a row with prefix links (a shared prompt run once) ``narrow_products`` runs them over the
row's unshared sequences (``LinkedLayout.on_whole_sequences``), so a prompt's and a
continuation's rows get the rounding of the sequence scored whole.

``tiles`` needs no layout (``row_invariant``): a linked row's or a shard's products run over its
own tokens.

``segment`` costs two small launches per segment and GDN layer: nothing measurable on rows of
a few dozen long sequences, more on rows of hundreds of short ones (figures in
docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model_runtime.kernels import gate_projection_triton
from model_runtime.kernels.moe_experts import in_row_tiles
from model_runtime.model.packing import PackedBatch


def gate_projection_row(linear: nn.Module, x_TD: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``linear(x_TD)``: one product for the whole row (``bounds`` unused)."""
    return linear(x_TD)


def gate_projection_segment(linear: nn.Module, x_TD: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``linear`` applied to every ``x_TD[start:end]`` of ``bounds`` on its own, concatenated.

    ``bounds`` must tile ``[0, T)`` in order (the row's segments, padding included).
    """
    if len(bounds) <= 1:
        return linear(x_TD)
    _check_cover(bounds, x_TD.shape[0])
    return torch.cat([linear(x_TD[start:end]) for start, end in bounds])


def _weight_and_bias(linear) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A narrow product's weight and bias: an ``nn.Linear``, or ``functools.partial(F.linear, weight=...)``."""
    if isinstance(linear, nn.Linear):
        return linear.weight, linear.bias
    keywords = getattr(linear, "keywords", {})
    return keywords.get("weight"), keywords.get("bias")


def gate_projection_tiles(linear, x_TD: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``linear(x_TD)`` with every row computed alike whatever the row count (``bounds`` unused):
    the Triton kernel of fixed tiles on CUDA, zero-padded tiles of ``TILE_ROWS`` rows elsewhere."""
    weight, bias = _weight_and_bias(linear)
    if x_TD.is_cuda and weight is not None and gate_projection_triton.supports(x_TD, weight):
        return gate_projection_triton.narrow_tiles(x_TD, weight, bias)
    return in_row_tiles(linear, x_TD)


def row_invariant(fn) -> bool:
    """Whether a gate-projection backend computes a row alike in a product of any rows (``tiles``):
    ``narrow_products`` then runs it once over the row as it is, links and shard cuts ignored."""
    return fn is gate_projection_tiles


def _check_cover(bounds: Sequence[tuple[int, int]], tokens: int) -> None:
    if bounds[0][0] != 0 or bounds[-1][1] != tokens:
        raise ValueError(f"segments {bounds[0]}..{bounds[-1]} do not cover the row of {tokens} tokens")


@dataclass(frozen=True)
class RunLimits:
    """How many rows one product of a narrow weight may have and still give every segment in it
    the rows of that segment's own product, by the weight's ``(in_features, out_features, dtype)``
    (``scoring.rounding.prepare_runs`` measures it); a shape not here, 0 or 1: one product per segment."""

    rows: Mapping[tuple[int, int, torch.dtype], int] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "rows", MappingProxyType(dict(self.rows)))

    def __deepcopy__(self, memo) -> "RunLimits":
        return self  # immutable: a copied model (the weight-update tests copy a loaded one) shares its limits

    @staticmethod
    def shape(weight: torch.Tensor) -> tuple[int, int, torch.dtype]:
        return (weight.shape[1], weight.shape[0], weight.dtype)

    def of(self, linear) -> int:
        """The limit for ``linear`` (an ``nn.Linear``, a module with a ``weight``, or
        ``functools.partial(F.linear, weight=...)``)."""
        weight = getattr(linear, "weight", None)
        if weight is None:
            weight = _weight_and_bias(linear)[0]
        return 0 if weight is None else self.rows.get(self.shape(weight), 0)


NO_RUNS = RunLimits()  # nothing measured: every segment its own product


def segment_runs(bounds: Sequence[tuple[int, int]], max_rows: int) -> list[tuple[int, int]]:
    """Consecutive ``bounds`` merged into runs of at most ``max_rows`` rows, in order; a segment
    longer than that is a run of its own (``max_rows`` below 2: every segment alone)."""
    runs: list[tuple[int, int]] = []
    for start, end in bounds:
        if runs and end - runs[-1][0] <= max_rows and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def gate_projection_runs(linear: nn.Module, x_TD: torch.Tensor, bounds: Sequence[tuple[int, int]],
                         limits: RunLimits = NO_RUNS) -> torch.Tensor:
    """``gate_projection_segment``'s numbers from one product per run of segments (``segment_runs``)
    where ``limits`` has a measured limit for ``linear``'s shape; per segment where it has none."""
    if len(bounds) > 1:
        _check_cover(bounds, x_TD.shape[0])
    return gate_projection_segment(linear, x_TD, segment_runs(bounds, limits.of(linear)))


def shard_segments(x_TD: torch.Tensor, packed: PackedBatch, sp) -> tuple[tuple[int, int], ...] | None:
    """Under sequence parallelism ``sp``, the row's segments within this rank's ``x_TD`` tokens;
    None for a whole row (``narrow_products`` then uses the row's own segments and links)."""
    if sp is None:
        return None
    T = x_TD.shape[0]
    return packed.segments_within(sp.rank * T, (sp.rank + 1) * T)


def narrow_products(fn, linears: Sequence, x_TD: torch.Tensor, packed: PackedBatch, local_bounds=None,
                    limits: RunLimits = NO_RUNS) -> tuple:
    """``fn(linear, x_TD, bounds)`` for every linear of ``linears``, ``bounds`` the row's segments,
    or ``local_bounds`` (a sequence-parallel shard's: its segments are cut, so a row with prefix
    links keeps them as they are there). On a whole row with prefix links, every product runs
    over the row's unshared sequences and is read back at the row's own tokens. A row-invariant
    ``fn`` (``tiles``) runs once over ``x_TD`` as it is; ``runs`` reads ``limits``."""
    if row_invariant(fn):
        return tuple(fn(linear, x_TD, ()) for linear in linears)
    if fn is gate_projection_runs:
        fn = functools.partial(gate_projection_runs, limits=limits)
    if local_bounds is not None:
        return tuple(fn(linear, x_TD, local_bounds) for linear in linears)
    if packed.links is None:
        return tuple(fn(linear, x_TD, packed.segment_bounds) for linear in linears)
    return packed.linked.on_whole_sequences(
        lambda x_TwD, whole: tuple(fn(linear, x_TwD, whole.segment_bounds) for linear in linears), x_TD
    )


def order_sensitive_operands(in_features: int, out_features: int, dtype: torch.dtype, device, rows: int,
                             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, w)`` of a ``[rows, in] x [in, out]`` product whose rounded outputs change with almost
    any change of its summation order.

    On random operands two summation orders differ by about a float32 ulp of the partial sums,
    which moves a bf16 output in about one case in a thousand: a kernel change could pass unseen.
    Here the second half of each dot product cancels the first to within 2^-6 (the same terms,
    shuffled, times ``-(1 + 2^-6 r)``), so the output is about 2^-6 of the partial sums and their
    rounding shows in most outputs.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    half = in_features // 2
    u = torch.randn(rows, half, generator=gen, device=device)
    v = torch.randn(out_features, half, generator=gen, device=device) * in_features ** -0.5
    perm = torch.randperm(half, generator=gen, device=device)
    r = torch.rand(out_features, half, generator=gen, device=device) * 2 - 1
    tail = in_features - 2 * half  # an odd in_features: one more column, of zero weight
    x = torch.cat([u, u[:, perm], torch.randn(rows, tail, generator=gen, device=device)], dim=1)
    w = torch.cat([v, -v[:, perm] * (1 + r * 2.0 ** -6), torch.zeros(out_features, tail, device=device)], dim=1)
    return x.to(dtype), w.to(dtype)


def first_changed_rows(operands: Sequence[tuple[torch.Tensor, torch.Tensor]], max_rows: int, product=None) -> np.ndarray:
    """``changed[M]`` for ``M`` up to ``max_rows``: the first row of a ``[M, in] x [in, out]``
    product (``product(x, w)``, default cuBLAS's) that differs from the same row of the product
    over ``M - 1`` rows (``M`` when none does; entries 0 and 1 are ``max_rows + 1``), the least over
    ``operands`` (pairs ``(x, w)`` of at least ``max_rows`` rows). Every row count in one pass, with
    one host sync at the end.
    """
    product = product or F.linear  # looked up at the call (tests stand in for cuBLAS there)
    device = operands[0][0].device
    changed = torch.full((max_rows + 1,), max_rows + 1, dtype=torch.int64, device=device)
    previous = [product(x[:1], w) for x, w in operands]
    for m in range(2, max_rows + 1):
        differs = None
        for j, (x, w) in enumerate(operands):
            y = product(x[:m], w)
            d = (y[: m - 1] != previous[j]).any(dim=1)
            differs = d if differs is None else differs | d
            previous[j] = y
        # argmax finds the first differing row; a row count with none records m
        changed[m] = torch.where(differs.any(), differs.to(torch.int8).argmax(), m)
    return changed.cpu().numpy()


# Kinds kept apart at most: past this many, a further range of row counts is a kind of its own
# (never wrongly alike; only less sharing), which bounds the probe's comparisons.
MAX_KINDS = 256


@torch.inference_mode()
def row_kinds(in_features: int, out_features: int, dtype: torch.dtype, device, max_rows: int,
              seeds: tuple[int, ...] = (0, 1)) -> np.ndarray:
    """``kinds[M]`` for ``M`` up to ``max_rows``: row counts of one kind compute every row they
    have in common alike (entry 0 is entry 1's).

    ``first_changed_rows`` cuts the row counts into ranges within which each count computes the
    rows of one fewer alike; then the largest count of each range is compared, on every common row
    and with ``order_sensitive_operands`` of each seed, with the largest count seen so far of each
    kind found before it. cuBLAS returns to a kernel it used for fewer rows, so most ranges join an
    earlier kind. The BLAS picks its kernel by the operands' shape, dtype and layout, not their
    values; the operands only make a change of summation order visible.
    """
    operands = [order_sensitive_operands(in_features, out_features, dtype, device, max_rows, seed) for seed in seeds]
    changed = first_changed_rows(operands, max_rows)
    starts = [1] + [m for m in range(2, max_rows + 1) if changed[m] < m]
    ends = [s - 1 for s in starts[1:]] + [max_rows]
    kinds = np.zeros(max_rows + 1, dtype=np.int64)
    reps: dict[int, tuple[int, list[torch.Tensor]]] = {}  # per kind kept: its largest row count and those outputs
    order: list[int] = []  # kinds kept, the last matched first (cuBLAS alternates among few kernels)

    def alike(ys: list[torch.Tensor], end: int, kind: int) -> bool:
        rows, rep = reps[kind]
        n = min(rows, end)
        return all(torch.equal(y[:n], r[:n]) for y, r in zip(ys, rep))

    count = 0
    for start, end in zip(starts, ends):
        ys = [F.linear(x[:end], w) for x, w in operands]
        found = next((k for k in order if alike(ys, end, k)), None)
        if found is None:
            found, count = count, count + 1
            if len(reps) >= MAX_KINDS:  # a kind of its own, compared with nothing
                kinds[start:end + 1] = found
                continue
        if end > reps.get(found, (0,))[0]:
            reps[found] = (end, ys)
        if found in order:
            order.remove(found)
        order.insert(0, found)
        kinds[start:end + 1] = found
    kinds[0] = kinds[1] if max_rows >= 1 else 0
    return kinds


def uniform_rows(kinds: np.ndarray) -> int:
    """The most rows ``U`` such that every row count from 1 to ``U`` is of one kind (``row_kinds``)."""
    counts = kinds[1:]
    differ = np.flatnonzero(counts != counts[0]) if counts.size else np.zeros(1, dtype=np.int64)
    return int(differ[0]) if differ.size else int(counts.size)


@torch.inference_mode()
def rows_keep_their_place(in_features: int, out_features: int, dtype: torch.dtype, device, rows: int,
                          trials: int = 24, seed: int = 2) -> bool:
    """Whether a product over any slice of ``rows`` rows gives that slice's rows of the product
    over all of them, bit for bit (on ``order_sensitive_operands``, slices of random and edge
    offsets and lengths). ``row_kinds`` compares slices that start at row 0; a kernel whose
    summation order followed a row's place (a stream-K split, say) would pass it and fail here."""
    x, w = order_sensitive_operands(in_features, out_features, dtype, device, rows, seed)
    whole = F.linear(x, w)
    rng = np.random.default_rng(seed)
    slices = [(0, 1), (rows - 1, rows), (1, rows), (0, rows // 2 or 1)]
    for _ in range(trials):
        n = int(rng.integers(1, rows + 1))
        start = int(rng.integers(0, rows - n + 1))
        slices.append((start, start + n))
    return all(torch.equal(F.linear(x[a:b], w), whole[a:b]) for a, b in slices if b > a)
