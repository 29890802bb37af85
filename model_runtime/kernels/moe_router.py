"""The sparse-MoE router's top-k: ``torch.topk`` over each token's expert probabilities, bit for bit.

Legend: T = tokens, E = experts, K = experts per token, C = candidates per token.

Backends share one signature, ``fn(probs_TE, k) -> (values_TK, ids_TK)``, and return what
``torch.topk(probs_TE, k, dim=-1)`` returns on the device, ties included (Hugging Face's router
calls it):

- ``topk``: ``torch.topk`` itself (the reference; any device).
- ``candidates`` (CUDA, Triton; opt-in until timed on a GPU): one Triton pass keeps each token's
  C = max(16, 2K) largest probabilities, ties broken towards the lower expert, written in expert
  order; ``torch.topk`` then runs over those C instead of all E (256 for Qwen3.5-MoE), which is
  most of its cost. The answer is the same because of how ``torch.topk`` works on CUDA: it finds
  the k-th value by a radix select, gathers the values above it and then the values equal to it,
  each in index order, the equal ones only until k are taken, and sorts those k in place by value
  with a fixed network that reads nothing but their values and their order. The candidates hold
  every value above the k-th and the lowest-indexed values equal to it, in the same relative
  order, so the same k values enter the sort in the same order, and their expert ids are read
  back through the candidates' ids.
"""

from __future__ import annotations

import torch

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

ROWS_PER_PROGRAM, WARPS = 8, 4


def top_k_torch(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs_TE, k, dim=-1)``."""
    return torch.topk(probs_TE, k, dim=-1)


def candidates_for(k: int) -> int:
    """How many candidates a token keeps for a top-``k``: a power of two, at least 16 and 2k."""
    return max(16, 1 << (2 * k - 1).bit_length())


if triton is not None:
    @triton.jit
    def _candidates_kernel(p_ptr, vals_ptr, ids_ptr, T, stride_p, E: tl.constexpr, C: tl.constexpr,
                           BLOCK_T: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = rows < T
        cols = tl.arange(0, E)
        p = tl.load(p_ptr + rows[:, None] * stride_p + cols[None, :], mask=ok[:, None], other=0.0)
        # The C-th largest value, ties counted: take the largest left, all its copies, until C are taken.
        work = p
        taken = tl.zeros([BLOCK_T], dtype=tl.int32)
        cut = tl.zeros([BLOCK_T], dtype=tl.float32)
        for _ in tl.static_range(C):
            m = tl.max(work, axis=1)
            at_m = work == m[:, None]
            more = taken < C
            cut = tl.where(more, m, cut)
            taken = taken + tl.where(more, tl.sum(at_m.to(tl.int32), axis=1), 0)
            work = tl.where(at_m, -1.0, work)  # below every probability
        above = p > cut[:, None]
        at_cut = p == cut[:, None]
        room = C - tl.sum(above.to(tl.int32), axis=1)  # how many of the values equal to the cut fit
        keep = above | (at_cut & (tl.cumsum(at_cut.to(tl.int32), axis=1) <= room[:, None]))
        slot = tl.cumsum(keep.to(tl.int32), axis=1) - 1  # expert order
        where = rows[:, None] * C + slot
        stored = keep & ok[:, None]
        tl.store(vals_ptr + where, p, mask=stored)
        tl.store(ids_ptr + where, tl.broadcast_to(cols[None, :].to(tl.int64), (BLOCK_T, E)), mask=stored)


def top_candidates(probs_TE: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values_TC, ids_TC)``: each token's ``c`` largest probabilities (ties: the lower expert
    first), in expert order. Float32 ``[T, E]`` with E a power of two above ``c``."""
    if triton is None:
        raise RuntimeError("the candidates router needs triton")
    T, E = probs_TE.shape
    if probs_TE.dtype != torch.float32 or probs_TE.stride(1) != 1 or E & (E - 1) or E <= c:
        raise ValueError(f"top_candidates takes float32 [T, E] probabilities, unit column stride, E a power of two "
                         f"above c={c}; got {tuple(probs_TE.shape)} {probs_TE.dtype} strides {probs_TE.stride()}")
    values_TC = probs_TE.new_empty(T, c)
    ids_TC = torch.empty(T, c, dtype=torch.int64, device=probs_TE.device)
    if T:
        _candidates_kernel[(triton.cdiv(T, ROWS_PER_PROGRAM),)](
            probs_TE, values_TC, ids_TC, T, probs_TE.stride(0), E=E, C=c, BLOCK_T=ROWS_PER_PROGRAM, num_warps=WARPS)
    return values_TC, ids_TC


def top_k_candidates(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs_TE, k, dim=-1)`` through ``top_candidates`` (see the module docstring);
    ``torch.topk`` itself where the candidates would not be fewer than the experts."""
    T, E = probs_TE.shape
    c = candidates_for(k)
    if E <= c or E & (E - 1):
        return torch.topk(probs_TE, k, dim=-1)
    values_TC, ids_TC = top_candidates(probs_TE, c)
    values_TK, slots_TK = torch.topk(values_TC, k, dim=-1)
    return values_TK, ids_TC.gather(1, slots_TK)
