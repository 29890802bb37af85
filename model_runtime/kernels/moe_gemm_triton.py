"""The routed experts' two grouped products in Triton, with the row gather and the SiLU product
inside the first (``moe_experts=triton_grouped``, opt-in until an H200 shows it equal and faster).

Legend: T = tokens, D = hidden size, E = experts, K = experts per token, I = an expert's
intermediate size, S = T * K routed pairs (rows of the products, sorted by expert).

Why: around ``torch._grouped_mm`` the served path (``grouped_mm_fused_scatter``) still writes the
first product's input rows (``[S, D]``, each token's row at its K places) and reads its output
back for ``silu(gate) * up`` (``[S, 2I]``): at 64k tokens 0.66 + 0.41 ms of an 8.3 ms block. Here
the first product reads each row straight from ``x`` through the routing order and writes
``silu(gate) * up`` from its accumulators; the second is a plain grouped product whose output the
served ``moe_triton.combine_top_k`` weights and sums as before.

The numbers are meant to be ``grouped_mm``'s bit for bit: CUTLASS and Triton both accumulate each
output in float32 through the tensor cores' k16 steps in order along the reduction (on the H200,
``torch._grouped_mm``'s tile configurations give equal products whatever the tile; docs/moe.md),
round once to the dtype, and the epilogue rounds as ``moe_triton.silu_mul_rows`` does.
tests/gpu/test_moe_fused.py checks it on the GPU; in Triton's CPU interpreter the products are
NumPy's, so there tests/unit/test_moe_triton_interpret.py checks the indexing, the tiles and the
epilogue against a model within a bf16 step.

Tiles: the rows of each expert are cut into tiles of ``BLOCK_M``; program ``(m, n)`` (n fastest
in a one-dimensional launch) finds its expert by a binary search over the experts' cumulative tile counts (``tile_ends``), so one launch
covers every expert whatever its count, without a read back to the host.
"""

from __future__ import annotations

import torch

try:  # the CPU install has no Triton: only the GPU path (and the interpreter tests) use these
    import triton
    import triton.language as tl

    from model_runtime.kernels import triton_math
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of each product (``tile=None``); any tile gives the
# same numbers.
GATE_UP_TILE = (256, 64, 64, 8, 3)  # two accumulators (gate and up columns) of BLOCK_N each
DOWN_TILE = (128, 256, 64, 8, 3)

