"""Routed experts of a sparse-MoE block: every token's output independent of the row it is in.

Legend: T = tokens of the (local) row, D = hidden size, E = experts, K = experts per token,
I = an expert's intermediate size, S = T * K routed (token, expert) pairs, R = rows handed to a
grouped product.

Every backend computes Hugging Face's per-token arithmetic (its ``grouped_mm`` experts path):
``gate, up = x @ gate_up[e].T`` (rounded to the model dtype), ``silu(gate) * up`` (each rounded),
``@ down[e].T`` (rounded), times the routing weight (rounded), then the K weighted rows of a
token summed in float32 (in the order of ``combine_top_k``) and rounded once. What they add is
that no step's arithmetic depends on how many tokens an expert received:

- ``tiled`` (the reference; any device and dtype): each expert's tokens go through the two
  products in zero-padded tiles of ``TILE_ROWS`` rows, so every product has the same shape
  whatever the count (a CPU BLAS rounds products of a few rows differently from larger ones).
- ``grouped_mm`` (CUDA, bfloat16): one ``torch._grouped_mm`` per product over all experts.
  PyTorch picks its CUTLASS tile configuration from the mean rows per expert
  (``rows / E``, thresholds 64 and 128); a tail of rows past the last expert's offset, which
  the kernel never reads or writes, keeps that mean above 128, so every row count runs the
  same configuration (no split-K in any of them).
- ``grouped_mm_fused`` (CUDA, bfloat16): the same two products, and ``grouped_mm``'s numbers
  bit for bit (``grouped_mm_fused_scatter``, the CUDA default where ``expert_tiles`` cannot run:
  the same with the products' input rows written from the tokens' side, each token's row read
  once instead of K times); the gather
  of the rows, the SiLU product, the weighting, the top-k sum and the
  block's ``routed + gate * shared`` run in one pass each (model_runtime/kernels/moe_triton.py)
  instead of the composition's many over ``[S, D]`` and ``[T, D]``.
- ``expert_tiles`` (CUDA, bfloat16, Hopper; where its library is built): the scattered
  fused path with each expert's rows starting on a multiple of a tile's rows, and both products
  in packscore's CUTLASS kernel over that layout (model_runtime/kernels/expert_gemm.py): the same
  K order, so ``grouped_mm``'s numbers bit for bit, without the grouped kernel's per-expert
  descriptor rewrites.
- ``expert_tiles_silu`` (the same GPUs, the default where the library's SiLU layout check
  passes): ``silu(gate) * up`` in the gate/up product's epilogue (``expert_gemm.expert_mm_silu``)
  instead of a pass of its own; the same numbers bit for bit.

Every backend takes ``shared = (gate_T1, shared_TD)``, or a function returning it (called only
where the backend adds it), and then returns the block's output, ``routed + gate * shared``
(``add_shared``): the fused one adds it in the top-k sum's pass.

Where the shared expert runs is its own family, ``moe_shared``: ``inline`` (before the routed
experts, on the current stream) or ``stream`` (CUDA: on a second stream, beside the router and
the rows' scatter, which leave the tensor cores idle; the same kernels, so the same numbers).

The K weighted rows of a token are summed in a fixed order written out (``combine_top_k``: the
order PyTorch's CUDA reduction uses, on the CPU top-k order), float32, not by a reduction kernel
whose split could depend on the number of tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

TILE_ROWS = 32
# grouped_mm's largest configuration is taken above this many rows per expert on average.
GROUPED_MM_LARGE_CONFIG_ROWS = 129


def routed_pairs(top_i_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order_S, ends_E)``: pair ids (``t * K + k``) sorted by expert, and where each expert's
    pairs end in that order (the grouped products' offsets)."""
    flat_S = top_i_TK.reshape(-1)
    sorted_S, order_S = torch.sort(flat_S, stable=True)
    # Counted from the sorted ids (where each expert's run ends): bincount reads the largest id
    # back to the host (a sync on CUDA), a scatter_add of S ones into E bins contends on atomics.
    experts_E = torch.arange(num_experts, dtype=sorted_S.dtype, device=sorted_S.device)
    return order_S, torch.searchsorted(sorted_S, experts_E, right=True)


