"""The select router (``moe_router=select``) on the GPU: ``torch.topk``'s values and expert
ids bit for bit, ties included, on router probabilities as Hugging Face's router makes them
(bf16 logits, float32 softmax) for 256 and 512 experts and K = 8 and 10, from one token to 64k.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the select router needs CUDA"),
]


@pytest.mark.parametrize("experts,k", [(256, 8), (512, 10), (256, 2), (128, 1)])
@pytest.mark.parametrize("levels", [None, 4, 1], ids=["random", "ties", "many-ties"])
def test_select_returns_what_torch_topk_returns(experts, k, levels, gpu_record):
    from model_runtime.kernels.moe_router import agrees_with_torch_topk, select_top_k

    g = torch.Generator(device="cuda").manual_seed(experts + k)
    logits = torch.randn(65536, experts, device="cuda", generator=g) * 2
    if levels is not None:  # few distinct logits: ties inside the top k and at its edge
        logits = torch.round(logits * levels) / levels
    probs = torch.softmax(logits.bfloat16(), dim=-1, dtype=torch.float32)
    differing = {}
    for rows in (1, 7, 2000, 65536):
        want_values, want_ids = torch.topk(probs[:rows], k, dim=-1)
        values, ids = select_top_k(probs[:rows], k)  # the path itself, not its fallback
        differing[f"T{rows}"] = int((ids != want_ids).any(dim=-1).sum()) + int((values != want_values).any(dim=-1).sum())
    gpu_record(f"router select vs torch.topk, E={experts} K={k} {levels}", **differing)
    assert agrees_with_torch_topk(probs.device, experts, k), "the start-up check found the select router off torch.topk"
    assert not any(differing.values()), f"rows that differ from torch.topk (tolerance: bit for bit): {differing}"
