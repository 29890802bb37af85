"""The config knobs of tests/unit/test_config_knobs.py on the GPU's default kernels in bf16, against
Hugging Face's bf16 forward on the GPU (each sequence alone): a kernel that assumes a default
shape (a conv width, a head dim, a rotary width, a head ratio) shows here, not on the CPU's
reference kernels. Target: the bf16 mean |difference| <= 2e-3 of tests/gpu/test_parity_bf16.py (docs/benchmarks.md)."""

import numpy as np
import pytest
import torch

from bench.hf_reference import diff_stats
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from tests.gpu.test_parity_bf16 import MEAN_TOL, hf_alone
from tests.unit.test_config_knobs import HONOURED, saved

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's kernels need CUDA"),
]

LENGTHS = (3, 40, 70, 200)


@pytest.mark.parametrize("case", sorted(HONOURED))
def test_a_knob_scores_as_hugging_face_on_the_gpu(case, tmp_path, gpu_record):
    from model_runtime.scoring.loading import load_model

    kind, text, top, dtype = HONOURED[case]
    model_class, path = saved(tmp_path, kind, text, top, dtype)
    loaded = load_model(str(path), device="cuda", dtype="bfloat16")
    hf = model_class.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    rng = np.random.default_rng(2)
    seqs = [SequenceInput(rng.integers(0, loaded.vocab_size, n), score_from=1) for n in LENGTHS]
    results = Scorer(loaded).score_row(seqs)
    stats = diff_stats([(r.logprobs, r.entropy) for r in results], [hf_alone(hf, s) for s in seqs])
    gpu_record(f"knob {case}", kernels=str(loaded.backends.names), **stats, tol_mean=MEAN_TOL)
    assert stats["logprob_mean"] <= MEAN_TOL, f"{case}: mean |logprob diff| {stats['logprob_mean']:.3e} > {MEAN_TOL:.0e}"
    assert stats["entropy_mean"] <= MEAN_TOL, f"{case}: mean |entropy diff| {stats['entropy_mean']:.3e} > {MEAN_TOL:.0e}"
