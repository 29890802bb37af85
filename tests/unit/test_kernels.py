"""Kernel backends against independent implementations on fresh random inputs (CPU)."""

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from model_runtime.kernels.attention import causal_attention_reference, causal_attention_sdpa
from model_runtime.kernels.conv import causal_conv1d_reference
from model_runtime.kernels.gate_projection import gate_projection_row, gate_projection_segment
from model_runtime.kernels.linear_attention import gated_delta_rule_reference
from model_runtime.kernels.registry import FAMILIES, KernelBackends, SlowKernelError, check_fast_kernels, select_backends
from model_runtime.model.packing import PackedBatch

LAYOUTS = [(1,), (5, 1, 7), (64, 65, 3, 128), (200,)]


def layout_id(lengths):
    return "L" + "-".join(map(str, lengths))


def report(name, got, want, tol):
    diff = (got.double() - want.double()).abs().max().item()
    assert diff <= tol, f"{name}: max |diff| {diff:.3e} > tol {tol:.0e}"


@pytest.mark.parametrize("lengths", LAYOUTS, ids=layout_id)
def test_attention_reference_matches_sdpa(lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    packed = PackedBatch.from_lengths(lengths)
    T = packed.total_tokens
    q = torch.randn(T, 4, 32, generator=g)
    k = torch.randn(T, 2, 32, generator=g)
    v = torch.randn(T, 2, 32, generator=g)
    ref = causal_attention_reference(q, k, v, packed, 32**-0.5)
    report("attention sdpa vs reference", causal_attention_sdpa(q, k, v, packed, 32**-0.5), ref, 1e-5)


def test_attention_reference_in_blocks_of_queries_equals_it_in_one(monkeypatch):
    """A long sequence's reference attention runs in blocks of queries (memory linear in its
    length): the same numbers as one block, up to float32 summation order."""
    import model_runtime.kernels.attention as attention

    g = torch.Generator().manual_seed(7)
    packed = PackedBatch.from_lengths((300, 1, 77))
    T = packed.total_tokens
    q, k, v = torch.randn(T, 4, 16, generator=g), torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, 16, generator=g)
    whole = causal_attention_reference(q, k, v, packed, 0.25)
    monkeypatch.setattr(attention, "REFERENCE_SCORE_ELEMENTS", 4 * 300 * 7)  # blocks of 7 queries
    report("attention reference in blocks vs one block", causal_attention_reference(q, k, v, packed, 0.25), whole, 1e-6)


@pytest.mark.parametrize("lengths", LAYOUTS, ids=layout_id)
def test_gate_projection_per_segment_matches_the_whole_row(lengths):
    """Per segment equals the whole-row product up to summation order, and each segment's rows
    are exactly the product of that segment alone (what a sequence scored alone computes)."""
    g = torch.Generator().manual_seed(40 + len(lengths))
    packed = PackedBatch.from_lengths(lengths)
    linear = torch.nn.Linear(48, 6, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(6, 48, generator=g))
        x = torch.randn(packed.total_tokens, 48, generator=g)
        bounds = tuple(packed.segments())
        got = gate_projection_segment(linear, x, bounds)
        report("gate projection segment vs row", got, gate_projection_row(linear, x, bounds), 1e-5)
        for start, end in bounds:
            assert torch.equal(got[start:end], linear(x[start:end])), f"segment {start}:{end} is not its own product"


def test_gate_projection_refuses_bounds_that_do_not_cover_the_row():
    linear = torch.nn.Linear(8, 2, bias=False)
    with pytest.raises(ValueError, match="do not cover the row of 10 tokens"):
        gate_projection_segment(linear, torch.zeros(10, 8), ((0, 4), (4, 9)))


def test_segment_runs_merge_neighbours_up_to_the_limit():
    from model_runtime.kernels.gate_projection import segment_runs

    bounds = [(0, 3), (3, 10), (10, 11), (11, 30), (30, 31), (31, 35)]
    assert segment_runs(bounds, 11) == [(0, 11), (11, 30), (30, 35)]  # 19 rows: a run of its own
    assert segment_runs(bounds, 35) == [(0, 35)]
    assert segment_runs(bounds, 1) == bounds
    assert segment_runs([], 8) == []


