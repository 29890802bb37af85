"""The sparse-MoE router's top-k: ``torch.topk`` over each token's expert probabilities, bit for bit.

Legend: T = tokens, E = experts, K = experts per token.

Backends share one signature, ``fn(probs_TE, k) -> (values_TK, ids_TK)``, and return what
``torch.topk(probs_TE, k, dim=-1)`` returns on the device, ties included (Hugging Face's router
calls it):

- ``topk``: ``torch.topk`` itself (the reference; any device).
- ``select`` (CUDA, Triton): ``torch.topk``'s own two steps, the first in one Triton pass.
  ``torch.topk`` on CUDA (one block per row, ``sbtopk``) finds the k-th largest value, gathers
  the values above it and then the values equal to it, each group in index order, the equal
  ones only until k are taken, and then sorts those k in place (``sortKeyValueInplace``, a
  bitonic network for k <= 32 whose swaps read the values and their positions only, never the
  ids that travel with them). The Triton pass writes exactly that gathered list; ``torch.sort``
  (not stable) of it runs the same in-place network, since for a row of at most 4096 it fills the
  indices with 0..k-1 and calls the same function; the ids are then read through its
  permutation. The radix select over all E experts (256 for Qwen3.5-MoE) is most of
  ``torch.topk``'s time; the pass keeps a token's row in registers. Because the argument rests
  on how this torch implements ``topk``, the first call for each (device, E, k) checks the two
  against each other on rows with many ties and, should they differ, keeps ``torch.topk``.

Probabilities are taken to be free of NaN (a softmax of finite logits), which ``torch.topk``
would rank above every number.
"""

from __future__ import annotations

import logging

import torch

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

log = logging.getLogger(__name__)

ROWS_PER_PROGRAM, WARPS = 8, 4


def top_k_torch(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs_TE, k, dim=-1)``."""
    return torch.topk(probs_TE, k, dim=-1)


if triton is not None:
    @triton.jit
    def _gathered_top_k_kernel(p_ptr, vals_ptr, ids_ptr, T, stride_p, E: tl.constexpr, K: tl.constexpr,
                               BLOCK_T: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = rows < T
        cols = tl.arange(0, E)
        p = tl.load(p_ptr + rows[:, None] * stride_p + cols[None, :], mask=ok[:, None], other=0.0)
        # The k-th largest value, ties counted: take the largest left with all its copies, k times.
        work = p
        taken = tl.zeros([BLOCK_T], dtype=tl.int32)
        kth = tl.zeros([BLOCK_T], dtype=tl.float32)
        for _ in tl.static_range(K):
            m = tl.max(work, axis=1)
            at_m = work == m[:, None]
            more = taken < K
            kth = tl.where(more, m, kth)
            taken = taken + tl.where(more, tl.sum(at_m.to(tl.int32), axis=1), 0)
            work = tl.where(at_m, -1.0, work)  # below every probability
        # torch.topk's gather: the values above the k-th in index order, then those equal to it
        # in index order until k are taken.
        above = p > kth[:, None]
        equal = p == kth[:, None]
        n_above = tl.sum(above.to(tl.int32), axis=1)
        slot_above = tl.cumsum(above.to(tl.int32), axis=1) - 1
        slot_equal = n_above[:, None] + tl.cumsum(equal.to(tl.int32), axis=1) - 1
        slot = tl.where(above, slot_above, slot_equal)
        stored = (above | (equal & (slot_equal < K))) & ok[:, None]
        where = rows[:, None] * K + slot
        tl.store(vals_ptr + where, p, mask=stored)
        tl.store(ids_ptr + where, tl.broadcast_to(cols[None, :].to(tl.int64), (BLOCK_T, E)), mask=stored)


def gathered_top_k(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values_TK, ids_TK)`` as ``torch.topk`` gathers them before its sort: each token's values
    above its k-th largest in expert order, then the values equal to it in expert order until k.
    Float32 ``[T, E]``, E a power of two above k."""
    if triton is None:
        raise RuntimeError("the select router needs triton")
    T, E = probs_TE.shape
    if probs_TE.dtype != torch.float32 or probs_TE.stride(1) != 1 or E & (E - 1) or E <= k:
        raise ValueError(f"gathered_top_k takes float32 [T, E] probabilities, unit column stride, E a power of two "
                         f"above k={k}; got {tuple(probs_TE.shape)} {probs_TE.dtype} strides {probs_TE.stride()}")
    values_TK = probs_TE.new_empty(T, k)
    ids_TK = torch.empty(T, k, dtype=torch.int64, device=probs_TE.device)
    if T:
        _gathered_top_k_kernel[(triton.cdiv(T, ROWS_PER_PROGRAM),)](
            probs_TE, values_TK, ids_TK, T, probs_TE.stride(0), E=E, K=k, BLOCK_T=ROWS_PER_PROGRAM, num_warps=WARPS)
    return values_TK, ids_TK


# torch.sort sorts a row in place by the bitonic network up to this length (unstable sort).
IN_PLACE_SORT_MAX = 32


def top_k_select(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(probs_TE, k, dim=-1)`` as the gathered list sorted by ``torch.sort`` (see the
    module docstring); ``torch.topk`` itself where the shapes fall outside that argument, or where
    this torch's ``topk`` was found to answer otherwise (``agrees_with_torch_topk``)."""
    T, E = probs_TE.shape
    if E <= k or E & (E - 1) or k > IN_PLACE_SORT_MAX or probs_TE.dtype != torch.float32:
        return torch.topk(probs_TE, k, dim=-1)
    if not agrees_with_torch_topk(probs_TE.device, E, k):
        return torch.topk(probs_TE, k, dim=-1)
    return select_top_k(probs_TE, k)


def select_top_k(probs_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The select path itself: ``gathered_top_k``, then ``torch.sort`` and the ids through its
    permutation (float32 ``[T, E]``, E a power of two above k, k <= 32)."""
    values_TK, ids_TK = gathered_top_k(probs_TE.contiguous(), k)
    if k == 1:
        return values_TK, ids_TK
    values_TK, perm_TK = torch.sort(values_TK, dim=-1, descending=True, stable=False)
    return values_TK, ids_TK.gather(1, perm_TK)


_AGREES: dict[tuple, bool] = {}
CHECK_ROWS = 4096


def agrees_with_torch_topk(device: torch.device, experts: int, k: int) -> bool:
    """Whether ``select_top_k`` returns what this torch's CUDA ``topk`` returns, checked once per
    (device, experts, k) on rows with many ties (the argument in the module docstring rests on how
    ``topk`` is implemented, which a torch release may change); on a mismatch a warning, and
    ``top_k_select`` uses ``torch.topk``. Not checked off CUDA (the interpreter tests), where
    ``topk`` orders ties its own way."""
    key = (torch.device(device), experts, k)
    if key not in _AGREES:
        if key[0].type != "cuda":
            _AGREES[key] = True
        else:
            g = torch.Generator(device=device).manual_seed(experts + k)
            logits = torch.round(torch.randn(CHECK_ROWS, experts, device=device, generator=g) * 2)  # few values: ties
            probs = torch.softmax(logits.bfloat16(), dim=-1, dtype=torch.float32)
            want_values, want_ids = torch.topk(probs, k, dim=-1)
            values, ids = select_top_k(probs, k)
            _AGREES[key] = bool(torch.equal(values, want_values) and torch.equal(ids, want_ids))
            if not _AGREES[key]:
                log.warning("the select router differs from torch %s's topk for %d experts, k=%d, on rows with ties; "
                            "using torch.topk", torch.__version__, experts, k)
    return _AGREES[key]
