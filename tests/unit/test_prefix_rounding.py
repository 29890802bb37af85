"""Prefix sharing that follows the narrow products' rounding by row count (``RowRounding``).

The table a GPU measures is replaced here by made-up ones; the grouping, the row costing and the
table's measurement and cache run as in the service.
"""

import copy

import numpy as np
import pytest
import torch

from model_runtime.scoring import rounding as R
from model_runtime.scoring.prefix import find_groups, tokens_saved
from model_runtime.types import SequenceInput


def table(max_rows: int, runs: dict[int, int]) -> R.RowRounding:
    """A ``RowRounding`` whose row counts from ``m`` on are of kind ``runs[m]`` (kind 0 before the first)."""
    return R.RowRounding.from_runs([[1, 0]] + sorted(runs.items()), max_rows)


def group(rng, prompt_len, tails, vocab=900):
    prompt = rng.integers(0, vocab, prompt_len)
    return [SequenceInput(np.concatenate([prompt, rng.integers(0, vocab, n)]), score_from=prompt_len) for n in tails]


def test_two_lengths_are_alike_when_they_are_of_one_kind():
    r = table(100, {50: 1, 60: 0, 90: 2})
    assert r.alike(30, 30) and r.alike(100, 100)  # one length: always alike
    assert r.alike(30, 49) and r.alike(49, 30) and r.alike(50, 59) and r.alike(90, 100)
    assert r.alike(30, 60) and r.alike(1, 89)  # kind 0 again from 60 rows: cuBLAS's first kernel back
    assert not r.alike(30, 50) and not r.alike(55, 65) and not r.alike(40, 95)
    assert not r.alike(10, 101)  # past the measured row counts: nothing is known alike
    assert r.alike(101, 101)
    assert r.steps == [50, 60, 90] and r.kind_count == 3


def test_a_group_is_cut_where_its_lengths_round_the_prompt_differently():
    rng = np.random.default_rng(0)
    seqs = group(rng, 700, [300, 400, 1500, 1600, 5000])  # lengths 1000, 1100, 2200, 2300, 5700
    r = table(8192, {2000: 1, 4000: 2})
    groups = find_groups(seqs, 64, r)
    assert [(g.members, g.shared) for g in groups] == [((0, 1), 640), ((2, 3), 640)]
    assert tokens_saved(seqs, 64, r) == 2 * 640
    assert [(g.members, g.shared) for g in find_groups(seqs, 64)] == [((0, 1, 2, 3, 4), 640)]


def test_members_of_one_kind_share_across_the_ranges_between_them():
    rng = np.random.default_rng(1)
    seqs = group(rng, 300, [300, 1500, 400, 1600, 3000])  # lengths 600, 1800, 700, 1900, 3300
    r = table(8192, {650: 1, 1700: 0, 3000: 1})
    assert [(g.members, g.shared) for g in find_groups(seqs, 64, r)] == [((0, 1, 3), 256), ((2, 4), 256)]


def test_a_member_longer_than_the_table_shares_only_with_its_own_length():
    rng = np.random.default_rng(2)
    seqs = group(rng, 200, [100, 900, 900])
    r = table(512, {})
    assert [(g.members, g.shared) for g in find_groups(seqs, 64, r)] == [((1, 2), 192)]


def test_an_exact_table_changes_nothing():
    rng = np.random.default_rng(3)
    seqs = group(rng, 300, [5, 60, 700]) + group(rng, 129, [1, 2]) + group(rng, 90, [40])
    assert find_groups(seqs, 64, R.RowRounding.exact(4096)) == find_groups(seqs, 64)


def test_measure_keeps_the_table_and_reads_it_back(tmp_path, monkeypatch):
    linear = torch.nn.Linear(32, 4, bias=False)

    class Gates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = linear

        def narrow_weights(self):
            return (self.a.weight,)

    model = torch.nn.Sequential(Gates())
    first = R.measure(model, 40, cache_dir=tmp_path)
    assert first.max_rows == 40 and list((tmp_path / "row-rounding").glob("*.npy"))

    def not_again(*args, **kwargs):
        raise AssertionError("measured again despite the kept table")

    monkeypatch.setattr("model_runtime.kernels.gate_projection.row_kinds", not_again)
    second = R.measure(model, 40, cache_dir=tmp_path)
    assert np.array_equal(first.kinds, second.kinds)
    assert R.measure(torch.nn.Linear(3, 3), 40, cache_dir=tmp_path).alike(2, 40)  # no narrow product


