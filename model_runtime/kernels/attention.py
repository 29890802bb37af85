"""Causal self-attention over a packed row: every token sees only its own segment's past.

Legend: T = tokens, H = query heads, Hkv = key/value heads, D = head dim.

Backends share one signature: ``fn(q_THD, k_THD, v_THD, packed, scale) -> o_THD``, with
grouped-query attention (query head ``h`` reads key/value head ``h // (H // Hkv)``).

A segment with a parent in ``packed.links`` (a shared prefix) attends to its parent's keys and
values, then its own. Every backend computes that as it computes the unshared sequence: the same
kernel over the whole sequence (the parent's queries, keys and values, then the segment's own,
causal from position 0), keeping the segment's own last rows (``_on_whole_sequences``). The
parent's queries are computed again inside attention only; in exchange a continuation's numbers
are those of the unshared sequence bit for bit, which SDPA with a bottom-right causal mask over
the parent's keys does not give (another kernel: half the outputs differ by a bf16 step on the
H200). ``varlen`` (flash attention) does give them, so it runs each query once
(``LinkedLayout.on_own_queries``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from model_runtime.model.packing import PackedBatch


def _check(q_THD, k_THD, v_THD, packed: PackedBatch) -> None:
    if q_THD.dim() != 3 or k_THD.shape != v_THD.shape or q_THD.shape[0] != k_THD.shape[0]:
        raise ValueError(
            f"attention expects q [T, H, D] and k, v [T, Hkv, D], got {tuple(q_THD.shape)}, "
            f"{tuple(k_THD.shape)}, {tuple(v_THD.shape)}"
        )
    if q_THD.shape[1] % k_THD.shape[1]:
        raise ValueError(f"query heads ({q_THD.shape[1]}) must be a multiple of kv heads ({k_THD.shape[1]})")
    if q_THD.shape[0] != packed.total_tokens:
        raise ValueError(f"q has {q_THD.shape[0]} tokens but the packed row has {packed.total_tokens}")


def _on_whole_sequences(kernel):
    """Runs ``kernel`` on a row with prefix links as on the unshared row: over every segment's
    whole sequence (``LinkedLayout.whole``), keeping each token's own output row."""

    @functools.wraps(kernel)
    def attention(q_THD, k_THD, v_THD, packed: PackedBatch, scale: float) -> torch.Tensor:
        _check(q_THD, k_THD, v_THD, packed)
        if packed.links is None:
            return kernel(q_THD, k_THD, v_THD, packed, scale)
        return packed.linked.on_whole_sequences(lambda q, k, v, whole: kernel(q, k, v, whole, scale), q_THD, k_THD, v_THD)

    return attention


# Float32 scores the reference holds at once (256 MiB): a long sequence is taken in blocks of
# queries, so memory grows with its length, not its square (32k tokens would need tens of GiB).
REFERENCE_SCORE_ELEMENTS = 1 << 26