@pytest.mark.parametrize("limit", [0, 1, 2, 70, 129, 10_000])
@pytest.mark.parametrize("lengths", LAYOUTS + [(7, 70, 1, 1, 63, 129, 2)], ids=layout_id)
def test_gate_projection_runs_give_every_segment_its_own_product(lengths, limit):
    """``runs`` against ``segment`` on operands whose every sum is exact (small integers), so
    that any product equals any other bit for bit: a difference is a wrong row, not rounding.
    Without a measured limit (0, 1) it is ``segment`` itself."""
    from model_runtime.kernels.gate_projection import RunLimits, gate_projection_runs, segment_runs

    g = torch.Generator().manual_seed(len(lengths) + limit)
    packed = PackedBatch.from_lengths(lengths)
    linear = torch.nn.Linear(48, 6, bias=False)
    calls = []
    linear.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    limits = RunLimits({RunLimits.shape(linear.weight): limit})
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-4, 5, (6, 48), generator=g).float())
        x = torch.randint(-4, 5, (packed.total_tokens, 48), generator=g).float()
        bounds = tuple(packed.segments())
        got = gate_projection_runs(linear, x, bounds, limits)
        want = gate_projection_segment(linear, x, bounds)
    assert torch.equal(got, want), f"runs differ from per-segment products by {(got - want).abs().max():.3e}"
    runs = segment_runs(bounds, limit) if limit >= 2 else bounds
    assert calls[: len(runs)] == [b - a for a, b in runs] or len(bounds) == 1


def test_gate_projection_runs_refuse_bounds_that_do_not_cover_the_row():
    from model_runtime.kernels.gate_projection import RunLimits, gate_projection_runs

    linear = torch.nn.Linear(8, 2, bias=False)
    with pytest.raises(ValueError, match="do not cover the row of 10 tokens"):
        gate_projection_runs(linear, torch.zeros(10, 8), ((0, 4), (4, 9)), RunLimits({RunLimits.shape(linear.weight): 64}))


def test_run_limits_are_read_by_weight_shape_and_dtype():
    """A limit applies to every product of its weight's ``(in, out, dtype)``: an ``nn.Linear``, a
    router's ``partial(F.linear, weight=...)``, a module with a weight; 0 for any other shape or
    dtype, and for a product with no weight to read. The mapping cannot be changed after measuring."""
    import functools

    from model_runtime.kernels.gate_projection import NO_RUNS, RunLimits

    linear = torch.nn.Linear(8, 2, bias=False)
    limits = RunLimits({RunLimits.shape(linear.weight): 64})
    router = torch.nn.Module()
    router.weight = torch.nn.Parameter(torch.zeros(2, 8))
    assert limits.of(linear) == limits.of(router) == limits.of(functools.partial(F.linear, weight=router.weight)) == 64
    assert limits.of(torch.nn.Linear(8, 3)) == 0 and limits.of(linear.to(torch.bfloat16)) == 0
    assert limits.of(torch.nn.ReLU()) == 0 and NO_RUNS.of(linear) == 0
    with pytest.raises(TypeError):
        limits.rows[(8, 2, torch.float32)] = 1


def test_uniform_rows_end_at_the_first_change_of_kind():
    import numpy as np

    from model_runtime.kernels.gate_projection import uniform_rows

    assert uniform_rows(np.array([0, 0, 0, 0, 0])) == 4  # entry 0 mirrors 1; one kind to 4 rows
    assert uniform_rows(np.array([0, 0, 0, 1, 0])) == 2  # a kernel returns at 4 rows: not uniform past 2
    assert uniform_rows(np.array([3, 3])) == 1
    assert uniform_rows(np.array([0])) == 0


def test_rows_keep_their_place_catches_a_product_that_rounds_by_place(monkeypatch):
    """A stand-in BLAS that sums K backwards for rows at odd offsets from the product's first row:
    every product starting at row 0 agrees on common rows (``row_kinds`` sees one kind), yet a
    slice that starts one row later rounds its rows the other way."""
    from model_runtime.kernels import gate_projection as G

    def blas(x, w, odd_rows_backwards: bool):
        p = x.float()[:, None, :] * w.float()[None]  # exact products of bf16 values, summed in float32
        fwd, bwd = p.sum(-1), p.flip(-1).sum(-1)  # two orders of one float32 sum
        odd = (torch.arange(x.shape[0]) % 2 == 1)[:, None] & odd_rows_backwards
        return torch.where(odd, bwd, fwd).to(x.dtype)

    shape = (2048, 16, torch.bfloat16, "cpu", 40)  # long sums: a change of order shows in about 1% of outputs
    monkeypatch.setattr(G.F, "linear", lambda x, w: blas(x, w, False))
    assert G.rows_keep_their_place(*shape)
    monkeypatch.setattr(G.F, "linear", lambda x, w: blas(x, w, True))
    assert G.uniform_rows(G.row_kinds(*shape)) == 40
    assert not G.rows_keep_their_place(*shape)


