"""The fused attention passes (model_runtime/kernels/attention_triton.py) in Triton's CPU
interpreter: the rotary embedding written into each segment's padded head-major block (zero rows
after it), values copied exactly, and the output gate in token order; each within a bf16 step of
eager PyTorch (the interpreter's exp is NumPy's and its float32 -> bf16 cast truncates where a GPU
rounds; bit-for-bit equality is tests/gpu/test_kernels.py's job).

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_attention_triton_interpret.py
"""

import pytest
import torch

from tests.interpret import bf16_steps, only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()

LENGTHS = (1, 33, 256, 70)


def _operands(H=4, Hkv=2, D=64, R=16, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    wide = (torch.randn(T, H, 2 * D, generator=g) * 2).to(torch.bfloat16)
    q, gate = wide.chunk(2, dim=-1)  # strided, as the layer cuts them from q_proj's output
    k = (torch.randn(T, Hkv, D, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(T, Hkv, D, generator=g).to(torch.bfloat16)
    angle = torch.arange(T)[:, None].float() * torch.rand(R, generator=g)[None]
    return q, k, v, angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16), gate


def _term_sizes(x_THD, cos_TR, sin_TR):
    """``|x * cos| + |rotate_half(x) * sin|`` on the rotary dims, ``|x|`` past them."""
    R = cos_TR.shape[-1]
    rot = x_THD[..., :R].float().abs()
    partner = torch.cat([rot[..., R // 2 :], rot[..., : R // 2]], dim=-1)
    sizes = rot * cos_TR[:, None].float().abs() + partner * sin_TR[:, None].float().abs()
    return torch.cat([sizes, x_THD[..., R:].float().abs()], dim=-1)


def _bucket(n):
    return -(-n // 64) * 64


def test_rope_into_buckets_places_rotates_and_pads():
    from model_runtime.kernels import attention_triton as AT
    from model_runtime.kernels import elementwise as E

    q, k, v, cos, sin, _ = _operands()
    layout = AT.bucket_layout(LENGTHS, "cpu", _bucket)
    assert layout.padded == (64, 64, 256, 128) and layout.offsets == (0, 64, 128, 384)
    qb, kb, vb = AT.rope_into_buckets(q, k, v, cos, sin, layout)
    rq, rk = E.EAGER.partial_rope(q, k, cos, sin)
    # the size of each rotated value's two terms: a sum that cancels is off by their steps, not its own
    scale_q, scale_k = (_term_sizes(x, cos, sin) for x in (q, k))
    for (name, buf, want, heads, scale) in (("q", qb, rq, 4, scale_q), ("k", kb, rk, 2, scale_k), ("v", vb, v, 2, None)):
        for start, n, padded, offset in zip(layout.starts, layout.lengths, layout.padded, layout.offsets):
            block = buf[offset * heads * 64 : (offset + padded) * heads * 64].view(heads, padded, 64)
            expected = want[start : start + n].transpose(0, 1)
            if name == "v":
                assert torch.equal(block[:, :n], expected), "values must be copied exactly"
            else:
                terms = scale[start : start + n].transpose(0, 1).float().clamp_min(1e-3)
                steps = float(((block[:, :n].float() - expected.float()).abs() / terms).max() / 2**-7)
                assert steps <= 4.0, f"{name}: rotary off eager by {steps:.2f} bf16 steps of its terms (tolerance 4)"
                # the dims past the rotary ones pass through untouched
                past = (block[:, :n, 16:].float() - expected[..., 16:].float()).abs().max()
                assert torch.equal(block[:, :n, 16:], expected[..., 16:]), f"{name}: dims past the rotary ones off by {past:.3e} (tol 0)"
            assert not block[:, n:].any(), f"{name}: padding rows of segment at {start} are not zero"


def test_gate_rows_writes_token_order_times_sigmoid():
    from model_runtime.kernels import attention_triton as AT

    g = torch.Generator().manual_seed(3)
    H, D, T, padded, start, n = 4, 64, 90, 64, 20, 50
    o = torch.randn(1, H, padded, D, generator=g).to(torch.bfloat16)
    gate = (torch.randn(T, H, 2 * D, generator=g) * 3).to(torch.bfloat16)[..., D:]
    y = torch.full((T, H * D), 7.0, dtype=torch.bfloat16)
    AT.gate_rows(o, gate, y, start, n)
    want = (o[0, :, :n].transpose(0, 1) * torch.sigmoid(gate[start : start + n])).reshape(n, -1)
    steps = bf16_steps(y[start : start + n], want, floor=1e-2)
    assert steps <= 2.0, f"gate off eager by {steps:.2f} bf16 steps (tolerance 2)"
    untouched = torch.cat([y[:start], y[start + n :]])
    assert bool((untouched == 7.0).all()), "rows outside the segment were written"


def test_fused_attention_matches_the_steps():
    """The whole fused path against the steps one by one, fed the kernel's own rotary output (the
    interpreter's rotary truncates, and a sharp softmax would magnify that): segments, buckets
    and gate rows wired right."""
    from model_runtime.kernels import attention_triton as AT
    from model_runtime.kernels.attention import attention_bucket, bucketed_sdpa_gated, causal_attention_sdpa
    from model_runtime.model.packing import PackedBatch

    q, k, v, cos, sin, gate = _operands()
    packed = PackedBatch.from_lengths(LENGTHS)
    fused = bucketed_sdpa_gated(q, k, v, cos, sin, gate, packed, 0.125)
    layout = AT.bucket_layout(LENGTHS, "cpu", attention_bucket)
    qb, kb, _ = AT.rope_into_buckets(q, k, v, cos, sin, layout)

    def unpad(buf, heads):
        return torch.cat([buf[o * heads * 64 : (o + p) * heads * 64].view(heads, p, 64)[:, :n].transpose(0, 1)
                          for n, p, o in zip(layout.lengths, layout.padded, layout.offsets)])

    rq, rk = unpad(qb, 4), unpad(kb, 2)
    steps = (causal_attention_sdpa(rq, rk, v, packed, 0.125) * torch.sigmoid(gate)).reshape(q.shape[0], -1)
    err = bf16_steps(fused, steps, floor=1e-2)
    assert err <= 3.0, f"fused attention off the steps by {err:.2f} bf16 steps (tolerance 3: the gate's rounding)"


def test_unsupported_operands_are_refused():
    from model_runtime.kernels import attention_triton as AT
    from model_runtime.kernels.attention import sdpa_rope_and_gate
    from model_runtime.model.packing import PackedBatch

    q, k, v, cos, sin, gate = _operands()
    assert AT.supports(q, k, v, cos, sin, gate)
    assert not AT.supports(q.float(), k, v, cos, sin, gate)  # dtypes differ
    assert not AT.supports(q, k, v, cos[:, :15], sin[:, :15], gate)  # odd rotary width
    with pytest.raises(ValueError, match="multiple of"):
        AT.bucket_layout((5,), "cpu", lambda n: n)
    # on the CPU the layer runs the steps one by one
    assert sdpa_rope_and_gate(q, k, v, cos, sin, gate, PackedBatch.from_lengths(LENGTHS), 0.125) is None


def test_linked_row_reads_and_writes_through_the_whole_sequences():
    """A row with prefix links (a prompt, a loose sequence, then three continuations): the passes
    read the prompt's rows in place for every continuation and write each token once, from its
    own rows; the same kernel as on the unshared row, so equal to it bit for bit."""
    from model_runtime.kernels.attention import bucketed_sdpa_gated
    from model_runtime.model.packing import PackedBatch, PrefixLinks

    prompt, loose, conts = 64, 33, (1, 70, 200)
    q, k, v, cos, sin, gate = _operands(lengths=(prompt, loose, *conts), seed=5)
    linked = PackedBatch.from_lengths((prompt, loose, *conts), links=PrefixLinks((-1, -1, 0, 0, 0), 2))
    got = bucketed_sdpa_gated(q, k, v, cos, sin, gate, linked, 0.125)
    # The unshared row: each continuation after its own copy of the prompt (rotary positions
    # following on, as the linked row's cos/sin rows already do), then the loose sequence.
    starts = (0, prompt, prompt + loose, prompt + loose + conts[0], prompt + loose + conts[0] + conts[1])
    whole_rows = []
    for i, n in enumerate(conts):
        whole_rows += list(range(prompt)) + list(range(starts[2 + i], starts[2 + i] + n))
    whole_rows += list(range(prompt, prompt + loose))
    index = torch.tensor(whole_rows)
    unshared = PackedBatch.from_lengths((*(prompt + n for n in conts), loose))
    want_whole = bucketed_sdpa_gated(*(x[index] for x in (q, k, v, cos, sin, gate)), unshared, 0.125)
    # each linked token's output is read from its own rows: the prompt's from the first sequence
    own = list(range(prompt))
    own += list(range(sum(prompt + n for n in conts), sum(prompt + n for n in conts) + loose))
    offset = 0
    for n in conts:
        own += list(range(offset + prompt, offset + prompt + n))
        offset += prompt + n
    want = want_whole[torch.tensor(own)]
    diff = float((got.float() - want.float()).abs().max())
    assert diff == 0.0, f"linked fused attention vs unshared max |diff| {diff:.3e} (tolerance 0: the same kernels)"
