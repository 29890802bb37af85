"""bf16 parity on the GPU: one packed row through packscore's fast path against the unpatched
Hugging Face model run on each sequence alone (same dtype, Hugging Face using fla).

Covers the four checkpoint kinds of tests/checkpoints.py and a 4-layer slice of the
Qwen3.5-9B shape (three GDN layers and one full-attention layer at full width, the real
248,320-token vocabulary). Target: mean |difference| <= 2e-3 (docs/benchmarks.md, "Numerics on the GPU").

The default sums the norms' squares in ATen's order (model_runtime/kernels/norm_triton.py) and
rounds the conv where Hugging Face does; what is left on the 9B slice is the short sequences'
matrix products (see SLICE_EXTRA below). How each kernel choice moves the numbers:
docs/benchmarks.md ("Numerics on the GPU").
"""

import numpy as np
import pytest
import torch

from bench.hf_reference import diff_stats, hf_uses_fla
from bench.parity_probe import LENGTHS
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 GPU parity needs CUDA"),
]

MEAN_TOL = 2e-3  # the bf16 GPU target (docs/benchmarks.md, "Numerics on the GPU")


def make_batch(vocab: int, seed: int, temperature: float):
    rng = np.random.default_rng(seed)
    seqs = []
    for i, n in enumerate(LENGTHS):
        score_from = 1 if i % 3 == 0 else max(1, min(n, n // 2 + 1)) if i % 3 == 1 else max(1, n - 1)
        seqs.append(SequenceInput(rng.integers(0, vocab, size=n), score_from=score_from, temperature=temperature))
    return seqs


@torch.inference_mode()
def hf_alone(hf_model, seq: SequenceInput):
    ids = torch.as_tensor(seq.input_ids, dtype=torch.long, device="cuda")[None]
    logits = hf_model(input_ids=ids, use_cache=False).logits[0].float() / seq.temperature
    logp = torch.log_softmax(logits, dim=-1)[seq.score_from - 1 : seq.length - 1]
    targets = ids[0, seq.score_from :]
    return (
        logp.gather(1, targets[:, None])[:, 0].cpu().numpy(),
        (-(logp.exp() * logp).sum(-1)).cpu().numpy(),
    )


def compare(scorer: Scorer, hf_model, seqs):
    results = scorer.score_row(seqs)
    return diff_stats([(r.logprobs, r.entropy) for r in results], [hf_alone(hf_model, s) for s in seqs])


# The kernel sets compared: the default; the varlen attention kernel over the whole row (the
# worker pool's default); Inductor's fused norms, which sum in their own order (the default's
# norms sum in ATen's; the tiny models' widths take ATen's own mean, model_runtime/kernels/norm_triton.py).
VARIANTS = ["default", "attention=varlen", "elementwise=inductor"]


def _overrides(variant: str) -> dict:
    return {} if variant == "default" else dict([variant.split("=")])


def _tiny_cases():
    """Every kind with every variant; varlen on the two MoE kinds is known off (docs/parallel.md)."""
    for kind in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next"):
        for variant in VARIANTS:
            if variant == "attention=varlen" and kind in ("qwen3_5_moe", "qwen3_next"):
                yield pytest.param(kind, variant, marks=pytest.mark.xfail(strict=False, reason=(
                    "varlen sums attention in another order than HF's per-sequence SDPA: 2.4e-3 (qwen3_5_moe) and "
                    "3.5e-3 (qwen3_next) on the H200, above 2e-3; the pool's default, "
                    "--kernels attention=sdpa_fused gives it HF's numbers")))
            else:
                yield pytest.param(kind, variant)


@pytest.mark.parametrize("kind,variant", list(_tiny_cases()))
def test_bf16_packed_matches_hf_alone(kind, variant, checkpoint_dir, gpu_record):
    from transformers import AutoModelForCausalLM

    from model_runtime.scoring.loading import load_model

    path = checkpoint_dir(kind)
    loaded = load_model(str(path), device="cuda", dtype="bfloat16", kernel_overrides=_overrides(variant))
    assert loaded.backends.linear_attention == "fla" and not loaded.backends.fallbacks
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    stats = {}
    for temperature in (1.0, 0.7):
        stats[temperature] = compare(Scorer(loaded), hf_model, make_batch(loaded.vocab_size, 11, temperature))
    worst = {k: max(s[k] for s in stats.values()) for k in stats[1.0]}
    gpu_record(f"parity bf16 {kind} ({variant})", hf_gdn=hf_uses_fla(), kernels=str(loaded.backends.names), **worst, tol_mean=MEAN_TOL)
    assert worst["logprob_mean"] <= MEAN_TOL, f"{kind}: mean |logprob diff| {worst['logprob_mean']:.3e} > {MEAN_TOL:.0e}"
    assert worst["entropy_mean"] <= MEAN_TOL, f"{kind}: mean |entropy diff| {worst['entropy_mean']:.3e} > {MEAN_TOL:.0e}"


# The 9B slice also scores three long sequences: cuBLAS picks its matmul kernel (and so its
# summation order) by the row count, and for fewer than about 778 rows Hugging Face's own
# one-sequence forward takes other kernels than a packed row of thousands of tokens does
# (tests/gpu/test_isolation.py: test_matmul_rows_depend_on_row_count). The design bound is held
# on the sequences of at least LONG tokens, where both sides run the same kernels; all of them
# together must be within the larger of that bound and Hugging Face's own padded batches' spread.
SLICE_EXTRA = (777, 2048, 3001)
LONG = 777


@pytest.fixture(scope="module")
def slice_9b(slice_9b_twin):
    """The 9B slice (shared with the isolation tests) and Hugging Face's references (alone, and
    padded batches), built once: the swaps below change kernels on the loaded model in place (the
    same weights, the same reference)."""
    from bench.hf_reference import score_padded, to_numpy

    twin = slice_9b_twin
    rng = np.random.default_rng(13)
    seqs = make_batch(twin.loaded.vocab_size, 12, 1.0)
    seqs += [SequenceInput(rng.integers(0, twin.loaded.vocab_size, size=n), score_from=n // 3) for n in SLICE_EXTRA]
    with twin.hf() as hf_model:
        reference = [hf_alone(hf_model, s) for s in seqs]
        # 8192 padded tokens a batch keeps the float32 log-softmax over 248,320 words near 20 GB
        padded = to_numpy(score_padded(hf_model, seqs, "cuda", token_budget=8192))
    return twin, seqs, reference, diff_stats(padded, reference)


def _split_stats(results, reference, seqs) -> dict:
    """diff_stats over all sequences, over those of at least LONG tokens and over the rest."""
    ours = [(r.logprobs, r.entropy) for r in results]
    out = {}
    for name, keep in (("all", lambda n: True), ("long", lambda n: n >= LONG), ("short", lambda n: n < LONG)):
        idx = [i for i, s in enumerate(seqs) if keep(s.length)]
        out.update({f"{name}_{k}": v for k, v in diff_stats([ours[i] for i in idx], [reference[i] for i in idx]).items()})
    return out


def _known_off(swap: str, why: str):
    """A non-default kernel known to miss the target: still run and recorded, reported as xfail."""
    return pytest.param(swap, marks=pytest.mark.xfail(reason=why, strict=False))


@pytest.mark.parametrize("swap", [
    "default",
    _known_off("attention=varlen", "another attention kernel than Hugging Face's SDPA: 2.2e-3 on the long sequences"),
    _known_off("gate_projection=row", "one product for the row's gate projections rounds as HF's per-sequence ones "
               "do not (4.3e-3)"),
    _known_off("elementwise=inductor", "Inductor's norms sum in their own order (2.1e-3)"),
    "elementwise=inductor_exact", "elementwise=eager", "conv1d=fla"])
def test_bf16_9b_slice_matches_hf_alone(swap, slice_9b, gpu_record):
    """``gate_projection=row``: the GDN's gate projections as one product for the row (the default
    runs them per segment); ``elementwise=inductor``: norms fused
    by Inductor, whose float32 sums take its own order (the default's, ``inductor_exact``'s and
    ``eager``'s take ATen's, as Hugging Face's do); ``conv1d=fla``: fla's conv, then ATen's SiLU
    (the default does both in one Triton pass, equal bit for bit)."""
    from bench.hf_reference import kernel_swaps

    twin, seqs, reference, hf_padded = slice_9b
    with kernel_swaps(twin.loaded.model, swap):
        results = Scorer(twin.loaded, max_batch_tokens=16384).score_row(seqs)
    stats = _split_stats(results, reference, seqs)
    short_bound = max(MEAN_TOL, hf_padded["logprob_mean"])
    gpu_record(f"parity bf16 qwen3.5-9b[:4] ({swap})", hf_gdn=hf_uses_fla(), kernels=str(twin.loaded.backends.names),
               swap=swap, **stats, hf_padded_vs_alone_logprob_mean=hf_padded["logprob_mean"],
               hf_padded_vs_alone_logprob_max=hf_padded["logprob_max"], tol_mean=MEAN_TOL)
    assert stats["long_logprob_mean"] <= MEAN_TOL, (
        f"9B slice, sequences >= {LONG} tokens: mean |logprob diff| {stats['long_logprob_mean']:.3e} > {MEAN_TOL:.0e}")
    assert stats["all_entropy_mean"] <= MEAN_TOL, f"9B slice: mean |entropy diff| {stats['all_entropy_mean']:.3e} > {MEAN_TOL:.0e}"
    assert stats["all_logprob_mean"] <= short_bound, (
        f"9B slice, all sequences: mean |logprob diff| {stats['all_logprob_mean']:.3e} > {short_bound:.3e} "
        f"(the larger of {MEAN_TOL:.0e} and Hugging Face padded against Hugging Face alone)")