@pytest.mark.parametrize("lengths", LAYOUTS, ids=layout_id)
def test_conv_reference_matches_direct_sum(lengths):
    """y_t = silu(sum_j w_j x_{t-W+1+j}) with zeros before each segment, written as a plain loop."""
    g = torch.Generator().manual_seed(len(lengths))
    packed = PackedBatch.from_lengths(lengths)
    x = torch.randn(packed.total_tokens, 12, generator=g)
    w = torch.randn(12, 4, generator=g)
    want = torch.zeros_like(x)
    for start, end in packed.segments():
        for t in range(start, end):
            acc = torch.zeros(12)
            for j in range(4):
                src = t - 3 + j
                if src >= start:
                    acc += w[:, j] * x[src]
            want[t] = F.silu(acc)
    report("conv reference vs loop", causal_conv1d_reference(x, w, packed), want, 1e-5)
    parts = causal_conv1d_reference(x, w, packed, splits=(1, x.shape[1] - 1))
    assert torch.equal(torch.cat(parts, dim=-1), causal_conv1d_reference(x, w, packed)), "splits change the numbers"


@pytest.mark.parametrize("lengths", LAYOUTS, ids=layout_id)
def test_delta_rule_reference_matches_huggingface_chunked(lengths):
    """Our token recurrence against transformers' own chunked float32 algorithm, per segment."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(7 + len(lengths))
    packed = PackedBatch.from_lengths(lengths)
    T, Hk, Hv, K, V = packed.total_tokens, 2, 4, 16, 8
    q, k = torch.randn(T, Hk, K, generator=g), torch.randn(T, Hk, K, generator=g)
    v = torch.randn(T, Hv, V, generator=g)
    decay = -torch.rand(T, Hv, generator=g) * 0.5
    beta = torch.rand(T, Hv, generator=g)
    got = gated_delta_rule_reference(q, k, v, decay, beta, packed)
    for start, end in packed.segments():
        s = slice(start, end)
        # Key heads repeated for the value heads up front: transformers 5.17 does it in the
        # layer, later versions inside this function.
        q_rep, k_rep = q[s].repeat_interleave(Hv // Hk, dim=1), k[s].repeat_interleave(Hv // Hk, dim=1)
        want, _ = torch_chunk_gated_delta_rule(
            q_rep[None], k_rep[None], v[None, s], g=decay[None, s], beta=beta[None, s], use_qk_l2norm_in_kernel=True
        )
        report(f"delta rule segment {start}:{end}", got[s], want[0], 1e-5)


def test_delta_rule_state_resets_at_boundaries():
    """Running two segments packed equals running each alone; concatenating them does not."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(20, 1, 8, generator=g), torch.randn(20, 1, 8, generator=g)
    v, beta = torch.randn(20, 1, 8, generator=g), torch.rand(20, 1, generator=g)
    decay = torch.full((20, 1), -0.01)
    packed = gated_delta_rule_reference(q, k, v, decay, beta, PackedBatch.from_lengths([12, 8]))
    alone = gated_delta_rule_reference(q[12:], k[12:], v[12:], decay[12:], beta[12:], PackedBatch.from_lengths([8]))
    joined = gated_delta_rule_reference(q, k, v, decay, beta, PackedBatch.from_lengths([20]))
    assert torch.equal(packed[12:], alone), f"packed off alone by {(packed[12:] - alone).abs().max():.3e} (tol 0)"
    apart = float((joined[12:] - alone).abs().max())
    assert apart > 1e-3, f"one joined segment only {apart:.3e} from two (want > 1e-3): the state was not carried"


def test_cpu_uses_references_and_cuda_refuses_missing_fast_kernels(monkeypatch):
    cpu = select_backends("cpu").names
    assert {f: cpu[f] for f in ("linear_attention", "conv1d", "attention")} == dict.fromkeys(
        ("linear_attention", "conv1d", "attention"), "reference"
    )
    assert cpu["head"] == "torch" and cpu["elementwise"] == "eager"
    import model_runtime.kernels.registry as kernels

    monkeypatch.setattr(kernels, "_unavailable_reason", lambda family, name, library=None: "not installed (test)")
    with pytest.raises(SlowKernelError, match="--allow-slow-kernels"):
        select_backends("cuda")
    slow = select_backends("cuda", allow_slow=True)
    assert slow.fallbacks == FAMILIES


def test_attention_preference_differs_in_the_worker_pool():
    """CUDA's choice, made without a GPU (only imports are checked): SDPA per segment in the
    serving process (with its Triton passes where Triton is installed), the varlen kernel in a
    worker pool's processes (measured faster there)."""
    pytest.importorskip("torch.nn.attention.varlen")
    has_triton = importlib.util.find_spec("triton") is not None
    assert select_backends("cuda", allow_slow=True).attention == ("sdpa_fused" if has_triton else "sdpa")
    assert select_backends("cuda", allow_slow=True, worker_pool=True).attention in ("flash_attn", "varlen")
    pinned = select_backends("cuda", allow_slow=True, worker_pool=True, overrides={"attention": "sdpa"})
    assert pinned.attention == "sdpa"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        KernelBackends(attention="magic")
    with pytest.raises(ValueError, match="unknown kernel families"):
        select_backends("cpu", overrides={"mlp": "fast"})
    with pytest.raises(ValueError, match="unknown attention backend 'magic'"):
        select_backends("cpu", overrides={"attention": "magic"})
    # A pinned backend that cannot run on the device is refused when chosen, not at the first row.
    with pytest.raises(ValueError, match="'varlen' needs CUDA"):
        select_backends("cpu", overrides={"attention": "varlen"})
    assert select_backends("cpu", overrides={"attention": "sdpa"}).attention == "sdpa"


