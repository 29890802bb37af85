"""Packscore's sparse-MoE block (Qwen3.5-MoE, Qwen3-Next): Hugging Face's arithmetic per token,
independent of the tokens it is packed with.

Legend: T = tokens in the (local) row, D = hidden size, E = experts, K = experts per token.

Hugging Face's block, step by step, and where this one rounds (the model dtype, bf16 on a GPU):
router logits ``x @ W_r.T`` (rounded), softmax in float32, top-K, renormalised in float32, cast to
the model dtype; routed experts as ``model_runtime.kernels.moe_experts`` describes; shared expert
``down(silu(gate(x)) * up(x))`` (each step rounded), its gate ``sigmoid(x @ w_g.T)`` (rounded
twice), their product (rounded), and the sum of routed and shared outputs (rounded).

Differences from Hugging Face's block, each there so a token's numbers do not depend on its row:
the narrow router and shared-gate products (N = E and 1) go through the ``gate_projection``
kernel (per segment on a GPU, where a narrow product's kernel follows the row count) or, with
the ``tiled`` experts, through fixed row tiles like the shared expert, the top-K weights are
renormalised by a sum written out in the order PyTorch's reduction adds them (``top_k_total``)
instead of by a reduction kernel, and on the CPU the shared gate's sigmoid never runs in an
elementwise kernel's scalar tail.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from model_runtime.kernels.gate_projection import NO_RUNS, RunLimits, narrow_products, row_invariant, shard_segments
from model_runtime.kernels.moe_experts import in_row_tiles
from model_runtime.kernels.registry import KernelBackends
from model_runtime.model.layers import ModuleOps, _is_silu
from model_runtime.model.packing import PackedBatch

# The experts backends that take bfloat16 weights on CUDA only.
CUDA_BF16_EXPERTS = frozenset({"grouped_mm", "grouped_mm_fused", "grouped_mm_fused_scatter", "expert_tiles",
                               "expert_tiles_silu"})
# Hugging Face's sparse-MoE block classes this block replaces.
SPARSE_MOE_BLOCKS = frozenset({"Qwen3_5MoeSparseMoeBlock", "Qwen3NextSparseMoeBlock"})


class PackedSparseMoe(nn.Module):
    """Adopts the router, experts, shared expert and shared-expert gate of a Hugging Face block.

    They stay submodules under their Hugging Face names (``gate.weight``, ``experts.gate_up_proj``,
    ...), so parameter names, FSDP sharding and weight loading see the same model; only the
    forward is packscore's.
    """

    def __init__(self, source: nn.Module, backends: KernelBackends):
        super().__init__()
        router, experts = source.gate, source.experts
        if not _is_silu(experts.act_fn):
            raise ValueError(f"packed MoE supports SiLU experts, got {type(experts.act_fn).__name__}")
        for flag, wanted in (("has_bias", False), ("has_gate", True), ("is_transposed", False), ("is_concatenated", True)):
            if getattr(experts, flag, wanted) != wanted:
                raise ValueError(f"packed MoE expects experts with {flag}={wanted}")
        self.top_k = router.top_k
        self.num_experts = router.num_experts
        self.normalise_top_k = getattr(router, "norm_topk_prob", True)  # Qwen3.5-MoE's router always does
        self.gate = router  # weight [E, D]
        self.experts = experts  # gate_up_proj [E, 2I, D] (gate rows, then up rows), down_proj [E, D, I]
        self.shared_expert = source.shared_expert
        self.shared_expert_gate = source.shared_expert_gate
        if backends.moe_experts in CUDA_BF16_EXPERTS and experts.gate_up_proj.dtype != torch.bfloat16:
            raise ValueError(f"the {backends.moe_experts} experts need bfloat16 weights, got {experts.gate_up_proj.dtype}; "
                             "use --kernels moe_experts=tiled")
        self.experts_fn = backends.fn("moe_experts")
        # With the tiled experts (the CPU reference) the router, shared expert and its gate run in
        # row tiles too: a CPU BLAS rounds a product of a few rows differently, and tiles keep a
        # token's numbers fixed under sequence parallelism as well, where segments are cut.
        self.tiled = backends.moe_experts == "tiled"
        self.gate_projection_fn = backends.fn("gate_projection")
        self.run_limits = NO_RUNS  # rows a narrow product may span under ``runs``: ``use_run_limits``
        self.top_k_fn = backends.fn("moe_router")
        self.shared_fn = backends.fn("moe_shared")
        # On a linked row the router and shared gate share one gather of x (``forward``); the shared
        # gate's output then comes from this stream, so only where the shared expert runs on it too.
        self.merged_narrow = not self.tiled and backends.moe_shared == "inline"
        self.ops = ModuleOps(backends.fn("elementwise")())

    def route(self, x_TD: torch.Tensor, packed: PackedBatch, sp=None, logits_TE=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_w_TK, top_i_TK)``: routing weights (model dtype) and expert ids, as Hugging Face's router
        (from ``logits_TE`` where the router's product already ran)."""
        if logits_TE is None:
            logits_TE = self._narrow(self._router_product(), x_TD, packed, sp)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        top_w_TK, top_i_TK = self.top_k_fn(probs_TE, self.top_k)  # torch.topk's answer, ties included
        if self.normalise_top_k:
            top_w_TK = top_w_TK / top_k_total(top_w_TK)
        return top_w_TK.to(logits_TE.dtype), top_i_TK

    def _router_product(self):
        """The router's logits product (its ``weight`` keyword is what ``RunLimits`` reads)."""
        return functools.partial(F.linear, weight=self.gate.weight)

    def narrow_weights(self) -> tuple[torch.Tensor, ...]:
        """The router's and shared gate's weights where they run per segment, whose rounding then
        follows the sequence's length (``model_runtime.scoring.rounding``); none in tiles or with a
        row-invariant gate-projection backend (``tiles``)."""
        return () if self.tiled or row_invariant(self.gate_projection_fn) else (self.gate.weight, self.shared_expert_gate.weight)

    def use_run_limits(self, limits: RunLimits) -> None:
        """The rows one narrow product may span under the ``runs`` backend (``rounding.prepare_runs``)."""
        self.run_limits = limits

    def _narrow(self, linear, x_TD: torch.Tensor, packed: PackedBatch, sp=None) -> torch.Tensor:
        """A narrow product (router, shared gate): in tiles, or by the ``gate_projection`` kernel
        per segment (``narrow_products``: a row's prefix links followed, a shard's segments cut)."""
        if self.tiled:
            return in_row_tiles(linear, x_TD)
        return narrow_products(self.gate_projection_fn, (linear,), x_TD, packed, shard_segments(x_TD, packed, sp),
                               self.run_limits)[0]

    def forward(self, x_TD: torch.Tensor, packed: PackedBatch, sp=None) -> torch.Tensor:
        logits_TE = gate_T1 = None
        if packed.links is not None and sp is None and self.merged_narrow:
            # A linked row's narrow products run over its whole sequences: one gather of x for both.
            logits_TE, gate_T1 = narrow_products(
                self.gate_projection_fn, (self._router_product(), self.shared_expert_gate), x_TD, packed,
                limits=self.run_limits)
        shared = self.shared_fn(functools.partial(self._shared, x_TD, packed, sp, gate_T1))
        top_w_TK, top_i_TK = self.route(x_TD, packed, sp, logits_TE)
        # routed + gate * shared, added by the experts' kernel (the fused one in its top-k sum's pass)
        return self.experts_fn(x_TD, top_i_TK, top_w_TK, self.experts.gate_up_proj, self.experts.down_proj,
                               shared=shared)

    def _shared(self, x_TD: torch.Tensor, packed: PackedBatch, sp=None, gate_T1=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_T1, shared_TD)``: the shared expert's gate and output (the gate from ``gate_T1``,
        its product's output, where that already ran)."""
        shared_mlp = functools.partial(self.ops.mlp, self.shared_expert)
        shared_TD = in_row_tiles(shared_mlp, x_TD) if self.tiled else shared_mlp(x_TD)
        if gate_T1 is None:
            gate_T1 = self._narrow(self.shared_expert_gate, x_TD, packed, sp)
        return _sigmoid_per_row(gate_T1), shared_TD


