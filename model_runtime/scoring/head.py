"""Log-probability / entropy head, computed in token chunks so full logits never exist.

Legend: N = scored positions, D = hidden size, V = vocabulary, C = tokens in one chunk,
K = top-k width.

For every scored position, from the logits ``z = h @ W^T``: the tempered log-softmax
``log p = d - logsumexp(d)`` with ``d = (z - max z) / temperature`` in float32 (finite at every
temperature; log 0 is reported as ``LOGP_FLOOR``, see kernels/logprob_head.py),
``logprob = log p[target]``, ``entropy = -sum(p * log p)`` and optionally the top-k ids with their
``log p``. Only one ``[C, V]`` chunk (plus its probabilities) is alive at a time.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runtime.kernels.logprob_head import entropy_of, tempered_log_softmax
from model_runtime.types import MAX_TOP_K

log = logging.getLogger(__name__)

# Bytes per (token, vocab) entry alive at a chunk's peak, measured in tests/unit/test_head.py:
# float32 log-probs (4), a temporary of logsumexp or top-k (4), float32 probabilities (4), and
# the matmul output in the compute dtype before its float32 copy (up to 4).
BYTES_PER_LOGIT = 16


@dataclass
class HeadOutput:
    logprobs_N: torch.Tensor  # float32
    entropy_N: torch.Tensor  # float32
    top_k_ids_NK: torch.Tensor | None  # int64
    top_k_logprobs_NK: torch.Tensor | None  # float32


# Matrix products see a multiple of this many rows: a CPU GEMM computes a row the same way
# whatever the other rows are once the row count is a multiple of 16 (fewer rows take other code
# paths), which keeps a sequence's numbers independent of its neighbours.
ROW_MULTIPLE = 16
# cuBLAS picks a product's kernel from its shape, and below a few hundred rows it picks kernels
# that sum K in another order (split-K), so a short row alone would round differently from the
# same tokens in a long row. On the H200 every linear shape of the 9B and 35B-A3B computes its rows
# as the longest rows do from 592 rows on (probed every 16 rows to 8,192, every 256 beyond; the
# 9B's MLP down product returns to another kernel at 576-591 rows; bench/product_steps.py).
CUDA_MIN_ROW_TOKENS = 640


def min_row_tokens(device: torch.device | str, shards: int = 1) -> int:
    """The fewest tokens a row (each of its ``shards`` under sequence parallelism) runs on ``device``."""
    return CUDA_MIN_ROW_TOKENS * shards if torch.device(device).type == "cuda" else 0

# How far a sequence's float32 numbers may move on the CPU when it is packed with others instead
# of scored alone (README.md: within 1e-6 in float32 on the CPU; on GPUs, bit for bit). Not 0 because MKL and
# oneDNN pick their GEMM kernel, and so a row's summation order, from the whole product's shape on
# CPUs with AVX-512 / AMX (differences of about 5e-7 there), however rows are padded.
CPU_PACKED_TOLERANCE = 1e-6


def top_k_ranked(logp_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, ids)`` ``[R, k]`` of each row's k most likely tokens, most likely first and
    equal log-probs by lowest id first, whatever k, the row count or the device.

    ``torch.topk`` alone breaks ties by its algorithm, which changes with k (a request ranked
    beside one asking for more got other ids for equal values) and with the device. The work is
    two steps, so that a head ranking many small blocks of rows orders them all at once:
    ``top_k_pick`` takes the right k values of each row, ``order_top_k`` puts them in order."""
    return order_top_k(*top_k_pick(logp_RV, k))


