"""The select router (model_runtime/kernels/moe_router.py) in Triton's CPU interpreter.

``gathered_top_k`` against a plain model of ``torch.topk``'s gather on CUDA (the values above the
k-th largest in expert order, then those equal to it in expert order until k), with many ties;
``top_k_select`` against ``torch.topk`` on rows without ties (the CPU's ``torch.topk`` orders ties
its own way; the CUDA one, with ties, is tests/gpu/test_moe_router.py's job).

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


def _model(p_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = [], []
    for row in p_TE.tolist():
        kth = sorted(row, reverse=True)[k - 1]
        chosen = [e for e, v in enumerate(row) if v > kth]
        chosen += [e for e, v in enumerate(row) if v == kth][: k - len(chosen)]
        values.append([row[e] for e in chosen])
        ids.append(chosen)
    return torch.tensor(values, dtype=torch.float32), torch.tensor(ids, dtype=torch.int64)


@pytest.mark.parametrize("T,E,k,levels", [(13, 256, 8, None), (9, 256, 8, 2), (5, 64, 10, 1), (3, 512, 10, 3), (6, 256, 1, 1)],
                         ids=lambda v: str(v))
def test_gathered_top_k_is_torch_topks_gather(T, E, k, levels):
    from model_runtime.kernels.moe_router import gathered_top_k

    p = _probs(T, E, seed=T + E + k, levels=levels)
    values, ids = gathered_top_k(p, k)
    want_values, want_ids = _model(p, k)
    assert torch.equal(ids, want_ids), f"gathered experts differ from the model in {(ids != want_ids).sum()} places"
    assert torch.equal(values, want_values), "gathered values are not the experts' probabilities"


def test_all_equal_probabilities_keep_the_first_experts():
    from model_runtime.kernels.moe_router import gathered_top_k

    values, ids = gathered_top_k(torch.full((4, 256), 1 / 256), 8)
    assert torch.equal(ids, torch.arange(8).expand(4, 8))


@pytest.mark.parametrize("k", [8, 10, 2, 1])
def test_top_k_equals_torch_topk_without_ties(k):
    from model_runtime.kernels.moe_router import top_k_select

    g = torch.Generator().manual_seed(k)
    p = torch.softmax(torch.randn(40, 256, generator=g, dtype=torch.float64), dim=-1).float()
    got_values, got_ids = top_k_select(p, k)
    want_values, want_ids = torch.topk(p, k, dim=-1)
    assert torch.equal(got_ids, want_ids), f"{int((got_ids != want_ids).sum())} ids differ from torch.topk's"
    assert torch.equal(got_values, want_values), f"values off torch.topk's by {(got_values - want_values).abs().max():.3e} (tol 0)"


def test_the_kernel_refuses_what_it_does_not_take():
    from model_runtime.kernels.moe_router import gathered_top_k, top_k_select

    with pytest.raises(ValueError, match="float32"):
        gathered_top_k(torch.rand(3, 256).bfloat16(), 8)
    with pytest.raises(ValueError, match="power of two"):
        gathered_top_k(torch.rand(3, 200), 8)
    # as many experts as k, or an odd count: torch.topk itself
    for p in (torch.rand(5, 4), torch.rand(5, 200)):
        assert torch.equal(top_k_select(p, 4)[1], torch.topk(p, 4, dim=-1)[1])