@_on_whole_sequences
def causal_attention_reference(q_THD, k_THD, v_THD, packed: PackedBatch, scale: float) -> torch.Tensor:
    """Exact reference: float32 softmax attention, one segment at a time, in blocks of queries
    that each see the keys up to their last query."""
    H, group = q_THD.shape[1], q_THD.shape[1] // k_THD.shape[1]
    out = torch.empty_like(q_THD)
    for start, end in packed.segments():
        n = end - start
        q_HLD = q_THD[start:end].transpose(0, 1).float()
        k_HLD = k_THD[start:end].transpose(0, 1).float().repeat_interleave(group, dim=0)
        v_HLD = v_THD[start:end].transpose(0, 1).float().repeat_interleave(group, dim=0)
        block = max(1, REFERENCE_SCORE_ELEMENTS // (H * n))
        for q0 in range(0, n, block):
            q1 = min(n, q0 + block)
            scores_HBK = (q_HLD[:, q0:q1] @ k_HLD[:, :q1].transpose(1, 2)) * scale
            future = torch.ones(q1 - q0, q1, dtype=torch.bool, device=q_THD.device).triu(q0 + 1)
            scores_HBK = scores_HBK.masked_fill(future, float("-inf"))
            o_HBD = scores_HBK.softmax(dim=-1) @ v_HLD[:, :q1]
            out[start + q0 : start + q1] = o_HBD.transpose(0, 1).to(q_THD.dtype)
    return out


@_on_whole_sequences
def causal_attention_sdpa(q_THD, k_THD, v_THD, packed: PackedBatch, scale: float) -> torch.Tensor:
    """PyTorch SDPA, one launch per segment.

    Each segment goes through exactly the call Hugging Face's sdpa attention makes for one
    unpadded sequence (``is_causal``, shared key/value heads read in place with ``enable_gqa``),
    so its numbers do not depend on the other segments of the row, nor on their count.
    """
    group = q_THD.shape[1] // k_THD.shape[1]
    out = torch.empty_like(q_THD)
    for start, end in packed.segments():
        q = q_THD[start:end].transpose(0, 1).unsqueeze(0)
        k = k_THD[start:end].transpose(0, 1).unsqueeze(0)
        v = v_THD[start:end].transpose(0, 1).unsqueeze(0)
        o = sdpa_causal(q, k, v, scale, group)
        out[start:end] = o[0].transpose(0, 1)
    return out


def sdpa_causal(q_1HLD, k_1HLD, v_1HLD, scale: float, group: int) -> torch.Tensor:
    """Causal SDPA of one whole sequence, the call Hugging Face's sdpa attention makes.

    On CUDA the sequence is zero-padded at its end to ``attention_bucket(L)`` tokens. SDPA's
    cuDNN backend (its choice on Hopper) builds an execution plan for every new length, tens of
    milliseconds each, which real traffic (a new length per sequence) would pay on every request;
    buckets bound the plans to some eighty, built once. Causal masking keeps the padded keys
    away from every real query, and the cuDNN kernel computes the real rows bit for bit as it
    does unpadded (tests/gpu/test_kernels.py).
    """
    L = q_1HLD.shape[2]
    padded = attention_bucket(L) if q_1HLD.is_cuda else L
    if padded != L:
        grow = (0, 0, 0, padded - L)
        q_1HLD, k_1HLD, v_1HLD = F.pad(q_1HLD, grow), F.pad(k_1HLD, grow), F.pad(v_1HLD, grow)
    o = F.scaled_dot_product_attention(q_1HLD, k_1HLD, v_1HLD, is_causal=True, scale=scale, enable_gqa=group > 1)
    return o[:, :, :L] if padded != L else o


def causal_attention_sdpa_fused(q_THD, k_THD, v_THD, packed: PackedBatch, scale: float) -> torch.Tensor:
    """``causal_attention_sdpa``, whose layer may instead hand over the rotary embedding and the
    output gate too (``ROPE_AND_GATE``): the same SDPA calls on the same padded operands, with
    the memory-bound steps around them in two Triton passes (``attention_triton``)."""
    return causal_attention_sdpa(q_THD, k_THD, v_THD, packed, scale)


def sdpa_rope_and_gate(q_THD, k_THD, v_THD, cos_TR, sin_TR, gate_THD, packed: PackedBatch, scale: float):
    """``o_proj``'s input ``[T, H * D]``: ``partial_rope`` on q and k, causal SDPA per segment as
    ``sdpa_causal`` runs it (zero-padded to its bucket), then ``o * sigmoid(gate)``; or None
    where the fused passes do not take these operands (a CPU tensor, another dtype or layout),
    and the layer then runs the steps one by one. A row with prefix links runs over its whole
    sequences as every backend does (``LinkedLayout``): the passes read the row's tokens through
    ``whole_index_Tw`` and write each token's output from its own rows (``own_index_Tw``)."""
    from model_runtime.kernels import attention_triton as AT

    if not q_THD.is_cuda or not AT.supports(q_THD, k_THD, v_THD, cos_TR, sin_TR, gate_THD):
        return None
    _check(q_THD, k_THD, v_THD, packed)
    whole = packed if packed.links is None else packed.linked.whole
    layout = AT.bucket_layout(whole.lengths, q_THD.device, attention_bucket)
    if layout.total_padded > FUSED_MAX_PADDING * whole.total_tokens + ATTENTION_MIN_BUCKET * 64:
        return None  # mostly very short sequences: every one padded at once would not fit
    return bucketed_sdpa_gated(q_THD, k_THD, v_THD, cos_TR, sin_TR, gate_THD, packed, scale, layout)


# The fused path holds every segment's padded operands at once: at most this many times the row's
# tokens (64-token sequences grow 4x to the smallest bucket; single tokens would grow 256x).
FUSED_MAX_PADDING = 4


def bucketed_sdpa_gated(q_THD, k_THD, v_THD, cos_TR, sin_TR, gate_THD, packed: PackedBatch, scale: float,
                        layout=None) -> torch.Tensor:
    """``sdpa_rope_and_gate``'s work without its checks (the interpreter tests run it on the CPU)."""
    from model_runtime.kernels import attention_triton as AT

    T, H, D = q_THD.shape
    Hkv = k_THD.shape[1]
    if packed.links is None:
        whole, rows, own = packed, None, None
    else:
        linked = packed.linked
        whole, rows, own = linked.whole, linked.whole_index_Tw, linked.own_index_Tw
    if layout is None:
        layout = AT.bucket_layout(whole.lengths, q_THD.device, attention_bucket)
    q_buf, k_buf, v_buf = AT.rope_into_buckets(q_THD, k_THD, v_THD, cos_TR, sin_TR, layout, rows)
    y_TE = q_THD.new_empty(T, H * D)
    for start, n, padded, offset in zip(layout.starts, layout.lengths, layout.padded, layout.offsets):
        q = q_buf[offset * H * D : (offset + padded) * H * D].view(1, H, padded, D)
        k = k_buf[offset * Hkv * D : (offset + padded) * Hkv * D].view(1, Hkv, padded, D)
        v = v_buf[offset * Hkv * D : (offset + padded) * Hkv * D].view(1, Hkv, padded, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=H > Hkv)
        AT.gate_rows(o, gate_THD, y_TE, start, n, own)
    return y_TE


# Attention backends whose layer may hand over the rotary embedding and the output gate too, and
# the function that takes them (``PackedAttention.forward`` looks its ``attention_fn`` up here).
ROPE_AND_GATE = {causal_attention_sdpa_fused: sdpa_rope_and_gate}


ATTENTION_MIN_BUCKET = 256
ATTENTION_BUCKETS_PER_OCTAVE = 16


def attention_bucket(length: int) -> int:
    """The padded length SDPA runs a sequence of ``length`` tokens at: at least 256, then the
    next multiple of 1/16 of the length's power of two, and of 256 (at most 6.25% more tokens
    past 4k, 16 buckets per doubling: some eighty up to 64k tokens; on the RL mix attention
    runs about 6% more work, a few tenths of a percent of a forward)."""
    if length <= ATTENTION_MIN_BUCKET:
        return ATTENTION_MIN_BUCKET
    step = max(ATTENTION_MIN_BUCKET, (1 << (length.bit_length() - 1)) // ATTENTION_BUCKETS_PER_OCTAVE)
    return -(-length // step) * step


def attention_buckets(max_length: int) -> list[int]:
    """Every bucket a sequence of at most ``max_length`` tokens can fall in, in increasing order."""
    out, length = [], 1
    while length <= max_length:
        bucket = attention_bucket(length)
        out.append(bucket)
        length = bucket + 1
    return out


def causal_attention_varlen(q_THD, k_THD, v_THD, packed: PackedBatch, scale: float) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` over the whole row.

    Its default is NOT causal; ``window_size=(-1, 0)`` makes it causal per segment
    (tests/gpu/test_kernels.py compares it with per-segment causal attention).
    Versions with ``enable_gqa`` read the shared key/value heads in place; older ones get
    repeated keys and values.

    On a row with prefix links every token's query runs once, against its whole sequence's keys
    (``LinkedLayout.on_own_queries``): a continuation's queries alone, the causal window aligned
    to the keys' end. Flash attention walks each query row's key blocks alike however the queries
    are tiled, so those rows equal the whole sequence's bit for bit (on the H200,
    tests/gpu/test_prefix_sharing_gpu.py), and a shared prompt's queries are not run again.
    """
    _check(q_THD, k_THD, v_THD, packed)
    if packed.links is not None:
        return packed.linked.on_own_queries(
            lambda q, k, v, queries, whole: _varlen(q, k, v, queries, whole, scale), q_THD, k_THD, v_THD)
    return _varlen(q_THD, k_THD, v_THD, packed, packed, scale)


def _varlen(q_THD, k_THD, v_THD, queries: PackedBatch, keys: PackedBatch, scale: float) -> torch.Tensor:
    """Causal ``varlen_attn`` of each query segment (a suffix of its key segment) over its key segment."""
    from torch.nn.attention.varlen import varlen_attn

    group = q_THD.shape[1] // k_THD.shape[1]
    extra = {}
    if group > 1:
        if _varlen_has_gqa():
            extra["enable_gqa"] = True
        else:
            k_THD = k_THD.repeat_interleave(group, dim=1)
            v_THD = v_THD.repeat_interleave(group, dim=1)
    return varlen_attn(q_THD, k_THD, v_THD, queries.cu_seqlens, keys.cu_seqlens, queries.max_seqlen, keys.max_seqlen,
                       scale=scale, window_size=(-1, 0), **extra)


_VARLEN_GQA: bool | None = None


def _varlen_has_gqa() -> bool:
    global _VARLEN_GQA
    if _VARLEN_GQA is None:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters
    return _VARLEN_GQA


@_on_whole_sequences
def causal_attention_flash(q_THD, k_THD, v_THD, packed: PackedBatch, scale: float) -> torch.Tensor:
    """``flash_attn_varlen_func`` (flash-attn package), causal, native GQA."""
    from flash_attn import flash_attn_varlen_func

    cu, n = packed.cu_seqlens, packed.max_seqlen
    return flash_attn_varlen_func(q_THD, k_THD, v_THD, cu, cu, n, n, softmax_scale=scale, causal=True)