def test_the_probe_operands_make_a_change_of_summation_order_visible():
    """On random operands two summation orders rarely round a bf16 output differently; the probe's
    operands cancel to about 2^-6 of their partial sums, so the same change shows in many outputs."""
    from model_runtime.kernels.gate_projection import order_sensitive_operands

    def flips(x, w) -> float:
        p = x.float()[:, None, :] * w.float()[None]  # exact products of bf16 values
        forward, backward = torch.zeros(p.shape[:2]), torch.zeros(p.shape[:2])
        for k in range(p.shape[-1]):
            forward = forward + p[..., k]
            backward = backward + p[..., -1 - k]
        return float((forward.bfloat16() != backward.bfloat16()).float().mean())

    K = 2048
    probe = flips(*order_sensitive_operands(K, 16, torch.bfloat16, "cpu", 64))
    gen = torch.Generator().manual_seed(0)
    plain = flips(torch.randn(64, K, generator=gen).bfloat16(), (torch.randn(16, K, generator=gen) * K ** -0.5).bfloat16())
    print(f"bf16 outputs changed by reversing the sum: probe operands {probe:.4f}, random {plain:.4f}")
    assert probe > 0.005 and probe > 10 * plain, f"probe operands {probe:.4f} against random {plain:.4f}"
    short = flips(*order_sensitive_operands(64, 16, torch.bfloat16, "cpu", 256))
    print(f"bf16 outputs changed by reversing a sum of 64 inputs: probe operands {short:.4f}")
    assert short < probe / 3, f"64 inputs {short:.4f} against {K}: {probe:.4f} (rounding.MIN_RUN_IN_FEATURES relies on it)"


def test_the_pool_hands_the_table_over_as_runs():
    from model_runtime.pool import messages as msg
    from model_runtime.pool.replies import agreed_rounding

    rng = np.random.default_rng(4)
    r = table(3000, {int(m): int(rng.integers(0, 4)) for m in rng.integers(2, 3000, 40)})
    back = R.RowRounding.from_runs(r.runs, r.max_rows)
    pairs = rng.integers(1, 3100, (500, 2))
    assert all(back.alike(int(a), int(b)) == r.alike(int(a), int(b)) for a, b in pairs)

    def hello(rank, rounding):
        h = msg.Hello(rank=rank, generation=0, pid=1, name="m", architecture="qwen3_5", vocab_size=10, max_model_len=10,
                      dtype="bfloat16", device="cuda", weights_version="v", kernels={}, slow_kernels=[],
                      cost_per_token=1.0, cost_per_token_squared=1.0,
                      prefix_max_rows=rounding.max_rows if rounding else 0, prefix_runs=rounding.runs if rounding else [])
        return msg.decode(msg.encode(h))  # as it crosses the pipe (msgpack, no pickle)

    got = agreed_rounding([hello(0, r), hello(1, r)])
    assert got.runs == r.runs and got.max_rows == r.max_rows and np.array_equal(got.kinds, r.kinds)
    assert agreed_rounding([hello(0, None), hello(1, None)]) is None
    other = R.RowRounding.from_runs(r.runs[:-1], r.max_rows)  # the last run joins the one before
    with pytest.raises(RuntimeError, match="different narrow-product rounding"):
        agreed_rounding([hello(0, r), hello(1, other)])


def test_row_kinds_join_the_ranges_where_a_kernel_returns(monkeypatch):
    """A stand-in BLAS that sums K backwards for 10-19 and 30-39 rows (another kernel) and forwards
    otherwise: the probe finds two kinds, the second spanning both of its ranges."""
    from model_runtime.kernels import gate_projection as G

    def linear(x, w):
        backwards = 10 <= x.shape[0] < 20 or 30 <= x.shape[0] < 40
        p = x[:, None, :] * w[None]
        out = torch.zeros(p.shape[:2], dtype=x.dtype)
        for k in (range(p.shape[-1] - 1, -1, -1) if backwards else range(p.shape[-1])):
            out = out + p[..., k]
        return out

    monkeypatch.setattr(G.F, "linear", linear)
    kinds = G.row_kinds(32, 4, torch.float32, "cpu", 50)
    want = np.array([0] * 10 + [1] * 10 + [0] * 10 + [1] * 10 + [0] * 11)
    assert np.array_equal(kinds, want), f"kinds {kinds.tolist()}, expected {want.tolist()}"
    r = R.RowRounding(kinds)
    assert r.alike(5, 45) and r.alike(12, 35) and not r.alike(12, 25) and r.runs == [[1, 0], [10, 1], [20, 0], [30, 1], [40, 0]]


