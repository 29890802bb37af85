"""Log-probability and entropy of one chunk of logits, without a float32 copy of the chunk.

Legend: C = positions in the chunk, V = vocabulary.

Backends share one signature: ``fn(z_CV, targets_C, temperature_C) -> (logp_C, entropy_C)``
where ``z_CV`` are raw logits (any float dtype). Both work in float32 on the shifted, tempered
logits ``d = (z - max z) / T <= 0``: ``log p = d - log sum exp d`` and
``entropy = log sum exp d - sum softmax(d) * d``. Shifting before dividing keeps every
temperature the API allows (any finite T > 0) finite: ``z / T`` overflows for tiny T, ``d``
only underflows to probabilities of 0. A log-probability below float32's range (a token that is
not the arg-max at an extreme temperature) is reported as ``LOGP_FLOOR``, the lowest float32,
so that JSON can carry it; temperatures below float32's smallest normal count as that.

Every sum over the vocabulary in the ``torch`` backend runs in one fixed order
(``fixed_order_row_sum_``), so a position's numbers do not depend on the other positions of its
chunk: BLAS and PyTorch's reductions choose their summation order from the tensor's shape and
the thread count (a chunk of one row can take another path and move the entropy by 1e-5).

The ``triton`` backend reads each logit once: one program per position streams the row in
blocks of ``LANES`` runs of ``RUN`` adjacent logits. Each lane (one run, held by one thread) keeps
a running (max, sum of exp d, sum of exp d * d): per block it takes its run's max, rescales its
two sums once if the max grew (the online softmax), then adds each logit's exp once. Per logit
that is one exp and, at temperature 1, five float32 operations; the rescale's exp is paid once a
run. The ``torch`` backend is the plain float32 computation it must match.
"""

from __future__ import annotations

import torch

LOGP_FLOOR = torch.finfo(torch.float32).min  # log 0, as the lowest finite float32
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
MAX_TEMPERATURE = torch.finfo(torch.float32).max


def temperature32(temperature_C: torch.Tensor) -> torch.Tensor:
    """Temperatures in float32, within its finite normal range: one that underflows it counts as
    its smallest normal, one that overflows it (T > 3.4e38, which gives a uniform distribution
    anyway) as its largest finite value, never as inf (whose ``(z - max) / T`` is inf / inf =
    NaN in the fused kernel's masked columns)."""
    return temperature_C.to(torch.float32).clamp(MIN_TEMPERATURE, MAX_TEMPERATURE)


def fixed_order_row_sum_(x_CV: torch.Tensor) -> torch.Tensor:
    """The sum of each row of ``x_CV`` (which is overwritten), added pairwise by halving
    (``x[:, :h] += x[:, w-h:w]`` until one column is left). Only elementwise additions, so a row's
    sum is the same bits whatever the other rows, the thread count or the CPU's vector width."""
    width = x_CV.shape[1]
    while width > 1:
        half = width // 2
        x_CV[:, :half].add_(x_CV[:, width - half : width])
        width -= half
    return x_CV[:, 0].clone()  # a copy, so that the [C, V] buffer can be freed


def tempered_log_softmax(z_CV: torch.Tensor, temperature_C: torch.Tensor) -> torch.Tensor:
    """float32 ``log softmax(z / T)`` of one chunk (a new tensor; ``z_CV`` is left alone)."""
    logp_CV = z_CV.float()
    if logp_CV is z_CV:
        logp_CV = logp_CV.clone()
    logp_CV.sub_(logp_CV.amax(dim=-1, keepdim=True))  # a max is exact in any order
    logp_CV.div_(temperature32(temperature_C).to(logp_CV.device)[:, None])
    lse_C = fixed_order_row_sum_(logp_CV.exp()).log_()
    logp_CV.sub_(lse_C[:, None])
    return logp_CV.clamp_(min=LOGP_FLOOR)


