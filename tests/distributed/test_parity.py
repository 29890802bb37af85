"""Ulysses SP and FSDP2 on CPU ranks (gloo) give the numbers of one unsharded process.

One world per test file size: every rank loads the checkpoints, scores the same rows unsharded
(the reference, in-process) and under each layout, and reports the worst differences.
"""

import pytest

from tests.checkpoints import KINDS
from tests.distributed.harness import run_world
from tests.distributed.parity_cases import run_parity

# Layout against one process, float32 on CPU, for dense and MoE kinds alike.
TOL = 1e-5
# Context for a failure: one process alone already moves MoE results with the row layout (the CPU
# BLAS rounds products of fewer than 4 rows differently, and expert batch sizes depend on the
# row). The "alone" lines print that baseline: each sequence scored alone vs in the row. It is
# about 1.4e-6 with these checkpoints and reaches 1.0e-5 with other draws of their weights.

PARITY_KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
assert set(PARITY_KINDS) <= set(KINDS)


def _check(results: dict, capsys, label: str) -> None:
    assert results, "no layout was compared"
    failures = []
    worst: dict[tuple[str, str], dict[str, float]] = {}
    for (kind, layout, row), diffs in sorted(results.items()):
        key = (kind, layout)
        worst[key] = {k: max(worst.get(key, {}).get(k, 0.0), v) for k, v in diffs.items()}
        if layout == "alone":
            continue
        for name, value in diffs.items():
            limit = 0.0 if name == "top_k_ids_mismatch" else TOL
            if value > limit:
                baseline = results.get((kind, "alone", row), {}).get(name, float("nan"))
                failures.append(
                    f"{kind} {layout} row {row}: {name} {value:.3e} > {limit:.0e} (one process, alone vs row: {baseline:.3e})"
                )
    with capsys.disabled():
        for (kind, layout), d in worst.items():
            print(f"\n[{label}] {kind:12s} {layout:10s} max |diff| " + ", ".join(f"{k} {v:.2e}" for k, v in d.items()), end="")
        print()
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def paths(checkpoint_dir):
    return {kind: str(checkpoint_dir(kind)) for kind in PARITY_KINDS}


def test_two_ranks_sp_and_fsdp_match_one_process(paths, capsys):
    """sp=2 (with rows split at offsets -4..+4 of a sequence start), fsdp with dp=2, and both."""
    layouts = [(2, False), (1, True), (2, True)]
    per_rank = run_world(run_parity, 2, paths, layouts, [2])
    merged = {}
    for rank_results in per_rank:
        merged.update(rank_results)
    # Every layout ran on every rank; sp ranks of one group must agree exactly on the gathered row.
    assert {layout for (_, layout, _) in merged} >= {"sp2", "sp1-fsdp", "sp2-fsdp", "alone"}
    assert len([k for k in merged if k[1] == "sp2" and k[2].startswith("split")]) == 9 * len(paths)
    _check(merged, capsys, "2 ranks")


def test_four_ranks_replicated_kv_heads_and_two_lockstep_groups(paths, capsys):
    """sp=4 replicates the 2 kv heads and 2 GDN key heads; dp=2 x sp=2 with FSDP over all four."""
    layouts = [(4, True), (2, True)]
    small = {k: paths[k] for k in ("qwen3_5", "qwen3_5_moe")}
    per_rank = run_world(run_parity, 4, small, layouts, [4])
    merged = {}
    for rank_results in per_rank:
        merged.update(rank_results)
    assert {layout for (_, layout, _) in merged} >= {"sp4-fsdp", "sp2-fsdp"}
    _check(merged, capsys, "4 ranks")
