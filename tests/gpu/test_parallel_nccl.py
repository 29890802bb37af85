"""Ulysses SP and FSDP2 over NCCL on 2 GPUs, and the worker pool on CUDA (needs >= 2 GPUs).

The same comparisons as tests/distributed (gloo on CPU), on the GPU path: all-to-all and
all-gather through NCCL, FSDP placing shards on each rank's GPU, float32 with the exact reference
token mixers so that layouts can be compared tightly (see tests/distributed/parity_cases.py).

Why the exact mixers: fla's TF32 delta rule in float32 moves SP and FSDP layouts off one GPU by
up to ~4e-4 in log-probs and swaps near-tied top-k ids; the bf16 pool (sp=2, FSDP, fla) matches
one GPU exactly.
"""

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_world
from tests.distributed.parity_cases import run_parity

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

# float32 on the GPU: layouts change matmul shapes (cuBLAS picks other algorithms) but no dtype.
TOL = 1e-5


def test_nccl_sp_and_fsdp_match_one_gpu(checkpoint_dir, gpu_record):
    paths = {kind: str(checkpoint_dir(kind)) for kind in ("qwen3_5", "qwen3_5_moe")}
    per_rank = run_world(run_parity, 2, paths, [(2, False), (1, True), (2, True)], [2], "cuda", backend="nccl")
    merged = {}
    for results in per_rank:
        merged.update(results)
    worst: dict = {}
    for (kind, layout, _), diffs in merged.items():
        if layout == "alone":
            continue
        for name, value in diffs.items():
            worst[(kind, layout, name)] = max(worst.get((kind, layout, name), 0.0), value)
    for (kind, layout, name), value in sorted(worst.items()):
        if name != "top_k_ids_mismatch":
            gpu_record(f"nccl {kind} {layout} {name}", max_abs_diff=value, tol=TOL)
    bad = {k: v for k, v in worst.items() if v > (0.0 if k[2] == "top_k_ids_mismatch" else TOL)}
    assert not bad, f"over tolerance {TOL:.0e}: {bad}"


def test_cuda_pool_sp2_fsdp_matches_one_gpu(gpu_record):
    """The served path in bf16 with the installed kernels: the bf16 bound of tests/gpu/test_parity_bf16.py (mean 2e-3)."""
    from model_runtime.pool.pool import start_pool
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer
    from model_runtime.types import SequenceInput

    settings = dict(
        model="tiny", device="cuda", dtype="bfloat16", world_size=2, sp=2, fsdp=True, max_batch_tokens=1024, allow_slow_kernels=True
    )
    pool = start_pool(settings)
    try:
        assert pool.info.parallel == {"world_size": 2, "dp": 1, "sp": 2, "fsdp": True}
        assert pool.info.device == "cuda"
        pool.warm_up()
        reference = Scorer(load_model("tiny", device="cuda:0", dtype="bfloat16", allow_slow_kernels=True))
        rng = np.random.default_rng(0)
        seqs = [SequenceInput(rng.integers(0, 4096, n), score_from=1, top_k=2) for n in (5, 300, 61, 1)]
        got, want = pool.score_row(seqs), reference.score_row(seqs)
        diffs = np.concatenate([np.abs(a.logprobs - b.logprobs) for a, b in zip(got, want)])
        gpu_record("cuda pool sp2 fsdp bf16", mean_abs_diff=float(diffs.mean()), max_abs_diff=float(diffs.max()))
        assert diffs.mean() <= 2e-3, f"mean |diff| {diffs.mean():.3e} > tol 2e-3 (max {diffs.max():.3e})"
    finally:
        pool.close()