if triton is not None:
    @triton.jit
    def _tile_expert(tile_ends_ptr, pid, E: tl.constexpr):
        """The expert whose tiles hold tile ``pid``: the first e with tile_ends[e] > pid."""
        lo = 0
        hi = E
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(tile_ends_ptr + mid) > pid:
                hi = mid
            else:
                lo = mid + 1
        return lo

    @triton.jit
    def _tile_of_program(n_tiles):
        """``(m, n)`` of this program in a one-dimensional launch, n fastest: the column tiles of one
        row tile run side by side, so its rows (gathered from anywhere in ``x``) come from memory
        once and then from L2."""
        pid = tl.program_id(0)
        return pid // n_tiles, pid % n_tiles

    @triton.jit
    def _tile_rows(tile_ends_ptr, offsets_ptr, pid, E: tl.constexpr, BLOCK_M: tl.constexpr):
        """``(e, first, rows, row_ok)`` of tile ``pid``: its expert, its first row, its BLOCK_M row
        indices and which of them are the expert's (the last tile of an expert is partial)."""
        e = _tile_expert(tile_ends_ptr, pid, E)
        first_tile = tl.where(e > 0, tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0), 0)
        row_start = tl.where(e > 0, tl.load(offsets_ptr + e - 1, mask=e > 0, other=0), 0)
        first = row_start + (pid - first_tile) * BLOCK_M
        rows = first + tl.arange(0, BLOCK_M)
        return e, first, rows, rows < tl.load(offsets_ptr + e)

    @triton.jit
    def _gate_up_silu_kernel(x_ptr, tok_ptr, w, offsets_ptr, tile_ends_ptr, h_ptr,
                             stride_x, stride_we, stride_wn, stride_h, D: tl.constexpr, I: tl.constexpr,
                             E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             CUDA_MATH: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):
        # w: the weights [E, 2I, D] as a pointer, or with TMA (sizes the tiles divide) a descriptor
        # of them as [E * 2I, D]; a partial tile along I or D is masked (pointers only)
        pid_m, pid_n = _tile_of_program((I + BLOCK_N - 1) // BLOCK_N)
        if pid_m >= tl.load(tile_ends_ptr + E - 1):
            return
        e, first, rows, row_ok = _tile_rows(tile_ends_ptr, offsets_ptr, pid_m, E, BLOCK_M)
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # the token of each routed row
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_x + ks[None, :]
        gate_row = e * (2 * I) + pid_n * BLOCK_N  # descriptor rows of this tile's gate columns
        store_ok = row_ok[:, None]
        if not TMA:
            w_e = w + e.to(tl.int64) * stride_we
            g_ptrs = w_e + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] of gate rows
            u_ptrs = g_ptrs + I * stride_wn  # the up rows follow the gate rows
            if I % BLOCK_N != 0:
                store_ok = store_ok & (cols < I)[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):  # along the reduction in order, as the grouped product
            if TMA:
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
                bg = tl.trans(w.load([gate_row, k0]))
                bu = tl.trans(w.load([gate_row + I, k0]))
            elif D % BLOCK_K == 0 and I % BLOCK_N == 0:
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
                bg = tl.load(g_ptrs + k0)
                bu = tl.load(u_ptrs + k0)
            else:  # zeros past D and past I (a zero adds nothing to a float32 sum)
                k_ok = ks < D - k0
                b_ok = k_ok[:, None] & (cols < I)[None, :]
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                bg = tl.load(g_ptrs + k0, mask=b_ok, other=0.0)
                bu = tl.load(u_ptrs + k0, mask=b_ok, other=0.0)
            if UPCAST:  # the interpreter's dot would multiply bf16's bit patterns
                a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        # the first product's output rounded, then moe_triton.silu_mul_rows's arithmetic
        g = acc_g.to(h_ptr.dtype.element_ty)
        u = acc_u.to(h_ptr.dtype.element_ty)
        act = triton_math.silu(g.to(tl.float32), CUDA_MATH).to(g.dtype)
        h = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h, mask=store_ok)

    @triton.jit
    def _down_kernel(h, w, offsets_ptr, tile_ends_ptr, y_ptr,
                     stride_h, stride_we, stride_wn, stride_y, D: tl.constexpr, I: tl.constexpr,
                     E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, TMA: tl.constexpr):
        # h, w: the rows [S, I] and the weights [E, D, I] as pointers, or with TMA (sizes the tiles
        # divide) descriptors of h and of the weights as [E * D, I]: a tile's rows past its
        # expert's end are then read (the next expert's, or zeros past S) but never stored
        pid_m, pid_n = _tile_of_program((D + BLOCK_N - 1) // BLOCK_N)
        if pid_m >= tl.load(tile_ends_ptr + E - 1):
            return
        e, first, rows, row_ok = _tile_rows(tile_ends_ptr, offsets_ptr, pid_m, E, BLOCK_M)
        rows = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        w_row = e * D + pid_n * BLOCK_N
        store_ok = row_ok[:, None]
        if not TMA:
            a_ptrs = h + rows[:, None] * stride_h + ks[None, :]
            b_ptrs = w + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
            if D % BLOCK_N != 0:
                store_ok = store_ok & (cols < D)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if TMA:
                a = h.load([first, k0])
                b = tl.trans(w.load([w_row, k0]))
            elif I % BLOCK_K == 0 and D % BLOCK_N == 0:
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs + k0)
            else:  # zeros past I and past D
                k_ok = ks < I - k0
                a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & (cols < D)[None, :], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=store_ok)


def _require_triton():
    if triton is None:
        raise RuntimeError("the Triton grouped experts need triton")


