"""Queuing a row waits for nothing on the device.

``Scorer.score`` queues row n + 1 before it reads row n back, so the host plans and launches the
next row while the GPU still runs this one. One blocking call while queuing (an upload from
pageable memory, ``.item()``, a ``nonzero``) waits for every kernel already queued: the GPU then
sits idle while the host plans and starts the next row. CUDA's sync debug mode reports each
such call; here every one found while queuing a warm row of the served kernels is a failure,
listed with the line that made it. Rows: plain and with a shared prompt (prefix links), for the
first 4 layers of the 9B and the 35B-A3B shapes.
"""

import warnings

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs need CUDA"),
]


def _rows(vocab: int, seed: int) -> dict:
    """A plain row and a row whose group shares a 700-token prompt (equal lengths: one rounding
    kind); other lengths for another seed, so nothing is reused from a cache keyed by them."""
    from model_runtime.types import SequenceInput

    rng, extra = np.random.default_rng(seed), 37 * seed
    plain = [SequenceInput(rng.integers(0, vocab, n + extra), score_from=1) for n in (900, 1500, 333, 2100)]
    prompt = rng.integers(0, vocab, 700)
    group = [SequenceInput(np.concatenate([prompt, rng.integers(0, vocab, 400 + extra)]), score_from=700)
             for _ in range(4)]
    return {"plain": plain, "shared": group + [SequenceInput(rng.integers(0, vocab, 250), score_from=1)]}


def _syncs_while_queuing(scorer, sequences) -> tuple[list[str], object]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            pending = scorer.queue_row(sequences)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # "called a synchronizing CUDA operation"; the mode's own one-time notice ("is a prototype
    # feature") is not a sync
    sites = [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught
             if "called a synchronizing" in str(w.message)]
    return sites, pending


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "qwen3.5-35b-a3b"])
def test_queuing_a_warm_row_does_not_wait_for_the_device(preset, gpu_record):
    from bench.hf_reference import build_twin
    from model_runtime.scoring.rows import plan_row
    from model_runtime.scoring.scorer import Scorer

    twin = build_twin(preset, num_layers=4)
    scorer = Scorer(twin.loaded, max_batch_tokens=16384, prefix_min_tokens=64)
    scorer.measure_prefix_rounding()
    warm, fresh = _rows(twin.loaded.vocab_size, 0), _rows(twin.loaded.vocab_size, 1)
    assert plan_row(fresh["shared"], 64, scorer.rounding_in_use()).links is not None, "the shared row has no links"
    found = {}
    for kind in ("plain", "shared"):
        scorer.score_row(warm[kind])  # compiles and tunes what a served model's warm-up would
        sites, pending = _syncs_while_queuing(scorer, fresh[kind])
        pending.results()
        found[kind] = sites
    gpu_record(f"host syncs while queuing a row ({preset}[:4])", plain=len(found["plain"]),
               shared=len(found["shared"]), kernels=str(twin.loaded.backends.names))
    assert not any(found.values()), (
        "queuing a row waited for the device at:\n" + "\n".join(f"{k}: {s}" for k, v in found.items() for s in v))


def test_chunk_table_is_flas_own():
    """The table handed to fla (``chunk_indices``) is the one fla builds itself from cu_seqlens."""
    fla_index = pytest.importorskip("fla.ops.utils.index")
    from model_runtime.model.packing import PackedBatch

    packed = PackedBatch.from_lengths((1, 63, 64, 65, 700, 3, 4096), device="cuda")
    want = fla_index.prepare_chunk_indices(packed.cu_seqlens_long, 64)
    got = packed.chunk_table(64)
    assert got.dtype == want.dtype and torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"
