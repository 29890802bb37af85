"""A position's log-prob and entropy do not depend on which other positions share its chunk or row."""

import numpy as np
import pytest
import torch

from model_runtime.kernels.logprob_head import entropy_of, fixed_order_row_sum_, logprob_entropy_torch
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput


@pytest.fixture(scope="module")
def tiny_scorer():
    return Scorer(load_model("tiny", device="cpu"))


def test_issue_example_alone_and_beside_a_neighbour_is_bitwise_equal(tiny_scorer):
    """[5,6,7,8] from 3 alone vs beside [9,10,11] from 1: a row of another length could take another
    matrix-product path in the entropy. Both rows pad to 16 tokens, so every product has the same
    shape and the numbers are equal to the bit."""
    mine = SequenceInput(np.array([5, 6, 7, 8]), score_from=3)
    other = SequenceInput(np.array([9, 10, 11]), score_from=1)
    alone = tiny_scorer.score_row([mine])[0]
    for packed in (tiny_scorer.score_row([other, mine])[1], tiny_scorer.score_row([mine, other])[0]):
        diff = float(np.abs(packed.entropy - alone.entropy).max())
        assert np.array_equal(packed.entropy, alone.entropy), f"entropy {packed.entropy} vs {alone.entropy} (diff {diff:.3e}, tol 0)"
        np.testing.assert_array_equal(packed.logprobs, alone.logprobs)


def test_top_k_ids_of_ties_do_not_depend_on_a_neighbour_asking_more(tiny_scorer):
    """At an enormous temperature every token ties; the row ranks the largest k any sequence
    asked for, and a sequence asking 3 still gets the same 3 ids (the lowest) beside one asking 20."""
    mine = SequenceInput(np.array([5, 6, 7, 8]), score_from=1, temperature=1e30, top_k=3)
    other = SequenceInput(np.array([9, 10, 11]), score_from=1, temperature=1e30, top_k=20)
    alone = tiny_scorer.score_row([mine])[0]
    beside = tiny_scorer.score_row([other, mine])[1]
    assert np.array_equal(alone.top_k_ids, beside.top_k_ids), f"{alone.top_k_ids[0]} alone, {beside.top_k_ids[0]} beside"
    assert alone.top_k_ids[0].tolist() == [0, 1, 2]  # every token ties: lowest ids first


@pytest.mark.parametrize("vocab", [4096, 4099, 65536], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("threads", [1, 3], ids=lambda t: f"threads{t}")
def test_head_numbers_of_a_row_ignore_the_rest_of_the_chunk(vocab, threads):
    """Fresh random logits: every row scored in a chunk of one, in the whole chunk, and in a
    chunk of other sizes gives the same bits (the vocabulary sums run in one fixed order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = torch.Generator().manual_seed(vocab + threads)
        C = 9
        z_CV = torch.randn(C, vocab, generator=rng) * 4
        targets_C = torch.randint(0, vocab, (C,), generator=rng)
        temperature_C = torch.tensor([1.0, 0.7, 0.05, 2.0, 1.0, 1e-30, 0.3, 1.0, 5.0])
        logp_C, entropy_C = logprob_entropy_torch(z_CV, targets_C, temperature_C)
        for split in ([1] * C, [2, 7], [4, 4, 1]):
            start = 0
            for size in split:
                rows = slice(start, start + size)
                part_logp, part_entropy = logprob_entropy_torch(z_CV[rows], targets_C[rows], temperature_C[rows])
                assert torch.equal(part_logp, logp_C[rows]), f"log-probs of rows {rows} change with the chunk {split}"
                assert torch.equal(part_entropy, entropy_C[rows]), (
                    f"entropy of rows {rows} changes with the chunk {split}: max diff "
                    f"{(part_entropy - entropy_C[rows]).abs().max():.3e} (tol 0)"
                )
                start += size
        # ... and they are right: float64 reference.
        z64 = z_CV.double() / temperature_C.double().clamp(min=torch.finfo(torch.float32).tiny)[:, None]
        logp64 = torch.log_softmax(z64, dim=-1)
        want_entropy = -(logp64.exp() * logp64).sum(-1)
        diff = (entropy_C.double() - want_entropy).abs().max().item()
        assert diff <= 1e-5, f"entropy vs float64: max diff {diff:.3e} > tol 1e-05"
    finally:
        torch.set_num_threads(before)


def test_fixed_order_sum_is_a_pairwise_sum():
    x = torch.arange(1, 12, dtype=torch.float32).repeat(3, 1)
    sums = fixed_order_row_sum_(x.clone())
    assert torch.equal(sums, torch.full((3,), 66.0)), f"sums {sums.tolist()}, want 66.0 each (tol 0)"
    one = torch.tensor([[2.5]])
    assert fixed_order_row_sum_(one).item() == 2.5
    # A floored log p (p = 0) adds nothing to the entropy.
    logp = torch.tensor([[0.0, torch.finfo(torch.float32).min]])
    assert entropy_of(logp).item() == 0.0
