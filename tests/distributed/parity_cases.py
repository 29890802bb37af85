"""What every rank of a parity world runs: the same rows scored alone and under SP / FSDP layouts.

Each layout is compared with ``Scorer.score_row`` on an unsharded copy of the same model in the
same process, and the worst differences are returned per (kind, layout, row).
"""

from __future__ import annotations

import numpy as np

from model_runtime.parallel.dims import ParallelDims
from model_runtime.parallel.parallelize import parallelize
from model_runtime.parallel.runner import ParallelScorer
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput

TOP_K = 3
CONV_WIDTH = 4  # the GDN conv kernel: offsets -4..+4 cover the window on both sides of a start


def mixed_row(vocab: int, seed: int = 0) -> list[SequenceInput]:
    """Lengths around powers of two and 1-token sequences; an odd total so the row gets padded."""
    rng = np.random.default_rng(seed)
    lengths = (1, 2, 3, 5, 31, 32, 33, 64, 65, 1)
    seqs = []
    for i, n in enumerate(lengths):
        score_from = [1, max(1, n // 2), n][i % 3]
        seqs.append(SequenceInput(rng.integers(0, vocab, n), score_from=score_from, temperature=0.8, top_k=TOP_K))
    return seqs


def boundary_rows(vocab: int, sp: int, seed: int = 1) -> dict[str, list[SequenceInput]]:
    """Rows whose first shard boundary falls ``offset`` tokens after the start of a sequence.

    With a total of ``sp * m`` tokens the shard boundary is at ``m``; the first sequence has
    ``m - offset`` tokens, so the second one starts ``offset`` tokens before the boundary
    (negative: the boundary is inside the first sequence, just before the second starts).
    """
    rng = np.random.default_rng(seed)
    m = 24
    rows = {}
    for offset in range(-CONV_WIDTH, CONV_WIDTH + 1):
        first = m - offset
        second = sp * m - first
        rows[f"split{offset:+d}"] = [
            SequenceInput(rng.integers(0, vocab, first), score_from=1),
            SequenceInput(rng.integers(0, vocab, second), score_from=1, top_k=TOP_K),
        ]
    return rows


def max_diffs(got, ref) -> dict[str, float]:
    worst = {"logprobs": 0.0, "entropy": 0.0, "top_k_logprobs": 0.0, "top_k_ids_mismatch": 0.0}
    for a, b in zip(got, ref):
        if a.logprobs.size:
            worst["logprobs"] = max(worst["logprobs"], float(np.abs(a.logprobs - b.logprobs).max()))
            worst["entropy"] = max(worst["entropy"], float(np.abs(a.entropy - b.entropy).max()))
        if a.top_k_ids is not None and a.top_k_ids.size:
            worst["top_k_logprobs"] = max(worst["top_k_logprobs"], float(np.abs(a.top_k_logprobs - b.top_k_logprobs).max()))
            worst["top_k_ids_mismatch"] = max(worst["top_k_ids_mismatch"], float((a.top_k_ids != b.top_k_ids).sum()))
    return worst


def grouped_row(vocab: int, seed: int = 2) -> list[SequenceInput]:
    """A group sharing a 140-token prompt (run once by the ranks, ``prefix_min_tokens``), one of
    them scored from inside the prompt, beside an unrelated sequence."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 140)
    tails = ((30, 140), (9, 20), (61, 139))  # (response length, score_from)
    seqs = [SequenceInput(np.concatenate([prompt, rng.integers(0, vocab, n)]), score_from=sf) for n, sf in tails]
    return seqs + [SequenceInput(rng.integers(0, vocab, 45), score_from=1, top_k=TOP_K)]


def _rows(vocab: int, sp: int, with_boundaries: bool) -> dict[str, list[SequenceInput]]:
    rows = {"mixed": mixed_row(vocab), "grouped": grouped_row(vocab)}
    if with_boundaries:
        rows.update(boundary_rows(vocab, sp))
    return rows


class _Reference:
    """The unsharded scorer, each distinct row scored once: every layout compares with the same numbers."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.vocab_size = scorer.loaded.vocab_size
        self._scores: dict[tuple, list] = {}

    def score_row(self, seqs: list[SequenceInput]) -> list:
        key = tuple((s.input_ids.dtype.str, s.input_ids.tobytes(), s.score_from, s.temperature, s.top_k, s.return_entropy)
                    for s in seqs)
        if key not in self._scores:
            self._scores[key] = self.scorer.score_row(seqs)
        return self._scores[key]


def run_parity(
    rank: int,
    world: int,
    checkpoints: dict[str, str],
    layouts: list[tuple[int, bool]],
    boundaries_for: list[int],
    device_type: str = "cpu",
):
    """For every checkpoint and every ``(sp, fsdp)`` layout: scores rows and compares with one process.

    On "cuda" each rank uses ``cuda:<rank>`` with float32 and whatever kernels are installed.

    Under ``dp > 1`` the groups take different rows and their count differs, so the group that
    runs out first runs idle steps: FSDP's all-gathers must stay in lockstep across groups.
    """
    out = {}
    device = "cpu" if device_type == "cpu" else f"cuda:{rank}"
    load = dict(device=device, dtype="float32", allow_slow_kernels=True)
    if device_type == "cuda":
        # float32 keeps layouts comparable tightly, so the token mixers take the exact references:
        # the varlen kernel takes only 16-bit inputs, and fla's float32 delta rule multiplies in
        # TF32 with a per-shape autotuned tiling, which moves layouts far past float32 rounding.
        # The bf16 served path is compared separately.
        load["kernel_overrides"] = {"attention": "sdpa", "linear_attention": "reference", "conv1d": "reference",
                                    "moe_experts": "tiled"}  # the grouped product is bf16 only
    for kind, path in checkpoints.items():
        reference = _Reference(Scorer(load_model(path, **load)))
        # Baseline: how far one process moves when the same sequences are scored one by one
        # (each rank takes its share of the rows).
        baseline_rows = _rows(reference.vocab_size, 2, True)
        for name in sorted(baseline_rows)[rank::world]:
            seqs = baseline_rows[name]
            alone = [reference.scorer.score_row([s])[0] for s in seqs]
            out[(kind, "alone", name)] = max_diffs(alone, reference.score_row(seqs))
        for sp, fsdp in layouts:
            dims = ParallelDims.from_world(world, sp=sp, fsdp=fsdp)
            mesh = dims.build_mesh(device_type)
            loaded = load_model(path, **load)
            parallelize(loaded.model, dims=dims, mesh=mesh)
            # Shared prefixes on: their state crosses the shards like any other (the reference is unshared).
            runner = ParallelScorer(loaded, dims=dims, mesh=mesh, rank=rank, prefix_min_tokens=64)
            rows = _rows(reference.vocab_size, sp, sp in boundaries_for)
            group = dims.group_of(rank)
            names = sorted(rows)
            # Group g scores every dp-th row starting at g; the last steps of short groups are idle.
            mine = names[group :: dims.dp]
            steps = -(-len(names) // dims.dp)
            for step in range(steps):
                if step < len(mine):
                    name = mine[step]
                    got = runner.score_row(rows[name])
                    ref = reference.score_row(rows[name])
                    out[(kind, f"sp{sp}{'-fsdp' if fsdp else ''}", name)] = max_diffs(got, ref)
                elif dims.lockstep:
                    runner.idle_step()
    return out
