"""The ``tiles`` gate-projection backend on the GPU: a narrow product whose every row is computed
alike whatever the row count, so that every member of a group may share its prompt bit for bit.

Checked on operands that make a change of summation order visible (``order_sensitive_operands``:
cuBLAS's own products change rows at hundreds of row counts on them): the rows of a product of
``m`` rows equal the same rows of a product of more rows, wherever they sit in it; and the 9B
slice scores a group of varied lengths shared among every member exactly as unshared.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model_runtime.kernels.gate_projection import first_changed_rows, order_sensitive_operands
from model_runtime.kernels.gate_projection_triton import narrow_tiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU kernels need CUDA"),
]

DEV = "cuda"
# (in, out): the 9B's and 27B's decay/beta, the 35B-A3B's decay/beta, router and shared gate
SHAPES = [(4096, 32), (5120, 48), (2048, 32), (2048, 256), (2048, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tiles_close_to_cublas(shape, dtype, gpu_record):
    k, n = shape
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(3001, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEV) / k**0.5).to(dtype)
    got, want = narrow_tiles(x, w), F.linear(x, w)
    exact = F.linear(x.double(), w.double())
    err_got = float((got.double() - exact).abs().max())
    err_want = float((want.double() - exact).abs().max())
    gpu_record("gate tiles vs float64", shape=f"{k}x{n}", dtype=str(dtype), tiles=err_got, cublas=err_want)
    # The same rounding error as cuBLAS's, within one output step (bf16: 2^-8 of the largest output).
    tol = 2 * err_want + (float(exact.abs().max()) * 2**-8 if dtype == torch.bfloat16 else 1e-5)
    assert err_got <= tol, f"tiles {k}x{n} {dtype}: max |err| {err_got:.3e} against float64, cuBLAS {err_want:.3e}, tolerance {tol:.3e}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tiles_rows_do_not_depend_on_the_row_count_or_place(shape, gpu_record):
    k, n = shape
    max_rows = 9000
    operands = [order_sensitive_operands(k, n, torch.bfloat16, DEV, max_rows, seed=s) for s in (1, 2)]
    changed = first_changed_rows(operands, max_rows, product=narrow_tiles)
    changes = [m for m in range(2, max_rows + 1) if changed[m] < m]  # row counts whose earlier rows moved
    x, w = operands[0]
    full = narrow_tiles(x, w)
    rng = np.random.default_rng(4)
    moved = 0
    for _ in range(200):  # a slice anywhere (not on a tile boundary) computes its rows as the whole product
        a, b = sorted(int(v) for v in rng.integers(0, max_rows + 1, 2))
        moved += int(not torch.equal(narrow_tiles(x[a:b], w), full[a:b]))
    cublas = first_changed_rows(operands, 3000)
    cublas_changes = [m for m in range(2, 3001) if cublas[m] < m]
    gpu_record("gate tiles row count and place", shape=f"{k}x{n}", row_counts_changed=int(len(changes)),
               slices_moved=moved, cublas_row_counts_changed_to_3000=int(len(cublas_changes)))
    assert len(changes) == 0, f"{k}x{n}: tiles rows change at row counts {changes[:10]}"
    assert moved == 0, f"{k}x{n}: {moved} of 200 slices compute their rows otherwise than the whole product"


def test_9b_slice_every_member_shares_bit_for_bit_with_tiles(slice_9b_twin, gpu_record):
    """With ``gate_projection=tiles`` the narrow products have one kind: a group of varied lengths
    (the 9B's cuBLAS kinds cut it in several parts) shares its prompt among every member, and every
    number is the unshared one's under the same kernels."""
    from bench.hf_reference import kernel_backend
    from model_runtime.scoring.prefix import tokens_saved
    from model_runtime.scoring.scorer import Scorer
    from model_runtime.types import SequenceInput

    loaded = slice_9b_twin.loaded
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, loaded.vocab_size, 900)
    tails = (1, 40, 300, 700, 701, 1200, 1500, 2600, 4000, 4000)
    seqs = [SequenceInput(np.concatenate([prompt, rng.integers(0, loaded.vocab_size, n)]), score_from=800) for n in tails]
    with kernel_backend(loaded.model, "gate_projection", "tiles"):
        plain = Scorer(loaded, max_batch_tokens=16384).score_row(seqs)
        sharing = Scorer(loaded, max_batch_tokens=16384, prefix_min_tokens=64)
        sharing.measure_prefix_rounding()
        shared = sharing.score_row(seqs)
        alone = [Scorer(loaded, max_batch_tokens=16384).score_row([s])[0] for s in seqs[:3]]
    d = np.concatenate([np.abs(a.logprobs - b.logprobs) for a, b in zip(shared, plain)])
    e = np.concatenate([np.abs(a.entropy - b.entropy) for a, b in zip(shared, plain)])
    d_alone = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(alone, plain))
    saved, every = tokens_saved(seqs, 64, sharing.prefix_rounding), tokens_saved(seqs, 64)
    gpu_record("gate tiles 9B slice varied lengths", unequal=int((d != 0).sum()), of=int(d.size), max=float(d.max()),
               entropy_max=float(e.max()), alone_vs_packed_max=d_alone, tokens_saved=saved, tokens_saved_every_member=every,
               kinds=sharing.prefix_rounding.kind_count)
    assert saved == every > 0, f"tiles: {saved} prompt tokens shared, every member would share {every}"
    assert float(d.max()) == 0.0 and float(e.max()) == 0.0 and d_alone == 0.0, (
        f"{int((d != 0).sum())} of {d.size} log-probs differ from unshared scoring (max |dlogp| {d.max():.3e}, "
        f"max |dentropy| {e.max():.3e}; alone vs packed {d_alone:.3e}); expected 0")
