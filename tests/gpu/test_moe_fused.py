"""The fused MoE experts (``moe_experts=grouped_mm_fused``, ``grouped_mm_fused_scatter``,
``expert_tiles`` and ``expert_tiles_silu``) on the GPU: the ``grouped_mm`` composition's numbers bit for bit, on the
Qwen3.5-35B-A3B block shape (E=256, K=8, D=2048, I=512) and row counts from one token to a
64k-token row. ``expert_tiles`` needs its library (model_runtime/kernels/expert_gemm.py); where it
is not built its cases are skipped with the reason.
"""

import pytest
import torch

from tests.gpu.conftest import skip_unavailable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused MoE experts need CUDA"),
]

E, K, D, I = 256, 8, 2048, 512
ROWS = (1, 7, 100, 2048, 20000, 65536)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Values whose bit patterns differ (so that -0.0 and +0.0 count as different)."""
    assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    n = max(ROWS)
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(E, D, I, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    # routing as the router makes it: top-k of a softmax, renormalised, in the model dtype
    probs = torch.softmax(torch.randn(n, E, device="cuda", generator=g) * 2, dim=-1)
    top_w, top_i = probs.topk(K, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).bfloat16()
    gate = torch.sigmoid(torch.randn(n, 1, device="cuda", generator=g)).bfloat16()
    shared = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    yield gate_up, down, x, top_i, top_w, gate, shared
    torch.cuda.empty_cache()


@pytest.mark.parametrize("rows", ROWS, ids=lambda n: f"T{n}")
def test_fused_experts_equal_the_composition_bit_for_bit(inputs, rows, gpu_record):
    from model_runtime.kernels.moe_experts import (
        experts_grouped_mm,
        experts_grouped_mm_fused,
        experts_grouped_mm_fused_scatter,
    )

    from model_runtime.kernels import expert_gemm
    from model_runtime.kernels.moe_experts import experts_expert_tiles, experts_expert_tiles_silu

    gate_up, down, x, top_i, top_w, gate, shared = (t[:rows] if t.dim() == 2 else t for t in inputs)
    counts, worst = {}, {}
    backends = [("fused", experts_grouped_mm_fused), ("fused_scatter", experts_grouped_mm_fused_scatter)]
    if expert_gemm.unavailable_reason() is None:  # else its own tests below skip with the reason
        backends += [("expert_tiles", experts_expert_tiles), ("expert_tiles_silu", experts_expert_tiles_silu)]
    with torch.inference_mode():
        routed_want = experts_grouped_mm(x, top_i, top_w, gate_up, down)
        block_want = experts_grouped_mm(x, top_i, top_w, gate_up, down, shared=(gate, shared))
        for name, fn in backends:
            routed = fn(x, top_i, top_w, gate_up, down)
            block = fn(x, top_i, top_w, gate_up, down, shared=(gate, shared))
            counts[f"{name}_routed_differing"] = differing(routed, routed_want)
            counts[f"{name}_block_differing"] = differing(block, block_want)
            worst[name] = max(float((routed.float() - routed_want.float()).abs().max()),
                              float((block.float() - block_want.float()).abs().max()))
    gpu_record(f"fused MoE experts vs grouped_mm, {rows} tokens", **counts)
    assert not any(counts.values()), f"{counts} of {rows * D} values differ (tolerance: bit for bit); max |diff| {worst}"


def expert_tiles_or_skip():
    from model_runtime.kernels import expert_gemm

    skip_unavailable("moe_experts", "expert_tiles")
    return expert_gemm


def routed_layout(expert_gemm, tokens: int, skew: float, g: torch.Generator):
    """Routing of ``tokens`` tokens from random logits (``skew`` > 0: a few experts take most rows,
    many none), laid out for the CUTLASS kernel: ``(counts_E, offsets_E, rows, tile_expert_M,
    dest_S)``, ``dest_S`` the layout row of each grouped row."""
    logits = torch.randn(tokens, E, device="cuda", generator=g) + skew * torch.linspace(0, 1, E, device="cuda")
    counts = torch.bincount(logits.topk(K, dim=-1).indices.reshape(-1), minlength=E)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    S, tile = tokens * K, expert_gemm.cutlass_product().tile_rows
    rows = expert_gemm.layout_rows(S, E, tile)
    starts, tile_expert = expert_gemm.expert_layout(counts, tile, rows)
    expert_of_row = torch.repeat_interleave(torch.arange(E, device="cuda"), counts, output_size=S)
    dest = torch.arange(S, device="cuda") - (offsets.long() - counts)[expert_of_row] + starts[expert_of_row]
    return counts, offsets, rows, tile_expert, dest


@pytest.mark.parametrize("skew", [0.0, 8.0], ids=["router-like", "skewed"])
@pytest.mark.parametrize("tokens", [1, 300, 16384, 65536], ids=lambda n: f"T{n}")
def test_expert_mm_equals_grouped_mm(tokens, skew, gpu_record):
    """packscore's CUTLASS product over the tile-aligned layout against ``torch._grouped_mm`` on the
    grouped rows, both products of the block, bit for bit: routing from random logits, and skewed
    so that a few experts take most rows and many take none."""
    expert_gemm = expert_tiles_or_skip()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    counts, offsets, rows, tile_expert, dest = routed_layout(expert_gemm, tokens, skew, g)
    S = tokens * K
    results = {}
    for name, n, k in (("gate_up", 2 * I, D), ("down", D, I)):
        w = (torch.randn(E, n, k, device="cuda", generator=g) * 0.02).bfloat16()
        x = torch.randn(S, k, device="cuda", generator=g).bfloat16()
        want = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        laid = x.new_full((rows, k), float("nan"))  # rows no pair names hold NaN: they must stay apart
        laid[dest] = x
        got = expert_gemm.expert_mm(laid, w, tile_expert)[dest]
        results[name] = differing(got, want)
    gpu_record(f"expert_mm vs torch._grouped_mm, {tokens} tokens, skew {skew}", max_rows_per_expert=int(counts.max()),
               empty_experts=int((counts == 0).sum()), **results)
    assert not any(results.values()), f"values differing from torch._grouped_mm (tolerance: bit for bit): {results}"


@pytest.mark.parametrize("skew", [0.0, 8.0], ids=["router-like", "skewed"])
@pytest.mark.parametrize("tokens", [1, 300, 16384, 65536], ids=lambda n: f"T{n}")
def test_expert_mm_silu_equals_the_product_then_the_silu_pass(tokens, skew, gpu_record):
    """The gate/up product with ``silu(gate) * up`` in its epilogue against the product and then
    the SiLU pass the fused path runs (``silu_mul_rows``, ATen's rounding), bit for bit, and
    against ``F.silu(gate) * up`` of ``torch._grouped_mm``'s rows."""
    from model_runtime.kernels import moe_triton

    expert_gemm = expert_tiles_or_skip()
    g = torch.Generator(device="cuda").manual_seed(tokens + 1)
    counts, offsets, rows, tile_expert, dest = routed_layout(expert_gemm, tokens, skew, g)
    S = tokens * K
    w = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(S, D, device="cuda", generator=g).bfloat16()
    laid = x.new_zeros((rows, D))
    laid[dest] = x
    got = expert_gemm.expert_mm_silu(laid, w, tile_expert)
    two_passes = moe_triton.silu_mul_rows(expert_gemm.expert_mm(laid, w, tile_expert), rows)
    gate_up = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    aten = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
    results = {"vs_two_passes": differing(got[dest], two_passes[dest]), "vs_aten": differing(got[dest], aten)}
    gpu_record(f"expert_mm_silu, {tokens} tokens, skew {skew}", empty_experts=int((counts == 0).sum()), **results)
    assert not any(results.values()), f"values differing (tolerance: bit for bit): {results}"


def test_expert_mm_refuses_what_it_does_not_take():
    expert_gemm = expert_tiles_or_skip()
    tile = expert_gemm.cutlass_product().tile_rows
    w = torch.zeros(4, 256, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a multiple of"):
        expert_gemm.expert_mm(torch.zeros(tile + 1, 128, device="cuda", dtype=torch.bfloat16), w,
                              torch.zeros(1, device="cuda", dtype=torch.int32))
    with pytest.raises(ValueError, match="bfloat16"):
        expert_gemm.expert_mm(torch.zeros(tile, 128, device="cuda"), w, torch.zeros(1, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("variant", ["default", "fused", "fused_scatter_select"])
@pytest.mark.parametrize("lengths", [(1,), (5, 64, 300), (1000, 3000, 12000)], ids=lambda v: "L" + "-".join(map(str, v)))
def test_block_equals_the_plain_block(lengths, variant, gpu_record):
    """The whole PackedSparseMoe (router, shared expert and gate included) with the served kernels
    (``default``: fused experts with scattered rows, the select router, the shared expert inline)
    and with steps between, against the plain composition (``bench.moe.PLAIN``); called twice, as
    a served block is."""
    from bench.moe import PLAIN, random_block
    from model_runtime.kernels.registry import select_backends
    from model_runtime.model.moe import PackedSparseMoe
    from model_runtime.model.packing import PackedBatch

    overrides = {"default": {}, "fused": {**PLAIN, "moe_experts": "grouped_mm_fused"},
                 "fused_scatter_select": {**PLAIN, "moe_experts": "grouped_mm_fused_scatter", "moe_router": "select"}}
    block = random_block("qwen3.5-35b-a3b", "cuda")
    plain = PackedSparseMoe(block, select_backends("cuda", allow_slow=True, overrides=PLAIN))
    ours = PackedSparseMoe(block, select_backends("cuda", allow_slow=True, overrides=overrides[variant]))
    packed = PackedBatch.from_lengths(list(lengths), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    x = torch.randn(sum(lengths), block.gate.hidden_dim, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        want, got = plain(x, packed), ours(x, packed)
        again = ours(x, packed)  # a second call reuses the first one's memory
    n, repeat = differing(got, want), differing(again, want)
    gpu_record(f"MoE block {variant} vs plain block, lengths {lengths}", differing=n, differing_second_call=repeat)
    worst = float((got.float() - want.float()).abs().max())
    assert n == repeat == 0, f"{n} (second call {repeat}) of {want.numel()} values differ, max |diff| {worst:.3e} (tolerance: bit for bit)"


@pytest.mark.parametrize("k", [8, 2, 4, 6, 10, 16])
def test_top_k_total_adds_as_torch_sum(k, gpu_record):
    """The router's renormalisation sum, written out, equals PyTorch's reduction (Hugging Face's
    ``.sum(-1)``) bit for bit on every row, whatever the number of rows."""
    from model_runtime.model.moe import top_k_total

    g = torch.Generator(device="cuda").manual_seed(k)
    w = torch.softmax(torch.randn(65536, 256, device="cuda", generator=g), dim=-1).topk(k, dim=-1).values
    differing_rows = {}
    for rows in (1, 3, 100, 2000, 65536):
        ours, theirs = top_k_total(w[:rows]), w[:rows].sum(-1, keepdim=True)
        differing_rows[f"T{rows}"] = int((ours != theirs).sum())
    gpu_record(f"router renormalisation sum vs torch.sum, K={k}", **differing_rows)
    assert not any(differing_rows.values()), f"rows whose sum differs from torch.sum (tolerance: bit for bit): {differing_rows}"


@pytest.mark.parametrize("k", [8, 10])
def test_combine_top_k_adds_as_torch_sum(k, gpu_record):
    """The top-k sum of the weighted expert rows, written out (``moe_experts.combine_top_k``, and
    the fused kernel through the composition tests above), equals Hugging Face's
    ``.view(T, K, D).sum(dim=1)`` bit for bit. Rows of wide dynamic range, so that the order of the
    float32 additions shows in the bf16 result."""
    from model_runtime.kernels.moe_experts import combine_top_k

    g = torch.Generator(device="cuda").manual_seed(k)
    differing = {}
    for rows in (1, 64, 327, 6000, 65536):
        scale = torch.exp2(torch.randint(-12, 12, (rows, k, 1), device="cuda", generator=g).float())
        w_TKD = (torch.randn(rows, k, D, device="cuda", generator=g) * scale).bfloat16()
        ours = combine_top_k(w_TKD.view(rows * k, D), rows, torch.bfloat16)
        differing[f"T{rows}"] = int((ours.view(torch.int16) != w_TKD.sum(dim=1).view(torch.int16)).sum())
    gpu_record(f"top-k sum of expert rows vs torch.sum(dim=1), K={k}", **differing)
    assert not any(differing.values()), f"elements that differ from torch.sum (tolerance: bit for bit): {differing}"
