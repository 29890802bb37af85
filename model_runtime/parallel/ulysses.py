"""Ulysses sequence parallelism: the token <-> head exchange the packed layers call as ``sp``.

Legend: S = ranks of the sequence-parallel group, T = tokens of the whole (padded) row,
Tl = T / S tokens of one rank's shard, H = heads, h = heads one rank holds, X = trailing dims.

A packed row of T tokens (padded to a multiple of S) is cut into S contiguous token shards.
Everything per token (embeddings, norms, projections, MLP, MoE routing) runs on the shard. The
token mixers need whole sequences, so ``to_heads`` trades tokens for heads with one
all-to-all: each rank ends up with every token of the row for ``h = H / S`` of the heads, runs
the unchanged packed kernels with the row's global ``PackedBatch`` (boundaries stay global),
and ``to_tokens`` trades back.

When a layer has fewer heads than ranks (GQA key/value heads, or GDN key heads), each rank
receives the one head its query/value heads read: rank ``r`` gets head ``r // (S / H)``. The
same rule, applied to both head counts, keeps query heads with their kv head and GDN value
heads with their key head, and ``head_slice`` tells the layer which conv channels those are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _heads_of(rank: int, num_heads: int, size: int) -> slice:
    if num_heads >= size:
        if num_heads % size:
            raise ValueError(f"heads({num_heads}) % sp({size}) = {num_heads % size}; Ulysses needs an even split")
        per = num_heads // size
        return slice(rank * per, (rank + 1) * per)
    if size % num_heads:
        raise ValueError(f"sp({size}) % heads({num_heads}) = {size % num_heads}; replicated heads need sp to be a multiple")
    head = rank // (size // num_heads)
    return slice(head, head + 1)


class UlyssesExchange:
    """The ``sp`` object of ``PackedGatedDeltaNet`` / ``PackedAttention`` / ``PackedCausalLM``.

    Built once per process from the group's process group; holds no per-row state (the row's
    boundaries travel as the ``PackedBatch`` argument, as without parallelism).

    Example (inside a worker of an sp=2 group, rank 1 holding tokens 4..7 of an 8-token row):
        >>> sp = UlyssesExchange(mesh["sp"].get_group())
        >>> q_THD = sp.to_heads(q_TlHD)     # [4, 8, 32] -> [8, 4, 32]
        >>> o_TlHD = sp.to_tokens(o_THD)    # [8, 4, 32] -> [4, 8, 32]
    """

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def head_slice(self, num_heads: int) -> slice:
        """Heads of a ``num_heads``-head tensor that this rank holds after ``to_heads``."""
        return _heads_of(self.rank, num_heads, self.size)

    def local_tokens(self, x_T: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous shard of a whole-row tensor (e.g. the row's position ids)."""
        T = x_T.shape[0]
        if T % self.size:
            raise ValueError(f"row of {T} tokens is not padded to a multiple of sp({self.size})")
        per = T // self.size
        return x_T[self.rank * per : (self.rank + 1) * per]

    def to_heads(self, x_TlH: torch.Tensor) -> torch.Tensor:
        """``[Tl, H, *X]`` token shard with all heads -> ``[T, h, *X]`` whole row, this rank's heads."""
        if x_TlH.dim() < 2:
            raise ValueError(f"to_heads expects [tokens, heads, ...], got shape {tuple(x_TlH.shape)}")
        H = x_TlH.shape[1]
        # send_S[j] is this rank's token shard restricted to the heads rank j will hold.
        send_STlh = torch.stack([x_TlH[:, _heads_of(j, H, self.size)] for j in range(self.size)]).contiguous()
        recv_STlh = torch.empty_like(send_STlh)
        dist.all_to_all_single(recv_STlh, send_STlh, group=self.group)
        # recv_S[i] holds rank i's tokens: concatenated in rank order they are the whole row.
        return recv_STlh.flatten(0, 1)

    # Key/value heads follow the same rule (replicated when there are fewer than ranks); the
    # separate name keeps the call sites readable.
    to_heads_kv = to_heads

    def to_tokens(self, x_Th: torch.Tensor) -> torch.Tensor:
        """``[T, h, *X]`` whole row with this rank's heads -> ``[Tl, S*h, *X]`` token shard, all heads.

        Only for tensors whose heads were split evenly (outputs of query/value heads).
        """
        T = x_Th.shape[0]
        if x_Th.dim() < 2 or T % self.size:
            raise ValueError(f"to_tokens expects [T, heads, ...] with T a multiple of sp({self.size}), got {tuple(x_Th.shape)}")
        # send_S[j] is rank j's token shard of this rank's heads.
        send_STlh = x_Th.reshape(self.size, T // self.size, *x_Th.shape[1:]).contiguous()
        recv_STlh = torch.empty_like(send_STlh)
        dist.all_to_all_single(recv_STlh, send_STlh, group=self.group)
        # recv_S[i] holds rank i's heads for this rank's tokens: put heads back in rank order.
        return recv_STlh.transpose(0, 1).flatten(1, 2)


def check_heads(config, sp: int) -> None:
    """Raises when a model's head counts cannot be split over ``sp`` ranks (before any forward).

    Query and GDN value heads are split evenly; kv and GDN key heads are split evenly or, when
    fewer than ``sp``, replicated so that every rank holds the one its heads read.
    """
    if sp == 1:
        return
    problems = []
    even = {"num_attention_heads": config.num_attention_heads, "linear_num_value_heads": config.linear_num_value_heads}
    for name, heads in even.items():
        if heads % sp:
            problems.append(f"{name}({heads}) % sp({sp}) = {heads % sp}")
    either = {"num_key_value_heads": config.num_key_value_heads, "linear_num_key_heads": config.linear_num_key_heads}
    for name, heads in either.items():
        if heads % sp and sp % heads:
            problems.append(f"neither {name}({heads}) % sp({sp}) nor sp({sp}) % {name}({heads}) is 0")
    if problems:
        raise ValueError("Ulysses sequence parallelism cannot split this model's heads: " + "; ".join(problems))