def test_the_cli_knows_every_backend_the_registry_has():
    from model_runtime.kernels.overrides import BACKENDS
    from model_runtime.kernels.registry import REGISTRY

    assert {family: sorted(names) for family, names in BACKENDS.items()} == {
        family: sorted(fns) for family, fns in REGISTRY.items()}


def test_kernels_check_their_inputs():
    packed = PackedBatch.from_lengths([3])
    with pytest.raises(ValueError, match="packed row has 3"):
        causal_conv1d_reference(torch.zeros(4, 2), torch.zeros(2, 4), packed)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        causal_attention_reference(torch.zeros(3, 3, 4), torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), packed, 1.0)


def test_exact_norms_decompose_into_atens_mean_and_the_rest():
    """``inductor_exact`` splits each norm into ATen's mean of squares and the steps after it;
    run eagerly, the two halves equal the whole norm bit for bit (Inductor then fuses only the
    second half, which has no sum whose order could change)."""
    from model_runtime.kernels import elementwise as E

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 64, generator=g) * 3).to(torch.bfloat16)
    gate = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, generator=g) * 0.1).to(torch.bfloat16)
    ms = E._mean_square(x)
    q = (torch.randn(5, 4, 2, 32, generator=g) * 3).to(torch.bfloat16)[:, :, 0]  # a strided view, as q heads are
    pairs = {
        "rms_norm": (E._rms_norm_from_ms(x, ms, w, 1e-6), E.rms_norm(x, w, 1e-6)),
        "gated_rms_norm": (E._gated_rms_norm_from_ms(x, ms, gate, w, 1e-6), E.gated_rms_norm(x, gate, w, 1e-6)),
        "rms_norm of a strided view": (E._rms_norm_from_ms(q, E._mean_square(q), w[:32], 1e-6), E.rms_norm(q, w[:32], 1e-6)),
    }
    for what, (got, want) in pairs.items():
        assert torch.equal(got, want), f"{what} from the mean square off by {(got.float() - want.float()).abs().max():.3e} (tol 0)"


def test_triton_kernels_refuse_tiles_and_operands_they_do_not_take():
    """The Triton kernels' host side, which needs no Triton: a norm tile that would leave columns
    unread (unroll x lanes not dividing D) or an unroll the kernel has no branch for is refused,
    every default tile of the calibrated widths fits, a wrong ``ms_out`` is refused, and the SiLU
    product takes only dtypes PyTorch computes in float32."""
    from model_runtime.kernels import norm_triton as NT
    from model_runtime.kernels import pointwise_triton as PT

    cpu = torch.device("cpu")
    for bad in ((1, 2, 4), (1, 8, 4), (3, 1, 2)):
        with pytest.raises(ValueError, match="does not fit D=384"):
            NT._launch_args(10, 384, (4, 32), cpu, bad)
    for D in (128, 256, 384, 1024, 2048, 4096, 5120):
        for plan in NT._candidates(D):
            NT._launch_args(10, D, plan, cpu, NT.default_tile(D, plan))
            assert NT.default_tile(D, plan) in NT.tile_candidates(D, plan)
    out = torch.empty(6, 8, dtype=torch.bfloat16)
    assert NT._ms_pointer(None, 6, out) is out
    with pytest.raises(ValueError, match="ms_out must be 6 contiguous float32"):
        NT._ms_pointer(torch.empty(6, dtype=torch.bfloat16), 6, out)

    a = torch.randn(4, 8)
    assert PT.supports(a, a.clone()) and PT.supports(a.bfloat16(), a.bfloat16())
    assert not PT.supports(a.double(), a.double())


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed here")
def test_the_pools_check_before_binding_finds_fla_without_importing_it(tmp_path, monkeypatch):
    """Importing fla starts CUDA, in a worker pool's server process that leaves the GPUs to its
    workers: its check before the port is bound only looks for the package; one process imports
    it, so a broken install is said there. A stand-in fla that fails when imported shows which."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("raise ImportError('fla was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    others = {family: "pinned" for family in FAMILIES if family != "linear_attention"}
    check_fast_kernels("cuda", overrides=others, worker_pool=True)
    with pytest.raises(SlowKernelError) as refused:
        check_fast_kernels("cuda", overrides=others)
    assert "importing fla.ops.gated_delta_rule failed: ImportError: fla was imported" in str(refused.value), refused.value
    assert "fla" not in sys.modules
