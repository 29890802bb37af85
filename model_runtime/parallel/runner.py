"""Scores one packed row on the ranks of a data-parallel group (Ulysses shards, FSDP units).

Legend: T = tokens of the padded row, Tl = T / sp tokens of this rank's shard, D = hidden size,
N = scored positions of the row, n = those in this rank's shard, K = top-k width.

Every rank of a group calls ``score_row`` with the same sequences. The row plan (labels shifted
on the global row, before any split) and the ``PackedBatch`` are built identically everywhere;
the row is padded to a multiple of 16 x ``sp`` with a padding segment of its own (never scored), each
rank embeds and runs its token shard, scores the positions of its shard with the chunked head,
and the group all-gathers the per-position results so every rank holds the whole row's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from model_runtime.model.packing import PackedBatch, upload
from model_runtime.parallel.dims import ParallelDims
from model_runtime.parallel.parallelize import unsharded_head_weight
from model_runtime.parallel.ulysses import UlyssesExchange
from model_runtime.scoring.head import ROW_MULTIPLE, HeadOutput, min_row_tokens
from model_runtime.scoring.loading import LoadedModel
from model_runtime.scoring.rows import PAD_TOKEN, plan_row, split_results
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput, SequenceScores



class ParallelScorer:
    """The per-rank half of a group's forward: the same role as ``Scorer.score_row``.

    ``loaded.model`` must already be ``parallelize``-d with the same ``dims`` and ``mesh``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        dims: ParallelDims,
        mesh,
        rank: int,
        max_batch_tokens: int = 16384,
        head_budget_bytes: int | None = None,
        prefix_min_tokens: int = 0,
        prefix_rounding=None,
    ):
        self.loaded = loaded
        self.dims = dims
        self.rank = rank
        self.sp_rank = dims.sp_rank(rank)
        self.sp_group = mesh["sp"].get_group() if dims.sp > 1 else None
        self.sp = UlyssesExchange(self.sp_group) if dims.sp > 1 else None
        # The single-process scorer owns the head's settings (chunk sizes, head kernel); reusing
        # it keeps both paths on the same numerics. Its forward is not used here.
        self.head_settings = Scorer(loaded, max_batch_tokens=max_batch_tokens, head_budget_bytes=head_budget_bytes)
        # Shared prefixes cross Ulysses shards like any other state: the mixers' kernels see the
        # whole row (head-sharded), and labels come from the global row plan.
        self.prefix_min_tokens = int(prefix_min_tokens)
        self.prefix_rounding = prefix_rounding  # a RowRounding: members share only where exact

    def score_row(self, sequences: Sequence[SequenceInput]) -> list[SequenceScores]:
        head, top_k = self.score_row_flat(sequences)
        return split_results(sequences, head, top_k)

    def score_row_flat(self, sequences: Sequence[SequenceInput]) -> tuple[HeadOutput, int]:
        """The whole row's head output (CPU tensors, in row order) and its top-k width."""
        # inference_mode, as in Scorer, except with FSDP: its unshard bumps version counters of
        # its parameter buffers, which tensors made under inference_mode do not have (it fails
        # outright on a world of one rank). no_grad costs every op a little host time, which only
        # a small CPU model notices.
        with torch.no_grad() if self.dims.fsdp else torch.inference_mode():
            return self._score_row_flat(sequences)

    def _score_row_flat(self, sequences: Sequence[SequenceInput]) -> tuple[HeadOutput, int]:
        S, device = self.dims.sp, self.loaded.device
        plan = plan_row(sequences, self.prefix_min_tokens, self.prefix_rounding)
        # Padded as Scorer pads (to ROW_MULTIPLE tokens), and to a multiple of sp for the shards.
        packed, ids_T = plan.padded_row(ROW_MULTIPLE * S, device, minimum=min_row_tokens(device, S))
        per = ids_T.shape[0] // S
        lo = self.sp_rank * per
        # Scored positions are increasing along the row, so each shard's are one contiguous run.
        bounds = np.searchsorted(plan.positions_N, np.arange(S + 1) * per)
        a, b = int(bounds[self.sp_rank]), int(bounds[self.sp_rank + 1])
        # Uploaded as Scorer.queue_row uploads: without waiting for kernels already queued.
        local_positions = upload(torch.from_numpy(plan.positions_N[a:b] - lo), device)
        targets_N = upload(torch.from_numpy(plan.targets_N[a:b]), device)
        temperature_N = upload(torch.from_numpy(plan.temperature_N[a:b]), device)
        hidden_TlD = self.loaded.model(upload(torch.from_numpy(ids_T[lo : lo + per]), device), packed, self.sp)
        with unsharded_head_weight(self.loaded.model) as weight_VD:
            head = self.head_settings.head(hidden_TlD, weight_VD, targets_N, temperature_N, top_k=plan.top_k,
                                           rows_N=local_positions)
        if S > 1:
            head = self._gather(head, np.diff(bounds).tolist(), plan.top_k)
        return _to_cpu(plan.expand(head)), plan.top_k

    @torch.no_grad()
    def idle_step(self) -> None:
        """A forward over a dummy row for a group without work, so FSDP's all-gathers stay in lockstep.

        The row is one padding segment of ``sp`` tokens (one per rank); nothing is scored, but the
        head weight is gathered and freed like in a real step.
        """
        S, device = self.dims.sp, self.loaded.device
        packed = PackedBatch.from_lengths([S], device=device, padding_segments=[0])
        self.loaded.model(torch.full((1,), PAD_TOKEN, dtype=torch.long, device=device), packed, self.sp)
        with unsharded_head_weight(self.loaded.model):
            pass

    def _gather(self, head: HeadOutput, counts: list[int], top_k: int) -> HeadOutput:
        """All-gathers every shard's results; the group's ranks agree on ``counts`` (same plan)."""
        n_max = max(counts)
        if n_max == 0:
            return head
        S, n, dev = self.dims.sp, counts[self.sp_rank], head.logprobs_N.device
        floats_nF = torch.zeros(n_max, 2 + top_k, dtype=torch.float32, device=dev)
        floats_nF[:n, 0] = head.logprobs_N
        floats_nF[:n, 1] = head.entropy_N
        if top_k:
            floats_nF[:n, 2:] = head.top_k_logprobs_NK
        parts = [torch.empty_like(floats_nF) for _ in range(S)]
        dist.all_gather(parts, floats_nF, group=self.sp_group)
        floats_NF = torch.cat([p[:c] for p, c in zip(parts, counts)])
        ids_NK = None
        if top_k:
            ids_nK = torch.zeros(n_max, top_k, dtype=torch.long, device=dev)
            ids_nK[:n] = head.top_k_ids_NK
            id_parts = [torch.empty_like(ids_nK) for _ in range(S)]
            dist.all_gather(id_parts, ids_nK, group=self.sp_group)
            ids_NK = torch.cat([p[:c] for p, c in zip(id_parts, counts)])
        return HeadOutput(
            floats_NF[:, 0],
            floats_NF[:, 1],
            ids_NK,
            floats_NF[:, 2:] if top_k else None,
        )


