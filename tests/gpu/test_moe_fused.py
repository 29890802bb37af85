"""The fused MoE experts (``moe_experts=grouped_mm_fused``) on the GPU: the ``grouped_mm``
composition's numbers bit for bit, on the Qwen3.5-35B-A3B block shape (E=256, K=8, D=2048, I=512)
and row counts from one token to a 64k-token row.
"""

import pytest
import torch

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
    from model_runtime.kernels.moe_experts import experts_grouped_mm, experts_grouped_mm_fused

    gate_up, down, x, top_i, top_w, gate, shared = (t[:rows] if t.dim() == 2 else t for t in inputs)
    with torch.inference_mode():
        routed = (experts_grouped_mm(x, top_i, top_w, gate_up, down), experts_grouped_mm_fused(x, top_i, top_w, gate_up, down))
        block = (experts_grouped_mm(x, top_i, top_w, gate_up, down, shared=(gate, shared)),
                 experts_grouped_mm_fused(x, top_i, top_w, gate_up, down, shared=(gate, shared)))
    counts = {"routed_differing": differing(*routed), "block_differing": differing(*block)}
    worst = [float((a.float() - b.float()).abs().max()) for a, b in (routed, block)]
    gpu_record(f"fused MoE experts vs grouped_mm, {rows} tokens", **counts)
    assert counts == {"routed_differing": 0, "block_differing": 0}, (
        f"{counts} of {rows * D} values differ (tolerance: bit for bit); max |diff| routed {worst[0]:.3e}, block {worst[1]:.3e}")


@pytest.mark.parametrize("lengths", [(1,), (5, 64, 300), (1000, 3000, 12000)], ids=lambda v: "L" + "-".join(map(str, v)))
def test_fused_block_equals_the_grouped_mm_block(lengths, gpu_record):
    """The whole PackedSparseMoe (router, shared expert and gate included) with either backend."""
    from bench.moe import random_block
    from model_runtime.kernels.registry import select_backends
    from model_runtime.model.moe import PackedSparseMoe
    from model_runtime.model.packing import PackedBatch

    block = random_block("qwen3.5-35b-a3b", "cuda")
    plain = PackedSparseMoe(block, select_backends("cuda", allow_slow=True, overrides={"moe_experts": "grouped_mm"}))
    fused = PackedSparseMoe(block, select_backends("cuda", allow_slow=True, overrides={"moe_experts": "grouped_mm_fused"}))
    packed = PackedBatch.from_lengths(list(lengths), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(len(lengths))
    x = torch.randn(sum(lengths), block.gate.hidden_dim, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        want, got = plain(x, packed), fused(x, packed)
    n = differing(got, want)
    gpu_record(f"fused MoE block vs grouped_mm block, lengths {lengths}", differing=n)
    worst = float((got.float() - want.float()).abs().max())
    assert n == 0, f"{n} of {want.numel()} values differ, max |diff| {worst:.3e} (tolerance: bit for bit)"
