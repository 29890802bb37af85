"""The fused MoE kernels (model_runtime/kernels/moe_triton.py) in Triton's CPU interpreter.

Each kernel is checked bit for bit against a model of its arithmetic in which every rounding to
bf16 truncates, as the interpreter's float32 -> bf16 cast does (a GPU rounds to nearest), and
SiLU's exp is NumPy's, as the interpreter's is (a GPU's is libdevice's, ATen's expf). In float32
the top-k sum and shared add are IEEE float32 operations on both sides: equal to the PyTorch
composition bit for bit. Against PyTorch in bf16 the bounds are the truncations' worst case.
Equality with the composition on the GPU, bit for bit, is tests/gpu/test_moe_fused.py's job.

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_moe_triton_interpret.py
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.interpret import only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()

DTYPES = [torch.float32, torch.bfloat16]


def to_dtype_as_interpreter(x_f32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x_f32.to(dtype)`` as the interpreter casts: bf16 by truncating the low 16 bits."""
    if dtype == torch.float32:
        return x_f32
    return (x_f32.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: low bits already zero


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns (so that -0.0 and +0.0 differ)."""
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def assert_bitwise(what: str, got: torch.Tensor, want: torch.Tensor):
    differ = int((bits(got) != bits(want)).sum())
    diff = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    assert got.shape == want.shape and differ == 0, (
        f"{what}: {differ} of {want.numel()} values differ, max |diff| {diff:.3e} (tolerance: bit for bit)")


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("S,R,I", [(37, 50, 40), (5, 5, 96), (130, 260, 512)], ids=lambda v: str(v))
def test_silu_mul_rows_follows_its_model_and_leaves_the_tail(S, R, I, dtype):
    from model_runtime.kernels import moe_triton as MT

    g = torch.Generator().manual_seed(S * I)
    gate_up = (torch.randn(R, 2 * I, generator=g) * 4).to(dtype)
    out = torch.full((R, I), 7.0, dtype=dtype)
    h = MT.silu_mul_rows(gate_up, S, out)
    assert h.data_ptr() == out.data_ptr()
    assert bool((h[S:] == 7.0).all()), "rows past num_rows were written"

    gate, up = gate_up[:S, :I].float(), gate_up[:S, I:].float()
    silu = torch.from_numpy(gate.numpy() / (np.float32(1) + np.exp(-gate.numpy())))  # float32 throughout
    want = to_dtype_as_interpreter(to_dtype_as_interpreter(silu, dtype).float() * up, dtype)
    assert_bitwise(f"silu_mul_rows {dtype} vs its model", h[:S], want)

    # against eager PyTorch: bf16, two roundings each off by less than one step (truncated here);
    # float32, only exp differs (NumPy's against PyTorch's vectorised one, an ulp or two)
    eager = F.silu(gate_up[:S, :I]) * gate_up[:S, I:]
    scale = eager.float().abs().clamp_min(1e-3)
    steps = float(((h[:S].float() - eager.float()).abs() / scale).max())
    tol = 2 * 2**-7 if dtype == torch.bfloat16 else 4 * 2**-23
    assert steps <= tol, f"silu_mul_rows {dtype} off eager by {steps:.3e} relative (tolerance {tol:.3e})"


def _combine_inputs(T, K, D, R, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(T * K, generator=g)
    pos_TK = torch.empty_like(order).index_copy_(0, order, torch.arange(T * K)).view(T, K)
    y_RD = torch.randn(R, D, generator=g).to(dtype)
    y_RD[T * K :] = float("nan")  # the never-computed tail must never be read
    w_TK = torch.rand(T, K, generator=g).to(dtype)
    # token 0: every routed row -0.0 (weights negative): the sum starts from +0.0, as PyTorch's CUDA sum does
    y_RD[pos_TK[0]] = 0.0
    w_TK[0] = -w_TK[0]
    gate_T1 = torch.rand(T, 1, generator=g).to(dtype)
    shared_TD = torch.randn(T, D, generator=g).to(dtype)
    shared_TD[0] = 0.0
    gate_T1[0] = -gate_T1[0]
    return y_RD, pos_TK, w_TK, (gate_T1, shared_TD)


def composition(y_RD, pos_TK, w_TK, shared, cast):
    """The grouped_mm backend's steps after its second product, with ``cast`` for each rounding."""
    T, K = pos_TK.shape
    dtype = y_RD.dtype
    weighted_TKD = cast(y_RD[pos_TK.reshape(-1)].float() * w_TK.reshape(-1, 1).float(), dtype).view(T, K, -1)
    acc = [torch.zeros_like(weighted_TKD[:, 0], dtype=torch.float32) for _ in range(4)]  # CUDA's sum order
    for k in range(K):
        acc[k % 4] = acc[k % 4] + weighted_TKD[:, k].float()
    out = cast(((acc[0] + acc[1]) + acc[2]) + acc[3], dtype)
    if shared is not None:
        gs = cast(shared[0].float() * shared[1].float(), dtype)
        out = cast(out.float() + gs.float(), dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "block"])
