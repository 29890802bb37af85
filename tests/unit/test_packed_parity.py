"""Golden parity: one packed row through packscore equals Hugging Face run on each sequence alone."""

import numpy as np
import pytest
import torch

from model_runtime.model.packing import PackedBatch
from model_runtime.scoring.head import CPU_PACKED_TOLERANCE
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from tests.checkpoints import hf_scores

LENGTHS = (1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 300)
# Against Hugging Face in float32: its own float32 path is about 2e-5 from float64 at temperature 0.7,
# so this leaves room for its rounding and catches any error of our own above it.
TOL = 5e-5
TEMPERATURE = 0.7
TOP_K = 5


def make_batch(vocab: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    seqs = []
    for i, n in enumerate(LENGTHS):
        ids = rng.integers(0, vocab, size=n)
        score_from = 1 if i % 3 == 0 else max(1, min(n, n // 2 + 1)) if i % 3 == 1 else n
        seqs.append(SequenceInput(ids, score_from=score_from, temperature=TEMPERATURE, top_k=TOP_K))
    return seqs


def hf_reference(hf_model, seq: SequenceInput):
    """Unpatched Hugging Face forward on the sequence alone, then float32 log_softmax."""
    return hf_scores(hf_model, seq, TOP_K)


def max_abs(a, b):
    return float(np.max(np.abs(a - b))) if np.size(a) else 0.0


@pytest.fixture(scope="module")
def models(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(kind):
        if kind not in cache:
            path = checkpoint_dir(kind)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[kind] = (load_model(str(path), device="cpu"), hf)
        return cache[kind]

    return get


def test_packed_row_matches_hf_alone(kind, models, capsys):
    loaded, hf = models(kind)
    seqs = make_batch(loaded.vocab_size)
    results = Scorer(loaded).score_row(seqs)
    worst = {"logprobs": 0.0, "entropy": 0.0, "top_k_logprobs": 0.0}
    for i, (seq, got) in enumerate(zip(seqs, results)):
        ref_logp, ref_ent, ref_ids, ref_top = hf_reference(hf, seq)
        assert got.logprobs.shape == (seq.num_scored,)
        worst["logprobs"] = max(worst["logprobs"], max_abs(got.logprobs, ref_logp))
        worst["entropy"] = max(worst["entropy"], max_abs(got.entropy, ref_ent))
        worst["top_k_logprobs"] = max(worst["top_k_logprobs"], max_abs(got.top_k_logprobs, ref_top))
        np.testing.assert_array_equal(got.top_k_ids, ref_ids, err_msg=f"top-k ids of sequence {i} (length {seq.length})")
    with capsys.disabled():
        print(f"\n[parity {kind}] max |diff| " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) + f" (tol {TOL:.0e})")
    for name, diff in worst.items():
        assert diff <= TOL, f"{kind}: {name} max |diff| {diff:.3e} > tol {TOL:.0e}"


def test_changing_one_sequence_leaves_others_bitwise_equal(models):
    loaded, _ = models("qwen3_5")
    scorer = Scorer(loaded)
    seqs = make_batch(loaded.vocab_size)
    before = scorer.score_row(seqs)
    changed = list(seqs)
    victim = 6  # length 64, in the middle of the row
    ids = np.array(changed[victim].input_ids)
    ids[:] = (ids + 7) % loaded.vocab_size
    changed[victim] = SequenceInput(ids, score_from=changed[victim].score_from, temperature=TEMPERATURE, top_k=TOP_K)
    after = scorer.score_row(changed)
    for i, (a, b) in enumerate(zip(before, after)):
        if i == victim:
            assert not np.array_equal(a.logprobs, b.logprobs), "changing the tokens must change the result"
            continue
        np.testing.assert_array_equal(a.logprobs, b.logprobs, err_msg=f"sequence {i} changed")
        np.testing.assert_array_equal(a.entropy, b.entropy, err_msg=f"sequence {i} entropy changed")


def test_permuting_the_row_changes_nothing(models):
    loaded, _ = models("qwen3_5_moe")
    scorer = Scorer(loaded)
    seqs = make_batch(loaded.vocab_size, seed=3)
    base = scorer.score_row(seqs)
    perm = np.random.default_rng(0).permutation(len(seqs))
    shuffled = scorer.score_row([seqs[i] for i in perm])
    for j, i in enumerate(perm):
        diff = max(max_abs(shuffled[j].logprobs, base[i].logprobs), max_abs(shuffled[j].entropy, base[i].entropy))
        # The reference kernels work per segment; the row's products keep their shape, but where a
        # sequence sits in them is up to the GEMM kernel (CPU_PACKED_TOLERANCE).
        assert diff <= CPU_PACKED_TOLERANCE, f"sequence {i} differs by {diff:.3e} after permutation > tol {CPU_PACKED_TOLERANCE:.0e}"
        np.testing.assert_array_equal(shuffled[j].top_k_ids, base[i].top_k_ids)


def test_unpatched_concatenation_leaks_and_is_caught(models):
    """The same row run through the unpatched model as one sequence differs from the reference."""
    loaded, hf = models("qwen3_5")
    seqs = make_batch(loaded.vocab_size)
    ids = torch.as_tensor(np.concatenate([s.input_ids for s in seqs]))[None]
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    packed = PackedBatch.from_lengths([s.length for s in seqs])
    worst = 0.0
    for seq, start in zip(seqs, packed.cu_seqlens_host):
        if seq.num_scored == 0:
            continue
        logp = torch.log_softmax(logits / seq.temperature, -1)[start + seq.score_from - 1 : start + seq.length - 1]
        leaked = logp.gather(1, torch.as_tensor(seq.input_ids[seq.score_from :])[:, None])[:, 0].numpy()
        worst = max(worst, max_abs(leaked, hf_reference(hf, seq)[0]))
    assert worst > 100 * TOL, f"concatenating without boundaries should leak, but max |diff| is only {worst:.3e}"


def test_scorer_packs_into_rows_without_changing_results(models):
    loaded, _ = models("qwen3_next")
    seqs = make_batch(loaded.vocab_size, seed=5)
    one_row = Scorer(loaded, max_batch_tokens=100_000).score(seqs)
    many_rows = Scorer(loaded, max_batch_tokens=310).score(seqs)
    # Rows of other sizes change matmul blocking, so equality is up to float32 rounding only.
    tol = 1e-5
    for i, (a, b) in enumerate(zip(one_row, many_rows)):
        diff = max_abs(a.logprobs, b.logprobs)
        assert diff <= tol, f"sequence {i}: max |diff| {diff:.3e} between row layouts > tol {tol:.0e}"


def test_top_k_elsewhere_in_the_row_changes_nothing(models):
    """A neighbour asking for top-k must not change this sequence's numbers (same head math)."""
    loaded, _ = models("qwen3_5")
    scorer = Scorer(loaded)
    rng = np.random.default_rng(11)
    mine = SequenceInput(rng.integers(0, loaded.vocab_size, 90), score_from=3, temperature=0.3)
    plain = SequenceInput(rng.integers(0, loaded.vocab_size, 40))
    ranked = SequenceInput(plain.input_ids, top_k=TOP_K)
    a = scorer.score_row([mine, plain])[0]
    b = scorer.score_row([mine, ranked])[0]
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.entropy, b.entropy)


@pytest.mark.parametrize("kind", ["tiny", "qwen3_5_moe", "qwen3_next"])
def test_sequence_alone_or_packed_is_within_the_cpu_guarantee(kind, checkpoint_dir):
    """A sequence's numbers move by at most CPU_PACKED_TOLERANCE whatever it is packed with, for
    every architecture: rows padded to a multiple of 16 tokens, a MoE block's experts, router and
    shared gate in fixed 32-row tiles (on CPUs without AVX-512 that is bit for bit)."""
    loaded = load_model("tiny" if kind == "tiny" else str(checkpoint_dir(kind)), device="cpu")
    scorer = Scorer(loaded)
    rng = np.random.default_rng(4)
    mine = SequenceInput(rng.integers(0, loaded.vocab_size, 37), score_from=5, top_k=3)
    alone = scorer.score_row([mine])[0]
    for others in ([1], [5, 100], [300, 2, 64]):
        row = [SequenceInput(rng.integers(0, loaded.vocab_size, n)) for n in others]
        for packed in (scorer.score_row(row + [mine])[-1], scorer.score_row([mine] + row)[0]):
            for name in ("logprobs", "entropy", "top_k_logprobs"):
                diff = max_abs(getattr(packed, name), getattr(alone, name))
                assert diff <= CPU_PACKED_TOLERANCE, f"{name} packed with {others}: {diff:.3e} > tol {CPU_PACKED_TOLERANCE:.0e}"
            np.testing.assert_array_equal(packed.top_k_ids, alone.top_k_ids, err_msg=f"packed with {others}")
