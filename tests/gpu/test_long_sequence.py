"""A 131,072-token single sequence scores on one H200 with the Qwen3.5-9B shape (random bf16
weights), without running out of memory, with finite log-probabilities and entropies.

``PACKSCORE_GPU_SMOKE=1`` runs 16,384 tokens instead (the suite's quick pass).
"""

import time

import numpy as np
import pytest
import torch

from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from tests.gpu.conftest import smoke

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the long-sequence test needs CUDA"),
]


def test_131k_tokens_one_sequence_9b(gpu_record):
    from model_runtime.scoring.loading import load_model

    tokens = 16384 if smoke() else 131072
    loaded = load_model("qwen3.5-9b", device="cuda", dtype="bfloat16")
    scorer = Scorer(loaded, max_batch_tokens=tokens)
    seq = SequenceInput(np.random.default_rng(0).integers(0, loaded.vocab_size, tokens), score_from=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    started = time.perf_counter()
    result = scorer.score([seq])[0]  # first call: includes compiling and autotuning at this shape
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    result = scorer.score([seq])[0]
    second_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated()
    gpu_record(
        "long sequence 9B",
        tokens=tokens,
        weights_gib=base / 2**30,
        peak_gib=peak / 2**30,
        activation_peak_gib=(peak - base) / 2**30,
        first_call_s=first_s,
        second_call_s=second_s,
        tokens_per_s=tokens / second_s,
        logprob_mean=float(result.logprobs.mean()),
        entropy_mean=float(result.entropy.mean()),
    )
    assert result.logprobs.shape == (tokens - 1,)
    assert np.isfinite(result.logprobs).all() and np.isfinite(result.entropy).all()
    assert (result.logprobs <= 0).all() and (result.entropy >= -1e-4).all()
    del scorer, loaded
    torch.cuda.empty_cache()
