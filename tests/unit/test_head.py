"""The chunked head equals the plain one, and its memory stays within its budget (measured)."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from model_runtime.kernels.logprob_head import LOGP_FLOOR
from model_runtime.scoring.head import BYTES_PER_LOGIT, chunk_tokens_for_budget, score_positions, score_positions_reference


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["padded16", "fixed"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("top_k", [0, 1, 20], ids=lambda k: f"k{k}")
def test_chunked_equals_unchunked(chunk, top_k, fixed_shape):
    g = torch.Generator().manual_seed(chunk + top_k)
    N, D, V = 133, 32, 300
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.3
    targets = torch.randint(0, V, (N,), generator=g)
    temperature = torch.rand(N, generator=g) * 2 + 0.1
    got = score_positions(hidden, weight, targets, temperature, top_k=top_k, chunk_tokens=chunk, fixed_shape=fixed_shape)
    want = score_positions_reference(hidden, weight, targets, temperature, top_k=top_k)
    # Both sides are float32 with |logits| up to ~60 at temperature 0.1, where float32 spacing
    # is 3.8e-6: a few roundings on two different paths stay below 4e-5.
    tol = 4e-5
    for name in ("logprobs_N", "entropy_N", "top_k_logprobs_NK"):
        a, b = getattr(got, name), getattr(want, name)
        if a is None:
            assert b is None and top_k == 0
            continue
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.3e} > tol {tol:.0e}"
    if top_k:
        # Near-ties may swap places under rounding; the ids must still carry the top-k values.
        full = torch.log_softmax((hidden @ weight.t()) / temperature[:, None], dim=-1)
        diff = (full.gather(1, got.top_k_ids_NK) - want.top_k_logprobs_NK).abs().max().item()
        assert diff <= tol, f"top-k ids do not hold the top-k log-probs: max |diff| {diff:.3e} > tol {tol:.0e}"


@pytest.mark.parametrize("ranking_rows", [1, 5, 64])
def test_a_top_k_ranking_pass_leaves_log_probs_and_entropy_alone(ranking_rows):
    """With a head kernel, a row that ranks gets its log-probs and entropy from that kernel over
    the same chunks as a row that does not: bit for bit the numbers without top-k (a neighbour's
    top-k must not move them), and the ranking equal to the plain path's."""
    from model_runtime.kernels.logprob_head import logprob_entropy_torch

    g = torch.Generator().manual_seed(ranking_rows)
    N, D, V = 133, 32, 300
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.3
    targets = torch.randint(0, V, (N,), generator=g)
    temperature = torch.rand(N, generator=g) * 2 + 0.1
    run = lambda k, fn: score_positions(hidden, weight, targets, temperature, top_k=k, chunk_tokens=64,  # noqa: E731
                                        top_k_rows=ranking_rows, logprob_fn=fn)
    plain, ranked, plain_ranked = run(0, logprob_entropy_torch), run(4, logprob_entropy_torch), run(4, None)
    for field in ("logprobs_N", "entropy_N"):
        got, want = getattr(ranked, field), getattr(plain, field)
        assert torch.equal(got, want), f"{field} with top-k off without by {(got - want).abs().max():.3e} (tol 0)"
    differ = int((ranked.top_k_ids_NK != plain_ranked.top_k_ids_NK).sum())
    assert differ == 0, f"{differ} top-k ids differ between the two logprob functions"
    diff = (ranked.top_k_logprobs_NK - plain_ranked.top_k_logprobs_NK).abs().max().item()
    assert diff == 0, f"ranking pass top-k log-probs differ from the plain path's by {diff:.3e} (tolerance 0)"


def test_chunk_size_follows_the_budget():
    assert chunk_tokens_for_budget(248_320, 1 << 30) == (1 << 30) // (248_320 * BYTES_PER_LOGIT)
    assert chunk_tokens_for_budget(10**9, 1) == 1


def test_temperature_is_a_divisor_of_the_logits():
    hidden, weight = torch.tensor([[1.0, 0.0, 0.0]] * 3), torch.eye(3) * 2.0
    out = score_positions(hidden, weight, torch.tensor([0, 0, 0]), torch.tensor([1.0, 2.0, 0.5]))
    for t, logp in zip([1.0, 2.0, 0.5], out.logprobs_N.tolist()):
        z = torch.tensor([2.0, 0.0, 0.0]) / t
        assert logp == pytest.approx((z[0] - torch.logsumexp(z, 0)).item(), abs=1e-6)


MEASURE = textwrap.dedent(
    """
    import json, resource, sys, torch
    from model_runtime.scoring.head import chunk_tokens_for_budget, score_positions
    torch.set_num_threads(1)
    N, D, V, budget = 512, 64, 248_320, int(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    targets, temps = torch.randint(0, V, (N,), generator=g), torch.ones(N)
    # Touch every page of the inputs, and run one tiny chunk so first-use allocations are done.
    score_positions(hidden[:2], weight, targets[:2], temps[:2], top_k=20, chunk_tokens=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    score_positions(hidden, weight, targets, temps, top_k=20, chunk_tokens=chunk_tokens_for_budget(V, budget))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_increase_bytes": (after - before) * 1024}))
    """
)


def test_head_peak_memory_stays_within_budget_with_a_large_vocabulary():
    """Full float32 logits here would be 512 x 248320 x 4 = 508 MB; the budget is 64 MiB."""
    budget = 64 << 20
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(budget)], capture_output=True, text=True, timeout=300, check=True
    )
    increase = json.loads(out.stdout.strip().splitlines()[-1])["peak_increase_bytes"]
    print(f"head peak increase {increase / 2**20:.1f} MiB, budget {budget / 2**20:.0f} MiB")
    # ru_maxrss is a process-wide high-water mark; allow allocator slack of a quarter of the budget.
    assert increase <= budget * 1.25, f"head grew the process by {increase / 2**20:.1f} MiB > budget 64 MiB * 1.25"