def _to_cpu(head: HeadOutput) -> HeadOutput:
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return HeadOutput(cpu(head.logprobs_N), cpu(head.entropy_N), cpu(head.top_k_ids_NK), cpu(head.top_k_logprobs_NK))


def cost_coefficients(loaded: LoadedModel) -> tuple[float, float]:
    """``(per_token, per_token_squared)`` forward FLOPs, for balancing rows across groups.

    A row's cost is ``per_token * T + per_token_squared * sum(L_i ** 2)`` over its segments:
    2 FLOPs per active parameter and token (MoE experts weighted by the routed fraction, LM head
    included), plus causal attention's ``QK^T`` and ``PV`` over each segment's square.
    Read before ``parallelize`` (numbers of whole parameters).
    """
    cfg = loaded.model.config
    routed = getattr(cfg, "num_experts_per_tok", 0) / max(1, getattr(cfg, "num_experts", 0) or 1)
    active = 0.0
    for name, p in loaded.model.layers.named_parameters():
        active += p.numel() * (routed if ".experts." in name else 1.0)
    active += loaded.model.lm_head.weight.numel()
    full_layers = sum(kind == "full_attention" for kind in loaded.model.layer_types)
    per_token_squared = 2.0 * full_layers * cfg.num_attention_heads * cfg.head_dim
    return 2.0 * active, per_token_squared