def test_row_kinds_of_the_cpu_blas_compute_common_rows_alike():
    """The real product on the CPU: every pair of row counts of one kind gives equal common rows."""
    from model_runtime.kernels.gate_projection import order_sensitive_operands, row_kinds

    kinds = row_kinds(256, 8, torch.bfloat16, "cpu", 300)
    x, w = order_sensitive_operands(256, 8, torch.bfloat16, "cpu", 300)
    rng = np.random.default_rng(0)
    for a, b in rng.integers(1, 301, (60, 2)):
        a, b = sorted((int(a), int(b)))
        same = torch.equal(torch.nn.functional.linear(x[:a], w), torch.nn.functional.linear(x[:b], w)[:a])
        if kinds[a] == kinds[b]:
            assert same, f"row counts {a} and {b} are of kind {kinds[a]} but their common rows differ"


def test_a_cuda_scorer_measures_its_table_before_its_first_shared_row(monkeypatch):
    """``packscore score`` and any scorer that skipped its warm-up: on CUDA the table is measured
    on first use, never left out (which would share among every member and move numbers)."""
    from types import SimpleNamespace

    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    loaded = load_model("tiny")
    scorer = Scorer(loaded, prefix_min_tokens=64)
    made = R.RowRounding.from_runs([[1, 0], [500, 1]], 4096)
    calls = []
    monkeypatch.setattr(scorer, "measure_prefix_rounding", lambda: (calls.append(1), setattr(scorer, "prefix_rounding", made)))
    scorer.loaded = SimpleNamespace(device=torch.device("cuda"))  # only the device is read before measuring
    assert scorer.rounding_in_use() is made and scorer.rounding_in_use() is made and calls == [1]
    assert Scorer(loaded, prefix_min_tokens=64).rounding_in_use() is None  # the CPU: every member alike
    assert Scorer(loaded).rounding_in_use() is None


def test_prepare_runs_hands_each_narrow_layer_its_measured_limits(tmp_path, monkeypatch):
    """``prepare_runs`` hands every layer with narrow products one ``RunLimits``: per weight
    shape, the row counts of one kind, 0 where a slice's rows move with their place; one
    measurement per shape, kept in the same cache as ``measure``'s table."""
    from model_runtime.kernels import gate_projection as G

    class Gates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 4, bias=False), torch.nn.Linear(32, 4, bias=False)
            self.router = torch.nn.Module()
            self.router.weight = torch.nn.Parameter(torch.zeros(6, 32))  # a router: a weight, no Linear
            self.wide = torch.nn.Linear(32, 64, bias=False)  # not narrow: left alone
            self.limits = []

        def narrow_weights(self):
            return (self.a.weight, self.b.weight, self.router.weight)

        def use_run_limits(self, limits):
            self.limits.append(limits)

    kinds = {4: np.array([0] * 41), 6: np.array([0] * 20 + [1] * 21)}  # [32 -> 6] changes kernel at 20 rows
    measured = []
    monkeypatch.setattr(G, "row_kinds", lambda k, n, dtype, device, rows: measured.append(n) or kinds[n])
    monkeypatch.setattr(G, "rows_keep_their_place", lambda *args: True)
    model = torch.nn.Sequential(Gates())
    assert R.prepare_runs(model, 40, cache_dir=tmp_path) == {"0.a": 0, "0.b": 0, "0.router": 0}  # 32 inputs: too few
    assert measured == []
    monkeypatch.setattr(R, "MIN_RUN_IN_FEATURES", 32)
    got = R.prepare_runs(model, 40, cache_dir=tmp_path)
    assert got == {"0.a": 40, "0.b": 40, "0.router": 19}
    assert sorted(measured) == [4, 6]  # one measurement per shape
    handed = model[0].limits[-1]
    assert dict(handed.rows) == {(32, 4, torch.float32): 40, (32, 6, torch.float32): 19}
    assert handed.of(model[0].a) == 40 and handed.of(model[0].router) == 19 and handed.of(model[0].wide) == 0
    measured.clear()
    monkeypatch.setattr(G, "rows_keep_their_place", lambda *args: False)
    assert R.prepare_runs(model, 40, cache_dir=tmp_path) == {"0.a": 0, "0.b": 0, "0.router": 0}
    assert measured == []  # read back from the cache
    assert R.measure(model, 40, cache_dir=tmp_path).alike(5, 19) and not R.measure(model, 40, cache_dir=tmp_path).alike(5, 25)
    assert not any(hasattr(m, "packscore_uniform_rows") for m in model.modules())  # nothing stuck onto the modules


