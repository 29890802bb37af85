"""MoE on the GPU: a sequence scored alone equals the same sequence packed with others, bit for bit.

The first 4 layers of the Qwen3.5-35B-A3B shape (random bf16 weights), with the served kernels and
each grouped experts backend (``grouped_mm``, ``grouped_mm_fused``, ``grouped_mm_fused_scatter``,
``expert_tiles``, ``expert_tiles_silu``: skipped, with the reason, where the library is not built). Lengths span the grouped
product's tile configurations a row size would pick without the fixed tail (fewer than 64, 64-128
and over 128 rows per expert on average).
"""

import pytest
import torch

from tests.gpu.conftest import skip_unavailable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="MoE invariance on the GPU needs CUDA"),
]
BACKENDS = ("grouped_mm", "grouped_mm_fused", "grouped_mm_fused_scatter", "expert_tiles", "expert_tiles_silu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_alone_equals_packed_bit_for_bit(backend, gpu_record):
    from bench.moe import alone_vs_packed

    skip_unavailable("moe_experts", backend)
    result = alone_vs_packed(lengths=(1, 5, 64, 300, 1000, 3000, 9000), experts=backend)
    gpu_record(f"MoE alone vs packed (35B-A3B, 4 layers, {backend})",
               **{f"len_{k}": v for k, v in result["max_abs_diff_by_length"].items()})
    assert result["kernels"]["moe_experts"] == backend
    worst = max(result["max_abs_diff_by_length"].values())
    assert worst == 0.0, f"alone vs packed differ by up to {worst:.3e} (tolerance 0: bit for bit)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_experts_rows_do_not_depend_on_the_count(backend, gpu_record):
    """The experts alone: one token's row is the same with 0..20k other pairs on its experts."""
    from model_runtime.kernels.registry import REGISTRY

    skip_unavailable("moe_experts", backend)
    experts = REGISTRY["moe_experts"][backend]

    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, I, K = 256, 2048, 512, 8
    gate_up = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * 0.02).bfloat16()
    down = (torch.randn(E, D, I, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(20000, D, device="cuda", generator=g).bfloat16()
    top_i = torch.rand(20000, E, device="cuda", generator=g).topk(K, dim=-1).indices
    top_w = torch.rand(20000, K, device="cuda", generator=g).bfloat16()
    first = experts(x[:7], top_i[:7], top_w[:7], gate_up, down)
    diffs = {n: float((experts(x[:n], top_i[:n], top_w[:n], gate_up, down)[:7] - first).abs().max())
             for n in (8, 100, 2048, 4200, 20000)}
    gpu_record(f"grouped experts row-count dependence ({backend})", **{f"rows_{n}": v for n, v in diffs.items()})
    assert max(diffs.values()) == 0.0, f"rows change with the count: {diffs}"
