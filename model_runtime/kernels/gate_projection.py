"""The Gated DeltaNet's gate projections (``in_proj_a``/``in_proj_b``, Qwen3-Next's
``in_proj_ba``): the small products whose outputs become the decay and the beta gate.

Legend: T = tokens of the (local) row, D = hidden size, N = the projection's outputs (one per
value head, or two for Qwen3-Next's fused pair).

Both backends compute ``linear(x_TD)``; they differ in how many rows one matrix product sees.
A bf16 product's kernel, and with it its summation order, follows the row count, and for these
narrow products (N = 32 or 64) it changes the rounding of a sequence's rows with the size of the
row it is packed in. The decay is then accumulated over the whole sequence, so those roundings
add up: on the H200 this was the first place where a sequence packed with others parted from
the same sequence alone (tests/gpu/test_isolation.py).

- ``row``: one product over the whole row (the plain reference).
- ``segment``: one product per segment, the call a sequence scored alone makes (and Hugging
  Face's for one sequence), so a segment's numbers do not depend on its neighbours.

Measured on the H200 (2026-11-29, 9B shape): with ``segment`` a sequence alone and packed gave
bit-for-bit equal log-probs (``row``: 6.0e-3 mean apart), at no measurable cost on the benchmark
workload (36,201 against 36,231 tokens/s; rows of about 20 sequences of 3k tokens). It costs two
small launches per segment and GDN layer, so rows of hundreds of short sequences pay more; that
case is not measured yet.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def gate_projection_row(linear: nn.Module, x_TD: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``linear(x_TD)``: one product for the whole row (``bounds`` unused)."""
    return linear(x_TD)


def gate_projection_segment(linear: nn.Module, x_TD: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``linear`` applied to every ``x_TD[start:end]`` of ``bounds`` on its own, concatenated.

    ``bounds`` must tile ``[0, T)`` in order (the row's segments, padding included).
    """
    if len(bounds) <= 1:
        return linear(x_TD)
    if bounds[0][0] != 0 or bounds[-1][1] != x_TD.shape[0]:
        raise ValueError(f"segments {bounds[0]}..{bounds[-1]} do not cover the row of {x_TD.shape[0]} tokens")
    return torch.cat([linear(x_TD[start:end]) for start, end in bounds])