@pytest.mark.parametrize("T,K,D", [(9, 8, 2048), (13, 3, 100), (4, 2, 4100)], ids=lambda v: str(v))
def test_combine_top_k_follows_the_composition(T, K, D, with_shared, dtype):
    from model_runtime.kernels import moe_experts as ME
    from model_runtime.kernels import moe_triton as MT

    y_RD, pos_TK, w_TK, shared = _combine_inputs(T, K, D, T * K + 11, dtype, seed=T * D + K)
    shared = shared if with_shared else None
    got = MT.combine_top_k(y_RD, pos_TK, w_TK, shared)
    assert_bitwise("combine_top_k vs its model", got, composition(y_RD, pos_TK, w_TK, shared, to_dtype_as_interpreter))
    first = float(got[0].float().abs().max())
    assert first == 0.0, f"row 0 is {first:.3e} from zero (tol 0)"

    # PyTorch's own composition, as the grouped_mm backend writes it
    weighted_SD = torch.empty(T * K, D, dtype=dtype)
    order = torch.argsort(pos_TK.reshape(-1))
    weighted_SD[order] = y_RD[: T * K] * w_TK.reshape(-1)[order, None]
    eager = ME.add_shared(ME.combine_top_k(weighted_SD, T, dtype, cuda_order=True), shared)
    if dtype == torch.float32:
        assert_bitwise("combine_top_k float32 vs PyTorch", got, eager)
    else:
        # K truncated products, the sum's cast, and with shared two more: each under one step of
        # the largest magnitude in play
        scale = torch.stack([y_RD[: T * K].float().abs().max(), eager.float().abs().max()]).max()
        tol = (K + 1 + 2 * with_shared) * 2**-7 * float(scale)
        diff = float((got.float() - eager.float()).abs().max())
        assert diff <= tol, f"combine_top_k bf16 off PyTorch by {diff:.3e} (tolerance {tol:.3e})"


def test_fused_experts_equal_the_composition_float32():
    """The whole fused backend against grouped_mm's composition on the CPU (torch._grouped_mm has a
    CPU path): in float32 only SiLU's exp differs (NumPy's here), so the outputs agree to a few
    float32 ulps of the output's magnitude propagated through the down product."""
    from model_runtime.kernels import moe_experts as ME

    g = torch.Generator().manual_seed(3)
    E, D, I, K, T = 8, 64, 32, 3, 53
    gate_up, down = torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1
    x = torch.randn(T, D, generator=g)
    top_i = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    top_w = torch.rand(T, K, generator=g)
    shared = (torch.rand(T, 1, generator=g), torch.randn(T, D, generator=g))
    for sh in (None, shared):
        want = ME.grouped_experts(x, top_i, top_w, gate_up, down, sh, fused=False)
        got = ME.grouped_experts(x, top_i, top_w, gate_up, down, sh, fused=True)
        diff, tol = float((got - want).abs().max()), 1e-6 * float(want.abs().max())
        assert diff <= tol, f"fused vs composition: max |diff| {diff:.3e} (tolerance {tol:.3e})"
        scattered = ME.grouped_experts(x, top_i, top_w, gate_up, down, sh, fused=True, scatter=True)
        assert_bitwise("fused with scatter_rows vs fused with the gather", scattered, got)