def entropy_of(logp_CV: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` in a fixed order: no cancellation between two large numbers as in
    ``lse - sum(p z)`` at low temperatures. (A floored ``log p`` has ``p = 0`` exactly, so it
    adds nothing.)"""
    h_C = -fixed_order_row_sum_(logp_CV.exp().mul_(logp_CV))
    return torch.where(h_C > 0, h_C, 0.0)  # rounding below 0 (and -0.0) reads as 0


def logprob_entropy_torch(z_CV: torch.Tensor, targets_C: torch.Tensor, temperature_C: torch.Tensor):
    """Reference: float32 tempered log-softmax, gather, ``-sum p log p``."""
    _check(z_CV, targets_C, temperature_C)
    logp_CV = tempered_log_softmax(z_CV, temperature_C)
    return logp_CV.gather(1, targets_C.long()[:, None])[:, 0], entropy_of(logp_CV)


def logprob_entropy_triton(z_CV: torch.Tensor, targets_C: torch.Tensor, temperature_C: torch.Tensor, *,
                           tile: tuple[int, int, int] | None = None):
    """Fused single pass over each row of ``z_CV`` (CUDA, Triton); ``tile`` = ``(lanes, run, warps)``
    overrides ``head_tile`` (each tile sums in its own order: float32 rounding apart)."""
    _check(z_CV, targets_C, temperature_C)
    if z_CV.stride(1) != 1:
        z_CV = z_CV.contiguous()
    C, V = z_CV.shape
    logp_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
    entropy_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
    if C == 0:
        return logp_C, entropy_C
    lanes, run, warps = tile or head_tile(V)
    _kernel()[(C,)](
        z_CV,
        z_CV.stride(0),
        targets_C.to(device=z_CV.device, dtype=torch.int64).contiguous(),
        temperature32(temperature_C.to(z_CV.device)).contiguous(),
        logp_C,
        entropy_C,
        V,
        LOGP_FLOOR=LOGP_FLOOR,
        LANES=lanes,
        RUN=run,
        num_warps=warps,
    )
    return logp_C, entropy_C


def head_tile(V: int) -> tuple[int, int, int]:
    """``(lanes, run, warps)`` for a vocabulary of ``V``: runs of 8 logits (16 bytes of bf16, one
    load a thread), as many lanes as two per thread of 8 warps, fewer for a small vocabulary."""
    run = 8
    lanes = min(512, max(16, 1 << (max(1, -(-V // run)) - 1).bit_length()))
    return lanes, run, 8 if lanes >= 256 else 4


def _check(z_CV, targets_C, temperature_C) -> None:
    if z_CV.dim() != 2:
        raise ValueError(f"logits must be [C, V], got {tuple(z_CV.shape)}")
    if targets_C.shape != z_CV.shape[:1] or temperature_C.shape != z_CV.shape[:1]:
        raise ValueError(
            f"targets and temperature must be [C={z_CV.shape[0]}], got "
            f"{tuple(targets_C.shape)} and {tuple(temperature_C.shape)}"
        )


try:  # the CPU install has no Triton: only the CUDA backend (and the interpreter) builds these
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - absent, or present but broken: the torch backend still serves
    triton = None

if triton is not None:
    @triton.jit
    def _fold(z, m, s, t, temp, DIVIDE: tl.constexpr, GUARD: tl.constexpr):
        """One block ``z`` [LANES, RUN] (float32) into each lane's running m = max raw logit, s = sum
        exp(d), t = sum exp(d) * d, with d = (z - m) / temp (``DIVIDE`` False: temp is 1, by which a
        division is exact). ``GUARD``: some d may be -inf (masked columns, or an overflow at a tiny
        temperature), whose exp(d) * d must count as 0, not NaN."""
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = (m_new - m) / temp if DIVIDE else m_new - m
        r = tl.exp(-shift)
        # The old terms' d move down by the shift; an r of 0 drops them (and avoids 0 * inf). A
        # shift of 0 leaves both sums exactly as they were.
        t = tl.where(r > 0, r * (t - s * shift), 0.0)
        s = s * r
        d = (z - m_new[:, None]) / temp if DIVIDE else z - m_new[:, None]
        e = tl.exp(d)
        ed = tl.where(e > 0, e * d, 0.0) if GUARD else e * d
        return m_new, s + tl.sum(e, axis=1), t + tl.sum(ed, axis=1)

    @triton.jit
    def _scan(z_row, V: tl.constexpr, temp, m, s, t, offs, BLOCK: tl.constexpr, DIVIDE: tl.constexpr):
        """Every block of the row into (m, s, t): the whole blocks unmasked, each one's load issued
        before the previous block's arithmetic (one load in flight while it computes), then the tail."""
        FULL: tl.constexpr = V // BLOCK
        if FULL > 0:
            z_next = tl.load(z_row + offs)
            for i in range(1, FULL):
                z = z_next.to(tl.float32)
                z_next = tl.load(z_row + i * BLOCK + offs)
                m, s, t = _fold(z, m, s, t, temp, DIVIDE, DIVIDE)
            m, s, t = _fold(z_next.to(tl.float32), m, s, t, temp, DIVIDE, DIVIDE)
        if V % BLOCK:
            cols = FULL * BLOCK + offs
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m, s, t = _fold(z, m, s, t, temp, DIVIDE, True)
        return m, s, t

    @triton.jit
    def logprob_entropy_kernel(
        z_ptr, stride_row, target_ptr, temp_ptr, logp_ptr, entropy_ptr,
        V: tl.constexpr, LOGP_FLOOR: tl.constexpr, LANES: tl.constexpr, RUN: tl.constexpr,
    ):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride_row
        temp = tl.load(temp_ptr + row)
        offs = tl.arange(0, LANES)[:, None] * RUN + tl.arange(0, RUN)[None, :]  # lane l: a run of RUN logits
        # m starts at a finite floor so that lanes which only ever see masked columns
        # (vocabularies smaller than a block) never compute -inf - -inf.
        m = tl.full([LANES], LOGP_FLOOR, tl.float32)
        s = tl.zeros([LANES], tl.float32)
        t = tl.zeros([LANES], tl.float32)
        if temp == 1.0:  # the usual temperature: no division at all
            m, s, t = _scan(z_row, V, temp, m, s, t, offs, LANES * RUN, False)
        else:
            m, s, t = _scan(z_row, V, temp, m, s, t, offs, LANES * RUN, True)
        m_row = tl.max(m, axis=0)
        shift = (m_row - m) / temp
        w = tl.exp(-shift)
        s_row = tl.sum(s * w, axis=0)  # >= 1: the arg-max column contributes exp(0)
        t_row = tl.sum(tl.where(w > 0, w * (t - s * shift), 0.0), axis=0)
        lse = tl.log(s_row)
        target = tl.load(target_ptr + row)
        d_target = (tl.load(z_row + target).to(tl.float32) - m_row) / temp
        tl.store(logp_ptr + row, tl.maximum(d_target - lse, LOGP_FLOOR))
        h = lse - t_row / s_row
        tl.store(entropy_ptr + row, tl.where(h > 0, h, 0.0))  # rounding below 0 (and -0.0) reads as 0


def _kernel():
    """The Triton kernel (Triton is imported only on machines that have it)."""
    if triton is None:
        raise RuntimeError("the triton head backend needs triton")
    return logprob_entropy_kernel