# CUDA's reduction over a strided dimension keeps this many float32 accumulators per output.
CUDA_SUM_ACCUMULATORS = 4


def combine_top_k(weighted_SD: torch.Tensor, num_tokens: int, dtype: torch.dtype,
                  cuda_order: bool | None = None) -> torch.Tensor:
    """``[T, D]``: each token's K weighted expert rows summed in float32, in the order Hugging
    Face's ``.view(T, K, D).sum(dim=1)`` adds them on the device (``cuda_order``, default: the
    tensor's device): on CUDA, row k into accumulator ``k % 4`` (each from +0.0), then the four
    accumulators in turn, as PyTorch's reduction kernel unrolls a strided dimension (measured
    equal to ``torch.sum`` on every element for K = 8 and 10 on an H200; checked by
    tests/gpu/test_moe_fused.py); on the CPU in top-k order."""
    w_TKD = weighted_SD.view(num_tokens, -1, weighted_SD.shape[-1])
    K = w_TKD.shape[1]
    if cuda_order if cuda_order is not None else weighted_SD.device.type == "cuda":
        # 0.0 + w first (a -0.0 row becomes +0.0); an accumulator that no row reaches stays +0.0
        # and adding it changes nothing, so only min(K, 4) are kept
        acc = [w_TKD[:, j].float().add_(0.0) for j in range(min(K, CUDA_SUM_ACCUMULATORS))]
        for k in range(CUDA_SUM_ACCUMULATORS, K):
            acc[k % CUDA_SUM_ACCUMULATORS] = acc[k % CUDA_SUM_ACCUMULATORS] + w_TKD[:, k]
        acc_TD = acc[0]
        for a in acc[1:]:
            acc_TD = acc_TD + a
        return acc_TD.to(dtype)
    acc_TD = w_TKD[:, 0].float()
    for k in range(1, K):
        acc_TD = acc_TD + w_TKD[:, k]
    return acc_TD.to(dtype)