@pytest.mark.parametrize("tile", [4, 16])
def test_tiled_layout_equals_the_scattered_fused_path_float32(tile):
    """``expert_tiles``' plumbing (rows moved to a tile-aligned layout, the SiLU pass and the top-k
    sum reading them there) with the plain reference product in place of the CUTLASS kernel, against
    the scattered fused path: in float32 the products differ only by the CPU BLAS's row count."""
    from model_runtime.kernels import expert_gemm
    from model_runtime.kernels import moe_experts as ME

    g = torch.Generator().manual_seed(tile)
    E, D, I, K, T = 8, 64, 32, 3, 53
    gate_up, down = torch.randn(E, 2 * I, D, generator=g) * 0.1, torch.randn(E, D, I, generator=g) * 0.1
    x = torch.randn(T, D, generator=g)
    top_i = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    top_i[:, 0] = 0  # one expert takes every token, one may take none
    top_w = torch.rand(T, K, generator=g)
    shared = (torch.rand(T, 1, generator=g), torch.randn(T, D, generator=g))
    for sh in (None, shared):
        want = ME.grouped_experts(x, top_i, top_w, gate_up, down, sh, fused=True, scatter=True)
        for silu in (False, True):  # with the SiLU product in the gate/up product (expert_tiles_silu)
            got = ME.grouped_experts(x, top_i, top_w, gate_up, down, sh, fused=True, scatter=True,
                                     tiled=expert_gemm.reference_product(tile, silu=silu))
            diff, tol = float((got - want).abs().max()), 1e-6 * float(want.abs().max())
            assert diff <= tol, f"tiled layout (silu in the product: {silu}) vs scattered fused: max |diff| {diff:.3e} " \
                                f"(tolerance {tol:.3e})"


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("T,K,D", [(9, 8, 2048), (13, 3, 100), (1, 2, 4100)], ids=lambda v: str(v))
def test_scatter_rows_writes_what_the_gather_reads(T, K, D, dtype):
    """Every token's row at its K places, bit for bit the rows ``index_select`` gathers; rows no
    place names (the grouped product's never-computed tail) untouched."""
    from model_runtime.kernels import moe_triton as MT

    g = torch.Generator().manual_seed(T * K + D)
    x = torch.randn(T, D, generator=g).to(dtype)
    x[0, :3] = -0.0
    order = torch.randperm(T * K, generator=g)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(T * K))
    out = torch.full((T * K + 5, D), float("nan"), dtype=dtype)
    MT.scatter_rows(x, pos.view(T, K), out)
    assert_bitwise("scatter_rows vs index_select", out[: T * K], x.index_select(0, order // K))
    assert bool(out[T * K :].isnan().all()), "scatter_rows wrote past the pairs"


def test_the_kernels_refuse_what_they_do_not_take():
    from model_runtime.kernels import moe_triton as MT

    a = torch.randn(6, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="num_rows"):
        MT.silu_mul_rows(a, 7)
    with pytest.raises(ValueError, match="unit column stride"):
        MT.silu_mul_rows(a.t(), 2)
    pos = torch.arange(6).view(3, 2)
    with pytest.raises(ValueError, match="scatter_rows"):
        MT.scatter_rows(a[:3], pos, torch.empty(5, 8, dtype=torch.bfloat16))  # fewer than T * K rows
    with pytest.raises(ValueError, match="weights"):
        MT.combine_top_k(a, pos, torch.rand(3, 2))  # float32 weights for bf16 rows
    with pytest.raises(ValueError, match="shared"):
        MT.combine_top_k(a, pos, torch.rand(3, 2).bfloat16(), (torch.rand(3, 1).bfloat16(), torch.rand(3, 4).bfloat16()))
