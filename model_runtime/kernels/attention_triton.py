"""The memory-bound steps around per-segment SDPA, in two Triton passes that round as PyTorch does.

Legend: T = tokens, H = query heads, Hkv = key/value heads, D = head dim, R = rotary dims,
P = padded tokens (every segment grown to its ``attention_bucket``).

Unfused, a gated attention layer moves its queries, keys and values four times between the
norms and the attention kernel (rotary, a per-segment transpose with zero padding, SDPA, a copy
back to token order) and its output twice (the copy, then ``o * sigmoid(gate)``): on the
35B-A3B shape about 4 ms of a 15 ms layer at 64k tokens. Here

- ``rope_into_buckets`` applies the partial rotary embedding to q and k and writes q, k and v
  straight into one head-major buffer each, every segment at its bucket length with zero rows
  after it: the ``[1, H, P_i, D]`` operand SDPA takes, as contiguous views;
- ``gate_rows`` reads a segment's attention output where SDPA left it and writes
  ``o * sigmoid(gate)`` in token order, ready for the output projection.

On a row with prefix links both take an index: the layout is then the row's whole sequences
(``LinkedLayout.whole``), whose tokens the first pass reads in place through ``whole_index_Tw``
(a shared prompt once per continuation) and the second writes back through ``own_index_Tw``
(every token once, from its own rows), so no gathered copy of q, k, v or the gate is made.

Both repeat Hugging Face's arithmetic: ``x_rot * cos + rotate_half(x_rot) * sin`` with each
product and the sum rounded to the input dtype, and ATen's sigmoid (``1 / (1 + expf(-g))``,
IEEE division) rounded before the product; tests/gpu/test_kernels.py holds the fused attention
equal to the unfused one bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from model_runtime.kernels import triton_math
from model_runtime.model.packing import upload

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use these
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

# Padded tokens per program of ``rope_into_buckets``; every bucket is a multiple of it, so a
# program never straddles two segments.
BLOCK_T = 32
GATE_BLOCK_T = 32


@dataclass(frozen=True)
class BucketLayout:
    """Where each segment of a row sits in the padded head-major buffers.

    ``starts``/``lengths``/``padded`` are per segment (first token in the row, tokens, bucket
    length); ``offsets`` are padded tokens before the segment. The device tensors index the
    programs of ``rope_into_buckets``: for each block of ``BLOCK_T`` padded tokens, its segment
    and its first position inside it.
    """

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    padded: tuple[int, ...]
    offsets: tuple[int, ...]
    total_padded: int
    block_segment: torch.Tensor  # int32 [blocks]
    block_position: torch.Tensor  # int32 [blocks]
    segment_table: torch.Tensor  # int64 [4, segments]: starts, lengths, padded, offsets


def _build_layout(lengths: tuple[int, ...], device: str, bucket) -> BucketLayout:
    starts, padded, offsets = [], [], []
    start = offset = 0
    block_segment, block_position = [], []
    for i, n in enumerate(lengths):
        p = bucket(n)
        if p < n or p % BLOCK_T:
            raise ValueError(f"a bucket must hold its segment and be a multiple of {BLOCK_T}, got {p} for {n} tokens")
        starts.append(start)
        padded.append(p)
        offsets.append(offset)
        block_segment += [i] * (p // BLOCK_T)
        block_position += range(0, p, BLOCK_T)
        start += n
        offset += p
    n_blocks, n_segments = len(block_segment), len(lengths)
    host = torch.tensor(block_segment + list(block_position) + starts + list(lengths) + padded + offsets, dtype=torch.int64)
    table = upload(host, device)  # one asynchronous upload (a blocking one would wait for the queued kernels)
    blocks = table[: 2 * n_blocks].to(torch.int32)
    return BucketLayout(
        tuple(starts), lengths, tuple(padded), tuple(offsets), offset,
        blocks[:n_blocks], blocks[n_blocks:], table[2 * n_blocks :].view(4, n_segments),
    )


@functools.lru_cache(maxsize=16)
def _cached_layout(lengths: tuple[int, ...], device: str, bucket) -> BucketLayout:
    return _build_layout(lengths, device, bucket)


def bucket_layout(lengths, device, bucket) -> BucketLayout:
    """The layout of a row of segment ``lengths``, each grown to ``bucket(length)``; built once
    per row shape (every layer of a forward, and the next rows of that shape, reuse it)."""
    return _cached_layout(tuple(int(n) for n in lengths), str(torch.device(device)), bucket)


if triton is not None:
    @triton.jit
    def _rotated_rows(src, rows_t, real, d, cos_ptr, sin_ptr, sc_t, D: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr):
        """One head of ``BLOCK_T`` tokens, rotary applied to the first ``R`` dims when ``ROPE``;
        rows that are not ``real`` come out zero."""
        inside = d < D
        x = tl.load(src + d[None, :], mask=real[:, None] & inside[None, :], other=0.0)
        if ROPE:
            rot = d < R
            partner = tl.where(d < R // 2, d + R // 2, d - R // 2)
            both = real[:, None] & rot[None, :]
            xp = tl.load(src + partner[None, :], mask=both, other=0.0)
            c = tl.load(cos_ptr + rows_t[:, None] * sc_t + d[None, :], mask=both, other=0.0)
            s = tl.load(sin_ptr + rows_t[:, None] * sc_t + d[None, :], mask=both, other=0.0)
            # rotate_half: (-x2, x1); the negation is exact, then each product and the sum round
            sign = tl.where(d < R // 2, -1.0, 1.0)
            a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
            b = ((xp.to(tl.float32) * sign[None, :]) * s.to(tl.float32)).to(x.dtype)
            y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
            x = tl.where(rot[None, :], y, x)
        return x

    @triton.jit
    def _rope_into_buckets_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qb_ptr, kb_ptr, vb_ptr,
        block_segment_ptr, block_position_ptr, table_ptr, segments, rows_ptr,
        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t,
        H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INDEXED: tl.constexpr,
    ):
        block = tl.program_id(0)
        j = tl.program_id(1)  # q heads, then k heads, then v heads
        seg = tl.load(block_segment_ptr + block)
        p0 = tl.load(block_position_ptr + block).to(tl.int64)
        start = tl.load(table_ptr + seg)
        n = tl.load(table_ptr + segments + seg)
        padded = tl.load(table_ptr + 2 * segments + seg)
        offset = tl.load(table_ptr + 3 * segments + seg)
        pos = p0 + tl.arange(0, BLOCK_T)
        real = pos < n
        rows_t = start + pos
        if INDEXED:  # the layout's tokens are rows ``rows[t]`` of the operands
            rows_t = tl.load(rows_ptr + rows_t, mask=real, other=0)
        d = tl.arange(0, BLOCK_D)
        out_mask = (pos < padded)[:, None] & (d < D)[None, :]
        if j < H:
            x = _rotated_rows(q_ptr + rows_t[:, None] * sq_t + j * sq_h, rows_t, real, d, cos_ptr, sin_ptr, sc_t, D, R, True)
            dst = qb_ptr + (offset * H + j * padded + pos[:, None]) * D + d[None, :]
            tl.store(dst, x, mask=out_mask)
        elif j < H + HKV:
            h = j - H
            x = _rotated_rows(k_ptr + rows_t[:, None] * sk_t + h * sk_h, rows_t, real, d, cos_ptr, sin_ptr, sc_t, D, R, True)
            dst = kb_ptr + (offset * HKV + h * padded + pos[:, None]) * D + d[None, :]
            tl.store(dst, x, mask=out_mask)
        else:
            h = j - H - HKV
            x = _rotated_rows(v_ptr + rows_t[:, None] * sv_t + h * sv_h, rows_t, real, d, cos_ptr, sin_ptr, sc_t, D, R, False)
            dst = vb_ptr + (offset * HKV + h * padded + pos[:, None]) * D + d[None, :]
            tl.store(dst, x, mask=out_mask)

    # A segment's start and length take any value: specialising on them (a 1, a multiple of 16)
    # compiled new variants mid-run that the warm-up had not met.
    @triton.jit(do_not_specialize=["start", "n"])
    def _gate_rows_kernel(
        o_ptr, g_ptr, y_ptr, rows_ptr, start, n, so_h, so_t, sg_t, sg_h, sy_t,
        D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CUDA_MATH: tl.constexpr, INDEXED: tl.constexpr,
    ):
        h = tl.program_id(1)
        pos = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        rows_t = start + pos
        real = pos < n
        if INDEXED:  # token ``t`` of the layout goes to row ``rows[t]``, or nowhere where that is -1
            rows_t = tl.load(rows_ptr + rows_t, mask=real, other=-1)
            real = real & (rows_t >= 0)
        mask = real[:, None] & (d < D)[None, :]
        o = tl.load(o_ptr + h * so_h + pos[:, None] * so_t + d[None, :], mask=mask, other=0.0)
        g = tl.load(g_ptr + rows_t[:, None] * sg_t + h * sg_h + d[None, :], mask=mask, other=0.0)
        sig = triton_math.sigmoid(g.to(tl.float32), CUDA_MATH).to(g.dtype)  # torch.sigmoid's output
        y = (o.to(tl.float32) * sig.to(tl.float32)).to(o.dtype)
        tl.store(y_ptr + rows_t[:, None] * sy_t + h * D + d[None, :], y, mask=mask)


_DTYPES = (torch.bfloat16, torch.float16)


def supports(q_THD, k_THD, v_THD, cos_TR, sin_TR, gate_THD) -> bool:
    """Whether the fused passes take these operands: one half-precision dtype throughout, unit
    stride along the head dim, cos/sin ``[T, R]`` alike with an even ``R`` no wider than a head."""
    tensors = (q_THD, k_THD, v_THD, cos_TR, sin_TR, gate_THD)
    if triton is None or any(t.dtype != q_THD.dtype or t.stride(-1) != 1 or t.device != q_THD.device for t in tensors):
        return False
    T, H, D = q_THD.shape
    R = cos_TR.shape[-1]
    return (q_THD.dtype in _DTYPES and k_THD.shape[0] == v_THD.shape[0] == T and k_THD.shape == v_THD.shape
            and k_THD.shape[2] == D and gate_THD.shape == q_THD.shape and cos_TR.shape == sin_TR.shape == (T, R)
            and cos_TR.stride() == sin_TR.stride() and R % 2 == 0 and 0 < R <= D and H % k_THD.shape[1] == 0)


def rope_into_buckets(q_THD, k_THD, v_THD, cos_TR, sin_TR, layout: BucketLayout, rows: torch.Tensor | None = None):
    """``(q, k, v)`` rotated (q, k) and laid out head-major per segment: flat buffers of
    ``H * P * D`` and ``Hkv * P * D`` elements, segment ``i``'s part starting at
    ``offsets[i] * heads * D`` as a contiguous ``[heads, padded[i], D]`` block, zero after its
    ``lengths[i]`` rows. With ``rows`` (int64, one per token of the layout) the layout's token
    ``t`` is row ``rows[t]`` of the operands (a linked row's whole sequences, read in place)."""
    T, H, D = q_THD.shape
    Hkv = k_THD.shape[1]
    P = layout.total_padded
    qb = q_THD.new_empty(H * P * D)
    kb = k_THD.new_empty(Hkv * P * D)
    vb = v_THD.new_empty(Hkv * P * D)
    grid = (layout.block_segment.numel(), H + 2 * Hkv)
    _rope_into_buckets_kernel[grid](
        q_THD, k_THD, v_THD, cos_TR, sin_TR, qb, kb, vb,
        layout.block_segment, layout.block_position, layout.segment_table, len(layout.lengths),
        layout.block_segment if rows is None else rows,
        q_THD.stride(0), q_THD.stride(1), k_THD.stride(0), k_THD.stride(1), v_THD.stride(0), v_THD.stride(1), cos_TR.stride(0),
        H=H, HKV=Hkv, D=D, R=cos_TR.shape[-1], BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(D),
        INDEXED=rows is not None, num_warps=4, **triton_math.aten_rounding_options(q_THD.device),
    )
    return qb, kb, vb


def gate_rows(o_1HPD, gate_THD, y_TE, start: int, n: int, rows: torch.Tensor | None = None) -> None:
    """``y[start:start + n] = o[0, :, :n]`` (token order, heads side by side) ``* sigmoid(gate)``.
    With ``rows`` (int64, one per token of the layout) token ``start + i`` goes to row
    ``rows[start + i]`` of ``gate`` and ``y``, and nowhere where that is -1."""
    _, H, _, D = o_1HPD.shape
    grid = (triton.cdiv(n, GATE_BLOCK_T), H)
    _gate_rows_kernel[grid](
        o_1HPD, gate_THD, y_TE, o_1HPD if rows is None else rows, start, n, o_1HPD.stride(1), o_1HPD.stride(2), gate_THD.stride(0), gate_THD.stride(1),
        y_TE.stride(0), D=D, BLOCK_T=GATE_BLOCK_T, BLOCK_D=triton.next_power_of_2(D),
        CUDA_MATH=o_1HPD.device.type == "cuda", INDEXED=rows is not None, num_warps=4, **triton_math.aten_rounding_options(o_1HPD.device),
    )
