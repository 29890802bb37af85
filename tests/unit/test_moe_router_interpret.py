"""The candidates router (model_runtime/kernels/moe_router.py) in Triton's CPU interpreter.

``top_candidates`` against a plain model of what it keeps (each token's c largest values, ties
towards the lower expert, in expert order), with many ties; ``top_k_candidates`` against
``torch.topk`` on rows without ties (the CPU's ``torch.topk`` orders ties its own way; the CUDA
one, with ties, is tests/gpu/test_moe_router.py's job).

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_moe_router_interpret.py
"""

import pytest
import torch

from tests.interpret import only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()


def _probs(T: int, E: int, seed: int, levels: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    if levels is not None:  # few distinct logits: ties everywhere, at the cut too
        logits = torch.round(logits * levels) / levels
    return torch.softmax(logits.bfloat16(), dim=-1, dtype=torch.float32)


def _model(p_TE: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = [], []
    for row in p_TE.tolist():
        chosen = sorted(sorted(range(len(row)), key=lambda e: (-row[e], e))[:c])
        values.append([row[e] for e in chosen])
        ids.append(chosen)
    return torch.tensor(values, dtype=torch.float32), torch.tensor(ids, dtype=torch.int64)


@pytest.mark.parametrize("T,E,c,levels", [(13, 256, 16, None), (9, 256, 16, 2), (5, 64, 32, 1), (3, 512, 32, 3)],
                         ids=lambda v: str(v))
def test_candidates_are_the_largest_in_expert_order(T, E, c, levels):
    from model_runtime.kernels.moe_router import top_candidates

    p = _probs(T, E, seed=T + E + c, levels=levels)
    values, ids = top_candidates(p, c)
    want_values, want_ids = _model(p, c)
    assert torch.equal(ids, want_ids), f"candidate experts differ from the model in {(ids != want_ids).sum()} places"
    assert torch.equal(values, want_values), "candidate values are not the experts' probabilities"


def test_all_equal_probabilities_keep_the_first_experts():
    from model_runtime.kernels.moe_router import top_candidates

    values, ids = top_candidates(torch.full((4, 256), 1 / 256), 16)
    assert torch.equal(ids, torch.arange(16).expand(4, 16))


@pytest.mark.parametrize("k", [8, 10, 2])
def test_top_k_equals_torch_topk_without_ties(k):
    from model_runtime.kernels.moe_router import top_k_candidates

    g = torch.Generator().manual_seed(k)
    p = torch.softmax(torch.randn(40, 256, generator=g, dtype=torch.float64), dim=-1).float()
    got_values, got_ids = top_k_candidates(p, k)
    want_values, want_ids = torch.topk(p, k, dim=-1)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_values, want_values)


def test_the_kernel_refuses_what_it_does_not_take():
    from model_runtime.kernels.moe_router import top_candidates, top_k_candidates

    with pytest.raises(ValueError, match="float32"):
        top_candidates(torch.rand(3, 256).bfloat16(), 16)
    with pytest.raises(ValueError, match="power of two"):
        top_candidates(torch.rand(3, 200), 16)
    # fewer experts than candidates: torch.topk itself
    p = torch.rand(5, 16)
    assert torch.equal(top_k_candidates(p, 4)[1], torch.topk(p, 4, dim=-1)[1])