def top_k_pick(logp_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k values of ``top_k_ranked``, in an order ``order_top_k`` completes. On CUDA
    ``torch.topk`` picks every value above the k-th, then the values equal to it in id order:
    only their order is left to fix. Where that is not what the installed torch does (checked
    once per device and vocabulary size), and on the CPU, every value is ranked as a unique key
    (``_top_k_by_keys``, already in order)."""
    if logp_RV.is_cuda and _cuda_topk_takes_ties_in_id_order(logp_RV.device, logp_RV.shape[1]):
        values, ids = logp_RV.topk(k, dim=-1)
        return values.float(), ids
    return _top_k_by_keys(logp_RV, k)


def order_top_k(values_RK: torch.Tensor, ids_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Picked values most likely first, equal ones by lowest id: a sort by id, then a stable one by value."""
    ids_RK, by_id = ids_RK.sort(dim=-1)
    values_RK, by_value = values_RK.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values_RK, ids_RK.gather(1, by_value)


def _top_k_by_keys(logp_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every value becomes a unique int64 key, its float32 order in the high half and
    ``V - 1 - id`` in the low half, so ``topk`` of the keys has no ties; the log-probs are read
    back by id. A quarter of the rows at a time: the keys and their temporaries (16 bytes a value)
    then add 4 bytes per value of ``logp_RV``, within the head's ``BYTES_PER_LOGIT``."""
    R, V = logp_RV.shape
    ids_RK = torch.empty(R, k, dtype=torch.long, device=logp_RV.device)
    low = torch.arange(V - 1, -1, -1, dtype=torch.long, device=logp_RV.device)
    step = max(1, -(-R // 4))
    for a in range(0, R, step):
        block = logp_RV[a : a + step].float() + 0.0  # a copy, and -0.0 -> +0.0: one key per value
        bits = block.view(torch.int32)
        flip = bits >> 31
        flip &= 0x7FFFFFFF
        bits ^= flip  # as signed integers, now in the floats' order (there is no NaN)
        del flip
        keys = bits.to(torch.long)
        del block, bits
        keys <<= 32
        keys |= low
        ids_RK[a : a + step] = (V - 1) - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)
        del keys
    return logp_RV.gather(1, ids_RK).float(), ids_RK


@functools.cache
def _cuda_topk_takes_ties_in_id_order(device: torch.device, vocab: int) -> bool:
    """Whether ``torch.topk`` then a stable sort gives ``_top_k_by_keys``' ranking here: rows of
    few distinct values (ties everywhere), several row counts and k (the kernel changes with them)."""
    g = torch.Generator(device=device).manual_seed(0)
    for rows in (1, 7, 64):
        logp = -torch.randint(0, 6, (rows, vocab), generator=g, device=device).float()
        for k in (1, 5, 20):
            fast = order_top_k(*logp.topk(k, dim=-1))
            if not torch.equal(fast[1], _top_k_by_keys(logp, k)[1]):
                log.warning("torch.topk on %s does not take tied values in id order (rows %d, k %d): the head "
                            "ranks top-k by unique keys, which is slower", device, rows, k)
                return False
    return True


def top_k_ranked_reference(logp_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reference of ``top_k_ranked``: a stable sort keeps equal values in id order."""
    values, ids = torch.sort(logp_RV.float(), dim=-1, descending=True, stable=True)
    return values[:, :k].contiguous(), ids[:, :k].contiguous()


def _pad_rows(x_ND: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x_ND.shape[0]) % multiple
    return x_ND if pad == 0 else torch.cat([x_ND, x_ND.new_zeros(pad, x_ND.shape[1])])


def chunk_tokens_for_budget(vocab_size: int, budget_bytes: int, bytes_per_logit: int = BYTES_PER_LOGIT) -> int:
    """How many positions one chunk may hold so that its logits stay within ``budget_bytes``."""
    return max(1, int(budget_bytes) // (vocab_size * bytes_per_logit))


def fused_chunk_tokens(vocab_size: int, hidden_size: int, budget_bytes: int, itemsize: int = 2, multiple: int = 64) -> int:
    """Chunk size for the fused head: logits and gathered hidden states of a chunk, both in the
    compute dtype, within ``budget_bytes``; rounded down to ``multiple`` for the matmul."""
    per_token = (vocab_size + hidden_size) * itemsize
    tokens = int(budget_bytes) // per_token
    return max(1, tokens - tokens % multiple if tokens >= multiple else tokens)


def _check(hidden_ND, weight_VD, targets_N, temperature_N, top_k, n_positions: int | None = None):
    if hidden_ND.dim() != 2 or weight_VD.dim() != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"head expects hidden [N, D] and weight [V, D], got {tuple(hidden_ND.shape)}, {tuple(weight_VD.shape)}")
    n = hidden_ND.shape[0] if n_positions is None else n_positions
    if targets_N.shape != (n,) or temperature_N.shape != (n,):
        raise ValueError(f"targets and temperature must be [N={n}], got {tuple(targets_N.shape)}, {tuple(temperature_N.shape)}")
    if not 0 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {top_k}")


@torch.inference_mode()
def score_positions(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    temperature_N: torch.Tensor,
    *,
    top_k: int = 0,
    chunk_tokens: int = 1024,
    rows_N: torch.Tensor | None = None,
    logprob_fn=None,
    fixed_shape: bool | None = None,
    top_k_rows: int | None = None,
) -> HeadOutput:
    """Chunked head. ``temperature_N`` is per position (a row may mix requests).

    With ``rows_N`` (int64 ``[N]``), ``hidden_ND`` is the whole row ``[T, D]`` and position ``i``
    reads row ``rows_N[i]``. ``logprob_fn`` is a ``head`` kernel (see ``model_runtime.kernels``);
    without one the plain PyTorch path computes everything. With a ``logprob_fn`` and ``top_k``,
    the log-probs and entropy still come from it, and the ranking runs on float32 log-probs of
    the same logits ``top_k_rows`` positions at a time (default: the chunk): a position's
    numbers do not depend on whether a neighbour asked for top-k.

    With ``fixed_shape`` (the default on CUDA) every chunk's product has exactly ``chunk_tokens``
    rows (the last one is zero-padded): cuBLAS picks its kernel, and so a row's summation order,
    from the product's shape, and a position's logits must not depend on how many other
    positions share its chunk. The padding costs at most one chunk per row. Without it chunks
    are padded to a multiple of ``ROW_MULTIPLE``, which is enough on the CPU.
    """
    if rows_N is not None and rows_N.shape != targets_N.shape:
        raise ValueError(f"rows must be [N={targets_N.shape[0]}] like the targets, got {tuple(rows_N.shape)}")
    n_hidden = hidden_ND.shape[0] if rows_N is None else targets_N.shape[0]
    _check(hidden_ND, weight_VD, targets_N, temperature_N, top_k, n_hidden)
    N = targets_N.shape[0]
    dev = hidden_ND.device
    if fixed_shape is None:
        fixed_shape = dev.type == "cuda"
    logprobs = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    top_ids = torch.empty(N, top_k, dtype=torch.long, device=dev) if top_k else None
    top_logp = torch.empty(N, top_k, dtype=torch.float32, device=dev) if top_k else None
    temperature_N = temperature_N.to(device=dev, dtype=torch.float32)
    targets_N = targets_N.to(device=dev, dtype=torch.long)
    if rows_N is not None:
        rows_N = rows_N.to(device=dev, dtype=torch.long)
    for start in range(0, N, max(1, chunk_tokens)):
        end = min(N, start + chunk_tokens)
        h_CD = hidden_ND[start:end] if rows_N is None else hidden_ND.index_select(0, rows_N[start:end])
        # F.linear reads W as [V, D] in place; `h @ W.t()` can copy the whole weight per chunk on CPU.
        padded_CD = _pad_rows(h_CD, chunk_tokens) if fixed_shape else _pad_rows(h_CD, ROW_MULTIPLE)
        z_CV = F.linear(padded_CD, weight_VD)[: end - start]
        del padded_CD, h_CD
        if logprob_fn is not None:
            logprobs[start:end], entropy[start:end] = logprob_fn(z_CV, targets_N[start:end], temperature_N[start:end])
            if top_k:  # ranked apart, a few positions' float32 log-probs at a time
                step = max(1, top_k_rows or chunk_tokens)
                for a in range(start, end, step):
                    b = min(end, a + step)
                    logp_RV = tempered_log_softmax(z_CV[a - start : b - start], temperature_N[a:b])
                    top_logp[a:b], top_ids[a:b] = top_k_pick(logp_RV, top_k)
                    del logp_RV
            # Released before the next chunk's product, or two chunks of logits would coexist.
            del z_CV
            continue
        logp_CV = tempered_log_softmax(z_CV, temperature_N[start:end])
        del z_CV
        logprobs[start:end] = logp_CV.gather(1, targets_N[start:end, None])[:, 0]
        if top_k:
            top_logp[start:end], top_ids[start:end] = top_k_pick(logp_CV, top_k)
        entropy[start:end] = entropy_of(logp_CV)
        del logp_CV
    if top_k:  # every position's picks put in order at once, not one small sort per block
        top_logp, top_ids = order_top_k(top_logp, top_ids)
    return HeadOutput(logprobs, entropy, top_ids, top_logp)


@torch.inference_mode()
def score_positions_reference(hidden_ND, weight_VD, targets_N, temperature_N, *, top_k: int = 0) -> HeadOutput:
    """Plain unchunked reference: full float32 logits and ``log_softmax``."""
    _check(hidden_ND, weight_VD, targets_N, temperature_N, top_k)
    logits = (hidden_ND.float() @ weight_VD.float().t()) / temperature_N.float()[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    out = HeadOutput(
        logp.gather(1, targets_N.long()[:, None])[:, 0],
        -(logp.exp() * logp).sum(-1),
        None,
        None,
    )
    if top_k:
        out.top_k_logprobs_NK, out.top_k_ids_NK = top_k_ranked_reference(logp, top_k)
    return out