@pytest.mark.parametrize("top_k", [0, 3], ids=lambda k: f"k{k}")
def test_every_finite_positive_temperature_gives_finite_numbers(top_k):
    """The API allows any finite T > 0. Tiny T makes the distribution one-hot: the arg-max token
    gets log p = 0, the others log p = -inf, reported as the lowest float32 (JSON has no -inf);
    entropy is 0. Moderate T must agree with a float64 log-softmax of z / T."""
    g = torch.Generator().manual_seed(3)
    temps = torch.tensor([5e-324, 1e-45, 1e-40, 1e-30, 1e-6, 1e-3, 1.0, 1e3, 1e30, 1e300, 3.5e38], dtype=torch.float64)
    N, D, V = temps.numel(), 16, 300
    hidden, weight = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    logits = hidden @ weight.t()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::2] = logits[::2].argmax(dim=-1)
    got = score_positions(hidden, weight, targets, temps, top_k=top_k, chunk_tokens=4)
    for name in ("logprobs_N", "entropy_N", "top_k_logprobs_NK"):
        value = getattr(got, name)
        if value is not None:
            assert torch.isfinite(value).all(), f"{name} not finite: {value.tolist()}"
    assert (got.entropy_N >= 0).all(), got.entropy_N.tolist()
    for i in range(N):
        t = float(temps[i])
        if t < 1e-20:  # one-hot to float32 precision
            want_lp = 0.0 if i % 2 == 0 else LOGP_FLOOR
            assert float(got.logprobs_N[i]) == want_lp or (i % 2 and float(got.logprobs_N[i]) < -1e15), (i, t, got.logprobs_N[i])
            assert float(got.entropy_N[i]) == 0.0, (i, t, got.entropy_N[i])
        else:
            ref = torch.log_softmax(logits[i].double() / t, dim=-1)
            want_lp = float(ref[targets[i]])
            want_ent = float(-(ref.exp() * ref).sum())
            tol = 1e-5 * max(1.0, abs(want_lp))
            assert abs(float(got.logprobs_N[i]) - want_lp) <= tol, f"T={t}: log p {float(got.logprobs_N[i])} vs {want_lp}"
            assert abs(float(got.entropy_N[i]) - want_ent) <= 1e-4, f"T={t}: entropy {float(got.entropy_N[i])} vs {want_ent}"


def test_float32_temperatures_stay_finite_and_normal():
    """What both heads divide by: never 0 (an underflowing T) nor inf (an overflowing one: the
    fused kernel would compute inf / inf = NaN in its masked columns)."""
    from model_runtime.kernels.logprob_head import MAX_TEMPERATURE, MIN_TEMPERATURE, temperature32

    t = temperature32(torch.tensor([5e-324, 1e-40, 0.7, 1e300, 3.5e38], dtype=torch.float64))
    assert torch.isfinite(t).all() and (t >= MIN_TEMPERATURE).all(), t.tolist()
    assert t[0] == MIN_TEMPERATURE and t[3] == MAX_TEMPERATURE and t[4] == MAX_TEMPERATURE
    assert abs(float(t[2]) - 0.7) < 1e-7


@pytest.mark.parametrize("rows", [1, 3, 50])
def test_top_k_ranks_ties_by_lowest_id_whatever_k(rows):
    """Log-probs with many exact ties (few distinct values, -0.0 among them): the ranking equals a
    stable sort's for every k, so a position's first k ids do not depend on the k its row ranked."""
    from model_runtime.scoring.head import top_k_ranked, top_k_ranked_reference

    g = torch.Generator().manual_seed(rows)
    V = 997
    levels = torch.tensor([0.0, -0.0, -0.5, -1.25, -3.0, -7.0, -1e30, 2.5e-39])  # a denormal too
    logp = levels[torch.randint(0, len(levels), (rows, V), generator=g)]
    for k in (1, 3, 20):
        got_v, got_i = top_k_ranked(logp, k)
        want_v, want_i = top_k_ranked_reference(logp, k)
        assert torch.equal(got_i, want_i), f"k={k}: ids {got_i[0].tolist()} != {want_i[0].tolist()}"
        assert torch.equal(got_v, want_v), f"k={k}: values off by {(got_v - want_v).abs().max():.3e} (tol 0)"
    first3 = top_k_ranked(logp, 3)[1]
    assert torch.equal(top_k_ranked(logp, 20)[1][:, :3], first3), "the first 3 ids depend on k"


@pytest.mark.parametrize("prefix_min_tokens", [0, 16], ids=["unshared", "shared"])
def test_a_temperature_above_float32s_range_is_planned_as_its_largest_without_a_warning(prefix_min_tokens):
    """A finite temperature the API allows but float32 cannot hold (1e39) is the head's largest
    float32 already on the host, without numpy's 'overflow encountered in cast' on stderr."""
    import warnings

    from model_runtime.kernels.logprob_head import MAX_TEMPERATURE
    from model_runtime.scoring.rows import plan_row
    from model_runtime.types import SequenceInput

    prompt = list(range(5, 205))
    seqs = [SequenceInput(input_ids=np.array(prompt + [20 + i, 30 + i]), score_from=200, temperature=1e39)
            for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning fails the test
        plan = plan_row(seqs, prefix_min_tokens)
    assert (plan.temperature_N == np.float32(MAX_TEMPERATURE)).all(), plan.temperature_N.tolist()
    assert (plan.tokens_saved > 0) == bool(prefix_min_tokens), plan.tokens_saved