def tile_ends(offsets_E: torch.Tensor, block_m: int) -> torch.Tensor:
    """Cumulative tile counts per expert (int32 ``[E]``) from the cumulative row counts ``offsets_E``."""
    counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return torch.cumsum(-(-counts // block_m), dim=0, dtype=torch.int32)


def _meta(tile, weights: torch.Tensor, divides: bool) -> dict:
    """A launch's tile, warps and stages (``tile``: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages and
    optionally TMA: the weights, and the down product's rows, read by tensor-memory-accelerator
    descriptors instead of pointers; only for contiguous weights whose sizes the tile ``divides``);
    ``UPCAST`` under the interpreter (its dot would multiply bf16's bit patterns); on a GPU libdevice without flush-to-zero and no FMA contraction, as nvcc
    builds ATen's kernels (the SiLU epilogue)."""
    block_m, block_n, block_k, warps, stages = tile[:5]
    interpreted = bool(triton.knobs.runtime.interpret)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=interpreted, num_warps=warps, num_stages=stages,
                TMA=len(tile) > 5 and bool(tile[5]) and divides and weights.is_contiguous())
    if not interpreted:
        meta.update(enable_fp_fusion=False, enable_reflect_ftz=False)
    return meta


def _descriptor(t: torch.Tensor, block_shape: list) -> "TensorDescriptor":
    """A host-side TMA descriptor of the 2-D ``t`` (contiguous: a weight's ``view``) in tiles of ``block_shape``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block_shape)


def _max_tiles(rows: int, experts: int, block_m: int) -> int:
    """An upper bound of the tiles, known on the host: every expert's partial tile at most once."""
    return -(-rows // block_m) + experts


def gate_up_silu(x_TD: torch.Tensor, tok_S: torch.Tensor, offsets_E: torch.Tensor, gate_up_E2ID: torch.Tensor,
                 tile=None) -> torch.Tensor:
    """``[S, I]``: for each routed row r (sorted by expert, ``offsets_E`` the cumulative rows per
    expert), ``silu(gate) * up`` of ``x_TD[tok_S[r]] @ gate_up_E2ID[e].T`` (gate columns, then up
    columns), each step rounded to the dtype as Hugging Face's grouped_mm experts round.

    >>> h = gate_up_silu(x, (order // K).int(), offsets, experts.gate_up_proj)
    """
    _require_triton()
    S, (E, two_i, D) = tok_S.shape[0], gate_up_E2ID.shape
    I = two_i // 2
    block_m, block_n, block_k = (tile or GATE_UP_TILE)[:3]
    if (x_TD.shape[1] != D or x_TD.dtype != gate_up_E2ID.dtype or x_TD.stride(1) != 1 or gate_up_E2ID.stride(2) != 1
            or offsets_E.shape != (E,) or tok_S.dim() != 1 or two_i % 2):
        raise ValueError(f"gate_up_silu takes x [T, D], weights [E, 2I, D] of x's dtype (unit last strides), tok [S] "
                         f"and offsets [E]; got x {tuple(x_TD.shape)} "
                         f"{x_TD.dtype}, weights {tuple(gate_up_E2ID.shape)} {gate_up_E2ID.dtype}, tok {tuple(tok_S.shape)}, "
                         f"offsets {tuple(offsets_E.shape)}")
    h_SI = x_TD.new_empty(S, I)
    if S == 0:
        return h_SI
    grid = (_max_tiles(S, E, block_m) * -(-I // block_n),)
    meta = _meta(tile or GATE_UP_TILE, gate_up_E2ID, D % block_k == 0 and I % block_n == 0)
    w = _descriptor(gate_up_E2ID.view(E * two_i, D), [block_n, block_k]) if meta["TMA"] else gate_up_E2ID
    _gate_up_silu_kernel[grid](x_TD, tok_S, w, offsets_E, tile_ends(offsets_E, block_m), h_SI,
                               x_TD.stride(0), gate_up_E2ID.stride(0), gate_up_E2ID.stride(1), h_SI.stride(0), D=D, I=I,
                               E=E, CUDA_MATH=not meta["UPCAST"], **meta)
    return h_SI


def down(h_SI: torch.Tensor, offsets_E: torch.Tensor, down_EDI: torch.Tensor, tile=None) -> torch.Tensor:
    """``[S, D]``: each routed row of ``h_SI`` times its expert's ``down_EDI[e].T``, rounded once.

    >>> y = down(h, offsets, experts.down_proj)
    """
    _require_triton()
    S, (E, D, I) = h_SI.shape[0], down_EDI.shape
    block_m, block_n, block_k = (tile or DOWN_TILE)[:3]
    if (h_SI.shape[1] != I or h_SI.dtype != down_EDI.dtype or h_SI.stride(1) != 1 or down_EDI.stride(2) != 1
            or offsets_E.shape != (E,)):
        raise ValueError(f"down takes h [S, I] and weights [E, D, I] of h's dtype (unit last strides) and offsets [E], "
                         f"got h {tuple(h_SI.shape)} {h_SI.dtype}, "
                         f"weights {tuple(down_EDI.shape)} {down_EDI.dtype}, offsets {tuple(offsets_E.shape)}")
    y_SD = h_SI.new_empty(S, D)
    if S == 0:
        return y_SD
    grid = (_max_tiles(S, E, block_m) * -(-D // block_n),)
    meta = _meta(tile or DOWN_TILE, down_EDI, I % block_k == 0 and D % block_n == 0)
    h, w = h_SI, down_EDI
    if meta["TMA"]:
        h, w = _descriptor(h_SI, [block_m, block_k]), _descriptor(down_EDI.view(E * D, I), [block_n, block_k])
    _down_kernel[grid](h, w, offsets_E, tile_ends(offsets_E, block_m), y_SD, h_SI.stride(0), down_EDI.stride(0),
                       down_EDI.stride(1), y_SD.stride(0), D=D, I=I, E=E, **meta)
    return y_SD
