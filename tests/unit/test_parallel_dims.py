"""ParallelDims, the Ulysses head split and the worker messages: no process group needed."""

import numpy as np
import pytest

from model_runtime.parallel.dims import ParallelDims
from model_runtime.parallel.ulysses import _heads_of, check_heads
from model_runtime.pool import messages as msg
from model_runtime.types import SequenceInput


@pytest.mark.parametrize(
    "world, sp, dp", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 2, 2), (8, 4, 2), (8, 8, 1)], ids=lambda v: str(v)
)
def test_from_world_derives_dp(world, sp, dp):
    dims = ParallelDims.from_world(world, sp)
    assert (dims.dp, dims.sp, dims.world_size) == (dp, sp, world)
    assert dims.as_info() == {"world_size": world, "dp": dp, "sp": sp, "fsdp": False}


def test_errors_show_the_arithmetic():
    with pytest.raises(ValueError, match=r"dp\(2\) \* sp\(2\) != world_size\(3\)"):
        ParallelDims(dp=2, sp=2, world_size=3)
    with pytest.raises(ValueError, match=r"world_size\(6\) is not divisible by sp\(4\): world_size\(6\) % sp\(4\) = 2"):
        ParallelDims.from_world(6, 4)
    with pytest.raises(ValueError, match=r"sp must be >= 1, got sp\(0\)"):
        ParallelDims(dp=1, sp=0, world_size=0)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1"):
        ParallelDims.from_world(0, 1)
    with pytest.raises(TypeError, match="dp must be an int"):
        ParallelDims(dp=1.0, sp=1, world_size=1)
    with pytest.raises(TypeError, match="fsdp must be a bool"):
        ParallelDims(dp=1, sp=1, world_size=1, fsdp="yes")


def test_rank_layout_is_row_major():
    dims = ParallelDims.from_world(8, sp=4, fsdp=True)
    assert [dims.group_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.sp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert dims.ranks_of_group(1) == (4, 5, 6, 7)
    with pytest.raises(ValueError, match=r"rank\(8\) is outside \[0, world_size\(8\)\)"):
        dims.group_of(8)
    with pytest.raises(ValueError, match=r"group\(2\) is outside \[0, dp\(2\)\)"):
        dims.ranks_of_group(2)


def test_lockstep_and_row_budget():
    assert ParallelDims.from_world(4, 2, fsdp=True).lockstep
    assert not ParallelDims.from_world(4, 2, fsdp=False).lockstep
    assert not ParallelDims.from_world(1, 1, fsdp=True).lockstep  # one rank has nobody to wait for
    assert ParallelDims.from_world(4, 2).row_token_budget(1000) == 2000


def test_build_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised"):
        ParallelDims.from_world(2, 2).build_mesh("cpu")


@pytest.mark.parametrize("heads, sp", [(4, 2), (8, 4), (2, 4), (1, 8), (4, 4), (16, 8)], ids=lambda v: str(v))
def test_head_split_covers_every_head_once_or_replicates(heads, sp):
    slices = [_heads_of(r, heads, sp) for r in range(sp)]
    taken = [h for s in slices for h in range(s.start, s.stop)]
    if heads >= sp:
        assert taken == list(range(heads))
    else:
        assert all(s.stop - s.start == 1 for s in slices)
        assert sorted(set(taken)) == list(range(heads))


@pytest.mark.parametrize("q_heads, kv_heads, sp", [(16, 4, 8), (4, 2, 4), (32, 16, 8), (4, 2, 2)], ids=lambda v: str(v))
def test_query_heads_stay_with_their_kv_head(q_heads, kv_heads, sp):
    group = q_heads // kv_heads
    for r in range(sp):
        q, kv = _heads_of(r, q_heads, sp), _heads_of(r, kv_heads, sp)
        local_group = (q.stop - q.start) // (kv.stop - kv.start)
        for j, h in enumerate(range(q.start, q.stop)):
            assert h // group == kv.start + j // local_group, f"rank {r}: query head {h} lost its kv head"


def test_check_heads_names_the_offending_count():
    class Config:
        num_attention_heads, num_key_value_heads = 6, 2
        linear_num_value_heads, linear_num_key_heads = 8, 3

    check_heads(Config, 1)
    with pytest.raises(ValueError, match=r"num_attention_heads\(6\) % sp\(4\) = 2"):
        check_heads(Config, 4)
    with pytest.raises(ValueError, match=r"linear_num_key_heads\(3\)"):
        check_heads(Config, 2)


def test_messages_round_trip_without_pickle():
    seqs = [
        SequenceInput(np.array([1, 2, 3]), score_from=2, temperature=0.7, top_k=3, return_entropy=False),
        SequenceInput(np.array([4096 - 1]), score_from=1),
    ]
    frame = msg.encode(msg.ScoreRow.of(7, seqs))
    assert b"pickle" not in frame and not frame.startswith(b"\x80")
    back = msg.decode(frame)
    assert back.request_id == 7
    for a, b in zip(back.sequences(), seqs):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        assert (a.score_from, a.temperature, a.top_k, a.return_entropy) == (b.score_from, b.temperature, b.top_k, b.return_entropy)
    with pytest.raises(ValueError, match="not a packscore worker message"):
        msg.decode(msg.msgpack.packb({"type": "Exec", "code": "..."}))
    with pytest.raises(ValueError, match="expected"):
        msg.decode(msg.msgpack.packb({"type": "Idle", "request_id": 1, "extra": 2}))