def experts_tiled(
    x_TD: torch.Tensor,
    top_i_TK: torch.Tensor,
    top_w_TK: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    tile_rows: int = TILE_ROWS,
) -> torch.Tensor:
    """Routed experts' output ``[T, D]`` with every product over a ``[tile_rows, D]`` tile
    (``shared``: see ``add_shared``)."""
    T, K = top_i_TK.shape
    D, I = x_TD.shape[1], down_EDI.shape[2]
    order_S, ends_E = routed_pairs(top_i_TK, gate_up_E2ID.shape[0])
    w_S = top_w_TK.reshape(-1)
    weighted_SD = x_TD.new_empty(T * K, D)
    start = 0
    for e, end in enumerate(ends_E.tolist()):
        for t0 in range(start, end, tile_rows):
            pairs = order_S[t0 : min(end, t0 + tile_rows)]
            x_tile = x_TD.new_zeros(tile_rows, D)
            x_tile[: len(pairs)] = x_TD[pairs // K]
            gate, up = F.linear(x_tile, gate_up_E2ID[e]).split(I, dim=-1)
            y_tile = F.linear(F.silu(gate) * up, down_EDI[e])
            weighted_SD[pairs] = y_tile[: len(pairs)] * w_S[pairs, None]
        start = end
    return add_shared(combine_top_k(weighted_SD, T, x_TD.dtype), shared)


def shared_inline(compute):
    """``moe_shared=inline``: runs ``compute()`` now; returns a function giving its result."""
    result = compute()
    return lambda: result


def shared_side_stream(compute):
    """``moe_shared=stream``: enqueues ``compute()`` on a second stream of the current device,
    after everything enqueued so far; the function returned makes the current stream wait for it.

    Its tensors are allocated on the second stream and freed after the current stream used them;
    the next call's wait (the second stream after the current one) keeps a reuse of that memory
    behind that use.
    """
    main = torch.cuda.current_stream()
    side = _side_stream(main.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = compute()

    def ready():
        main.wait_stream(side)
        return result

    return ready


@functools.cache
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device=device)


def in_row_tiles(fn, x_TD: torch.Tensor, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """``fn(x_TD)`` for a per-row ``fn``, applied to zero-padded ``[tile_rows, D]`` tiles: the
    ``tiled`` backend's way to give the block's other products one shape whatever the row."""
    T = x_TD.shape[0]
    padded = x_TD.new_zeros(-(-T // tile_rows) * tile_rows, x_TD.shape[1])
    padded[:T] = x_TD
    return torch.cat([fn(tile) for tile in padded.split(tile_rows)])[:T]


def _grouped_mm(x_RD: torch.Tensor, w_EDN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # The public name where torch has it, else the private one (what Hugging Face calls too).
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x_RD, w_EDN, offs=offsets_E)


def _bf16_on_cuda(x_TD: torch.Tensor, backend: str) -> None:
    """Refuses, naming ``backend`` and the way out, activations the grouped backends' kernels do not take."""
    if x_TD.device.type != "cuda" or x_TD.dtype != torch.bfloat16:
        raise ValueError(f"the {backend} experts need bfloat16 on CUDA, got {x_TD.dtype} on {x_TD.device.type}; "
                         "use --kernels moe_experts=tiled")


def experts_grouped_mm(
    x_TD: torch.Tensor,
    top_i_TK: torch.Tensor,
    top_w_TK: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    fused: bool = False,
    scatter: bool = False,
) -> torch.Tensor:
    """Routed experts' output ``[T, D]`` through two grouped products of one fixed configuration
    (``shared``: see ``add_shared``); ``fused``: the same numbers bit for bit, with the steps around
    the two products in Triton kernels (model_runtime/kernels/moe_triton.py) that move a fraction
    of the memory; ``scatter`` (with ``fused``): the products' input rows written from the tokens'
    side (``moe_triton.scatter_rows``) instead of gathered."""
    _bf16_on_cuda(x_TD, ("grouped_mm_fused_scatter" if scatter else "grouped_mm_fused") if fused else "grouped_mm")
    return grouped_experts(x_TD, top_i_TK, top_w_TK, gate_up_E2ID, down_EDI, shared, fused=fused, scatter=scatter)


experts_grouped_mm_fused = functools.partial(experts_grouped_mm, fused=True)
experts_grouped_mm_fused_scatter = functools.partial(experts_grouped_mm, fused=True, scatter=True)


def experts_expert_tiles(x_TD, top_i_TK, top_w_TK, gate_up_E2ID, down_EDI, shared=None, library=None) -> torch.Tensor:
    """``grouped_mm_fused_scatter``'s numbers bit for bit, its two products in packscore's CUTLASS
    kernel over a tile-aligned expert layout (``expert_gemm``; ``library``: the file the backend
    choice bound, ``KernelBackends.expert_gemm``)."""
    from model_runtime.kernels import expert_gemm

    _bf16_on_cuda(x_TD, "expert_tiles")
    return grouped_experts(x_TD, top_i_TK, top_w_TK, gate_up_E2ID, down_EDI, shared, fused=True, scatter=True,
                           tiled=expert_gemm.cutlass_product(library=library))


def experts_expert_tiles_silu(x_TD, top_i_TK, top_w_TK, gate_up_E2ID, down_EDI, shared=None, library=None) -> torch.Tensor:
    """``expert_tiles`` with ``silu(gate) * up`` computed in the gate/up product's epilogue
    (``expert_gemm.expert_mm_silu``): the same numbers, one pass over the gate/up outputs fewer.
    I must be a multiple of 64 (``expert_tiles`` otherwise)."""
    from model_runtime.kernels import expert_gemm

    _bf16_on_cuda(x_TD, "expert_tiles_silu")
    silu = down_EDI.shape[2] % expert_gemm.SILU_PAIR_COLUMNS == 0
    return grouped_experts(x_TD, top_i_TK, top_w_TK, gate_up_E2ID, down_EDI, shared, fused=True, scatter=True,
                           tiled=expert_gemm.cutlass_product(silu=silu, library=library))


def add_shared(routed_TD: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The block's output from its routed experts' and, with ``shared = (gate_T1, shared_TD)``,
    its gated shared expert: ``routed + gate * shared`` (each step rounded to the dtype)."""
    shared = shared_tensors(shared)
    if shared is None:
        return routed_TD
    gate_T1, shared_TD = shared
    return routed_TD + gate_T1 * shared_TD


def shared_tensors(shared):
    """``(gate_T1, shared_TD)`` or None from what a backend was given: the pair, None, or a
    function returning the pair (``moe_shared``), called here, where the backend adds it."""
    return shared() if callable(shared) else shared


def grouped_experts(
    x_TD: torch.Tensor,
    top_i_TK: torch.Tensor,
    top_w_TK: torch.Tensor,
    gate_up_E2ID: torch.Tensor,
    down_EDI: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    fused: bool,
    scatter: bool = False,
    tiled=None,
) -> torch.Tensor:
    """The two grouped products with the steps around them in PyTorch (``fused=False``) or in the
    Triton kernels (``fused=True``; ``scatter``: the input rows written by ``scatter_rows``); with
    ``tiled`` (an ``expert_gemm.TiledProduct``, with ``fused`` and ``scatter``) the rows laid out so
    that every expert starts on a multiple of its tile's rows and both products run through it. No
    device check, so that the CPU interpreter tests run them all."""
    T, K = top_i_TK.shape
    E, D, I = gate_up_E2ID.shape[0], x_TD.shape[1], down_EDI.shape[2]
    order_S, ends_E = routed_pairs(top_i_TK, E)
    S = T * K
    if fused and top_w_TK.dtype != x_TD.dtype:
        raise ValueError(f"the fused experts take routing weights in the model dtype {x_TD.dtype}, got {top_w_TK.dtype}")
    if tiled is None:
        offsets_E = ends_E.to(torch.int32)
        rows, computed = max(S, GROUPED_MM_LARGE_CONFIG_ROWS * E), S  # rows past offsets[-1] are never computed

        def product(x_RK, w_ENK):
            return _grouped_mm(x_RK, w_ENK.transpose(-2, -1), offsets_E)
    else:
        if not (fused and scatter):
            raise ValueError("the tile-aligned layout runs on the fused path with scattered rows only")
        from model_runtime.kernels import expert_gemm

        counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
        rows = computed = expert_gemm.layout_rows(S, E, tiled.tile_rows)  # padding rows are computed, never read
        starts_E, tile_expert_M = expert_gemm.expert_layout(counts_E, tiled.tile_rows, rows)

        def product(x_RK, w_ENK):
            return tiled.mm(x_RK, w_ENK.contiguous(), tile_expert_M)
    x_RD = x_TD.new_empty(rows, D)
    if fused:
        from model_runtime.kernels import moe_triton

        # pos_S[t * K + k]: where pair (t, k) sits in the sorted rows (the inverse of order_S)
        pos_S = torch.empty_like(order_S).index_copy_(0, order_S, torch.arange(S, device=order_S.device))
        if tiled is not None:  # moved on by the padding of the experts before the pair's own
            pos_S += (starts_E - (ends_E - counts_E))[top_i_TK.reshape(-1)]
    if fused and scatter:
        moe_triton.scatter_rows(x_TD, pos_S.view(T, K), x_RD)
    else:
        torch.index_select(x_TD, 0, order_S // K, out=x_RD[:S])  # gathered straight into the product's rows
    if tiled is not None and tiled.mm_silu is not None:  # the SiLU product in the gate/up product's epilogue
        h_RI = tiled.mm_silu(x_RD, gate_up_E2ID.contiguous(), tile_expert_M)
    elif fused:
        gate_up_R2I = product(x_RD, gate_up_E2ID)
        h_RI = moe_triton.silu_mul_rows(gate_up_R2I, computed)  # the rows no product computed are never read
    else:
        gate_up_R2I = product(x_RD, gate_up_E2ID)
        h_RI = F.silu(gate_up_R2I[:, :I]) * gate_up_R2I[:, I:]
    y_RD = product(h_RI, down_EDI)
    if not fused:
        weighted_SD = torch.empty_like(x_RD[:S])
        weighted_SD[order_S] = y_RD[:S] * top_w_TK.reshape(-1)[order_S, None]
        return add_shared(combine_top_k(weighted_SD, T, x_TD.dtype), shared)
    shared = shared_tensors(shared)
    if shared is not None:
        shared = tuple(t.contiguous() for t in shared)
    return moe_triton.combine_top_k(y_RD, pos_S.view(T, K), top_w_TK.contiguous(), shared)