def top_k_total(w_TK: torch.Tensor) -> torch.Tensor:
    """``w_TK.sum(-1, keepdim=True)`` (Hugging Face's renormalisation) in the order PyTorch's own
    reduction adds K float32 values on the device, written out so that no kernel heuristic can
    change it with the number of rows.

    On CUDA a reduction over a short contiguous dimension runs on ``L`` lanes (the largest power
    of two <= K, at most a warp): lane ``t`` adds ``w[t], w[t + L], ...`` in turn, then the lanes
    are folded by warp shuffles at offsets ``L/2, ..., 1``; for K = 8 that is
    ``((w0 + w4) + (w2 + w6)) + ((w1 + w5) + (w3 + w7))`` (equal to ``torch.sum`` on every row in
    tests/gpu/test_moe_fused.py; a sum in top-k order differs from it on about 4 rows in 10, and
    after the division and the cast a routing weight by one bf16 step now and then). On the CPU,
    in top-k order: PyTorch's CPU sum adds a row of up to 8 values that way (measured on an AVX-512
    machine), a longer one (K = 10) in vector lanes that follow the instruction set, so the CPU
    keeps one fixed order rather than follow each machine's.
    """
    columns = [w_TK[:, k : k + 1] for k in range(w_TK.shape[-1])]
    if w_TK.device.type == "cuda":
        return lane_tree_sum(columns)
    total_T1 = columns[0]
    for c in columns[1:]:
        total_T1 = total_T1 + c
    return total_T1


def lane_tree_sum(values: list):
    """The sum of ``values`` as a CUDA reduction over one short row adds them (``top_k_total``)."""
    lanes = min(1 << (len(values).bit_length() - 1), 32)
    acc = list(values[:lanes])
    for k in range(lanes, len(values)):
        acc[k % lanes] = acc[k % lanes] + values[k]
    while lanes > 1:
        lanes //= 2
        acc = [acc[t] + acc[t + lanes] for t in range(lanes)]
    return acc[0]


def _sigmoid_per_row(g_T1: torch.Tensor) -> torch.Tensor:
    """``sigmoid(g_T1)``, each value computed the same way whatever its position in the row.

    A CPU elementwise kernel takes a row's tail (its last few elements) through scalar code
    that rounds differently from the SIMD body; with one value per token, which tokens fall in
    the tail would depend on the row. Repeated across a whole SIMD block, every value is in the body.
    """
    if g_T1.device.type != "cpu":
        return torch.sigmoid(g_T1)
    return torch.sigmoid(g_T1.expand(-1, _SIMD_BLOCK).contiguous())[:, :1]


_SIMD_BLOCK = 64  # elements: a multiple of the widest CPU loop step (2 x 16 float32 lanes)