def test_run_limits_reach_the_layers_runs_backend(monkeypatch):
    """The limits ``use_run_limits`` hands over are what the layers' ``runs`` backend reads: the
    router's product runs over runs of segments of up to that many rows; other backends read none."""
    from model_runtime.kernels import gate_projection as G
    from model_runtime.kernels.registry import KernelBackends
    from model_runtime.model.moe import PackedSparseMoe
    from model_runtime.model.packing import PackedBatch
    from tests.unit.test_moe import hf_block

    # the GPU's experts (never run here): the router and shared gate go through the gate-projection backend
    block = PackedSparseMoe(hf_block("qwen3_5_moe", dtype=torch.bfloat16),
                            KernelBackends(moe_experts="grouped_mm", gate_projection="runs"))
    assert block.gate_projection_fn is G.gate_projection_runs and len(block.narrow_weights()) == 2
    limits = G.RunLimits({G.RunLimits.shape(w): 9 for w in block.narrow_weights()})
    R.use_run_limits(torch.nn.Sequential(block), limits)
    assert block.run_limits is limits
    seen = []
    real = G.segment_runs
    monkeypatch.setattr(G, "segment_runs", lambda bounds, max_rows: seen.append(max_rows) or real(bounds, max_rows))
    packed = PackedBatch.from_lengths([3, 4, 5])
    x = torch.randn(packed.total_tokens, block.gate.weight.shape[1]).to(torch.bfloat16)
    with torch.no_grad():
        got = block._narrow(block._router_product(), x, packed)
        want = torch.cat([x[a:b] @ block.gate.weight.T for a, b in real(packed.segment_bounds, 9)])
    assert seen == [9], f"run limits read: {seen}, expected [9]"
    assert torch.equal(got, want), f"router logits off the runs' products by {(got - want).abs().max():.3e} (tol 0)"
    seen.clear()
    block.gate_projection_fn = G.gate_projection_segment  # another backend reads no limits
    with torch.no_grad():
        block._narrow(block.shared_expert_gate, x, packed)
    assert seen == []


def test_run_limits_reach_the_decay_and_beta_products(monkeypatch):
    """The GDN layers' decay/beta products read the limits handed to the model; limits that miss
    a narrow product's shape are refused (it would run per segment unseen)."""
    from model_runtime.kernels import gate_projection as G
    from model_runtime.model.packing import PackedBatch
    from model_runtime.scoring.loading import load_model

    loaded = load_model("tiny", device="cpu", kernel_overrides={"gate_projection": "runs"})
    with pytest.raises(ValueError, match="no run limit"):
        R.use_run_limits(loaded.model, G.RunLimits())
    R.use_run_limits(loaded.model, G.RunLimits({G.RunLimits.shape(w): 7 for w in R.narrow_weights(loaded.model)}))
    gdn = next(m for m in loaded.model.modules() if type(m).__name__ == "PackedGatedDeltaNet")
    seen = []
    real = G.segment_runs
    monkeypatch.setattr(G, "segment_runs", lambda bounds, max_rows: seen.append(max_rows) or real(bounds, max_rows))
    packed = PackedBatch.from_lengths([3, 4, 5])
    with torch.no_grad():
        gdn._gate_products((gdn.in_proj_a, gdn.in_proj_b), torch.randn(12, gdn.in_proj_a.weight.shape[1]), packed, None)
    assert seen == [7, 7], f"run limits read: {seen}, expected [7, 7]"
    copied = copy.deepcopy(loaded.model)  # as tests/unit/test_weights_update.py copies a loaded model per backend
    assert next(m for m in copied.modules() if type(m).__name__ == "PackedGatedDeltaNet").run_limits is gdn.run_limits


def test_a_cpu_scorer_measures_no_runs():
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    loaded = load_model("tiny", device="cpu")
    scorer = Scorer(loaded)
    assert scorer.narrow_runs_in_use() == {}
