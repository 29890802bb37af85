import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runtime.model.packing import PackedBatch, pack_first_fit_decreasing


def test_packed_batch_offsets_and_positions():
    p = PackedBatch.from_lengths([3, 1, 2])
    assert p.cu_seqlens_host == (0, 3, 4, 6)
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert p.max_seqlen == 3 and p.total_tokens == 6 and list(p.segments()) == [(0, 3), (3, 4), (4, 6)]


def test_packed_batch_is_immutable_and_fresh():
    a, b = PackedBatch.from_lengths([2, 2]), PackedBatch.from_lengths([2, 2])
    with pytest.raises(AttributeError):
        a.max_seqlen = 5
    # A fresh cu_seqlens tensor per forward (fla caches helpers by tensor identity).
    assert a.cu_seqlens is not b.cu_seqlens


def test_segments_within_a_shard_tile_it():
    p = PackedBatch.from_lengths([3, 5, 1, 7])  # offsets 0, 3, 8, 9, 16
    assert p.segments_within(0, 16) == tuple(p.segments())
    assert p.segments_within(0, 8) == ((0, 3), (3, 8))
    assert p.segments_within(8, 16) == ((0, 1), (1, 8))
    assert p.segments_within(4, 12) == ((0, 4), (4, 5), (5, 8))


def test_padding_is_its_own_segment():
    p, pad = PackedBatch.from_lengths_padded([3, 2], 4)
    assert pad == 3 and p.lengths == (3, 2, 3) and p.padding_segments == (2,)
    assert p.cu_seqlens_host == (0, 3, 5, 8)
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    same, none = PackedBatch.from_lengths_padded([4], 4)
    assert none == 0 and same.lengths == (4,) and same.padding_segments == ()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([16, 32, 64]))
def test_chunk_table_lists_every_chunk_of_every_segment(lengths, size):
    p = PackedBatch.from_lengths(lengths)
    want = [(i, j) for i, n in enumerate(lengths) for j in range(-(-n // size))]
    got = p.chunk_table(size)
    assert got.dtype == torch.int64 and got.shape == (len(want), 2), (got.dtype, tuple(got.shape), len(want))
    assert [tuple(r) for r in got.tolist()] == want
    assert p.chunk_table(size) is got  # built once per forward, shared by every layer


@pytest.mark.parametrize("lengths", [[], [0], [3, -1]])
def test_bad_lengths_are_refused(lengths):
    with pytest.raises(ValueError):
        PackedBatch.from_lengths(lengths)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 400))
def test_first_fit_decreasing_places_everything_once_within_budget(lengths, budget):
    rows = pack_first_fit_decreasing(lengths, budget)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    for row in rows:
        total = sum(lengths[i] for i in row)
        assert total <= budget or len(row) == 1, f"row {row} holds {total} tokens > budget {budget}"
    # First-fit decreasing never leaves two rows that could have been merged.
    loads = sorted(sum(lengths[i] for i in row) for row in rows)
    if len(loads) >= 2:
        assert loads[0] + loads[1] > budget


def test_first_fit_decreasing_is_tight_on_a_known_case():
    assert pack_first_fit_decreasing([5, 5, 4, 3, 2, 1], 10) == [[0, 1], [2, 3, 4, 5]]
