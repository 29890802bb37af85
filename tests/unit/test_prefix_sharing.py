"""Shared prefixes: a group's common prompt run once gives the numbers of every sequence run whole.

Kernels: a row where continuations link to a prefix segment against the same sequences laid out
whole, on fresh random inputs. Model: the tiny checkpoints of every architecture, shared against
unshared scoring in float32 (tolerance 1e-5, docs/prefix-sharing.md's float32 bound for shared prefixes).
"""

import dataclasses

import numpy as np
import pytest
import torch

from model_runtime.kernels.attention import causal_attention_reference, causal_attention_sdpa
from model_runtime.kernels.conv import causal_conv1d_reference, continue_windows
from model_runtime.kernels.gate_projection import gate_projection_segment, narrow_products
from model_runtime.kernels.linear_attention import FLA_CHUNK, chunked_on_linked_row, gated_delta_rule_reference
from model_runtime.model.packing import PackedBatch, PrefixLinks
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.prefix import ALIGN, find_groups, pack_groups_first_fit, tokens_saved
from model_runtime.scoring.rows import plan_row
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput

TOL = 1e-5
ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def report(name, got, want, tol=TOL):
    diff = (torch.as_tensor(got).double() - torch.as_tensor(want).double()).abs().max().item()
    assert diff <= tol, f"{name}: max |diff| {diff:.3e} > tol {tol:.0e}"


# ---------------------------------------------------------------- kernels on random inputs

CASES = [
    # (prefix length, continuation lengths, lengths of unrelated sequences)
    (9, (5, 1, 2), (4,)),
    (2, (3, 4), ()),  # a parent shorter than the conv window
    (70, (1, 66, 8), (3, 12)),
]


def case_id(case):
    prefix, conts, loose = case
    return f"P{prefix}-C{'-'.join(map(str, conts))}-U{len(loose)}"


class Rows:
    """A linked row ``[prefix, unrelated..., continuations...]`` and the same sequences whole."""

    def __init__(self, prefix: int, conts, loose):
        self.prefix, self.conts, self.loose = prefix, tuple(conts), tuple(loose)
        roots = 1 + len(self.loose)
        self.linked = PackedBatch.from_lengths(
            (prefix, *self.loose, *self.conts), links=PrefixLinks((-1,) * roots + (0,) * len(self.conts), roots)
        )
        self.whole = PackedBatch.from_lengths((*(prefix + c for c in self.conts), *self.loose))

    def make(self, g: torch.Generator, *shape):
        """``(linked_T..., whole_T...)``: one random tensor per token layout, the same values."""
        def rand(n):
            return torch.randn(n, *shape, generator=g)

        prefix, conts, loose = rand(self.prefix), [rand(n) for n in self.conts], [rand(n) for n in self.loose]
        linked = torch.cat([prefix, *loose, *conts])
        whole = torch.cat([torch.cat([prefix, c]) for c in conts] + loose)
        return linked, whole

    def whole_of_linked(self, whole_T: torch.Tensor) -> torch.Tensor:
        """The whole row's values at the linked row's tokens (prefix from the first sequence)."""
        offsets = self.whole.cu_seqlens_host
        n = len(self.conts)
        parts = [whole_T[: self.prefix]]
        parts += [whole_T[offsets[n + j] : offsets[n + j + 1]] for j in range(len(self.loose))]
        parts += [whole_T[offsets[j] + self.prefix : offsets[j + 1]] for j in range(n)]
        return torch.cat(parts)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_delta_rule_reference_continues_the_parent_state(case):
    rows, g = Rows(*case), torch.Generator().manual_seed(1)
    q, q_w = rows.make(g, 2, 8)
    k, k_w = rows.make(g, 2, 8)
    v, v_w = rows.make(g, 4, 6)
    a, a_w = rows.make(g, 4)
    b, b_w = rows.make(g, 4)
    gate, gate_w = -torch.nn.functional.softplus(a), -torch.nn.functional.softplus(a_w)
    beta, beta_w = b.sigmoid(), b_w.sigmoid()
    got = gated_delta_rule_reference(q, k, v, gate, beta, rows.linked)
    want = gated_delta_rule_reference(q_w, k_w, v_w, gate_w, beta_w, rows.whole)
    report("delta rule linked vs whole", got, rows.whole_of_linked(want))


def chunk_rounded_recurrence(q, k, v, g, beta, packed, initial, *, keep_final):
    """``_fla_chunk``'s contract with numbers that follow where chunks fall: the float32
    recurrence, its state rounded to bf16 at the start of every ``FLA_CHUNK``-token chunk but a
    segment's first one from zeros (as fla's outputs read a chunk's starting state in bf16)."""
    o, finals = torch.empty_like(v), []
    for i, (start, end) in enumerate(packed.segments()):
        state = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1]) if initial is None else initial[i].clone()
        for t in range(start, end):
            if (t - start) % FLA_CHUNK == 0 and (t > start or initial is not None):
                state = state.to(torch.bfloat16).float()
            state = state * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t], state)
        finals.append(state)
    return o, (torch.stack(finals) if keep_final else None)


@pytest.mark.parametrize("case", [
    (70, (1, 57, 58, 59, 130), (3,)),  # a tail of 6: heads of 1, 57, 58 and 58 + a body
    (9, (5, 1, 60), ()),  # a parent shorter than a chunk
    (128, (1, 64, 65), (12,)),  # on a boundary: no heads
    (200, (3,), (70,)),
], ids=case_id)
def test_chunked_delta_rule_on_a_linked_row_cuts_chunks_as_the_unshared_sequences(case):
    """Bit for bit against the whole sequences, with numbers that change where a chunk starts."""
    rows, g = Rows(*case), torch.Generator().manual_seed(2)
    # Inputs made on the whole row and read at the linked row's tokens: the CPU's vectorised
    # pointwise ops round a row's last elements otherwise.
    whole = [rows.make(g, *shape)[1] for shape in ((2, 8), (2, 8), (2, 6), (2,), (2,))]
    whole[1] = torch.nn.functional.normalize(whole[1], dim=-1)
    whole[3], whole[4] = -torch.nn.functional.softplus(whole[3]), whole[4].sigmoid()
    linked = [rows.whole_of_linked(x) for x in whole]
    got = chunked_on_linked_row(chunk_rounded_recurrence, *linked, rows.linked)
    want = rows.whole_of_linked(chunk_rounded_recurrence(*whole, rows.whole, None, keep_final=False)[0])
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3e}, want 0"
    if rows.prefix % FLA_CHUNK:  # a continuation run from its parent's end would not be
        state = chunk_rounded_recurrence(*(x[: rows.prefix] for x in linked), PackedBatch.from_lengths([rows.prefix]),
                                         None, keep_final=True)[1]
        n = len(rows.loose)
        first = rows.linked.cu_seqlens_host[1 + n]
        naive = chunk_rounded_recurrence(*(x[first:] for x in linked), PackedBatch.from_lengths(rows.conts),
                                         state.expand(len(rows.conts), -1, -1, -1), keep_final=False)[0]
        assert not torch.equal(naive, want[first:]), "the naive continuation equals the reference: this case no longer tests the rounding"


def test_chunked_delta_rule_with_several_parents_and_padding():
    """Parents with and without a tail, a loose sequence and a padding segment in one row."""
    lengths = (70, 128, 9, 5, 1, 200, 3, 60, 64, 7, 11)
    parents = (-1, -1, -1, -1, 0, 1, 0, 2, 0, 1, -1)
    packed = PackedBatch.from_lengths(lengths, links=PrefixLinks(parents, 4), padding_segments=(10,))
    g = torch.Generator().manual_seed(3)
    T, layout = packed.total_tokens, packed.linked
    q, k, v = (torch.randn(T, 2, d, generator=g) for d in (8, 8, 6))
    k = torch.nn.functional.normalize(k, dim=-1)
    gate, beta = -torch.nn.functional.softplus(torch.randn(T, 2, generator=g)), torch.rand(T, 2, generator=g)
    got = chunked_on_linked_row(chunk_rounded_recurrence, q, k, v, gate, beta, packed)
    whole = [x.index_select(0, layout.whole_index_Tw) for x in (q, k, v, gate, beta)]
    want = chunk_rounded_recurrence(*whole, layout.whole, None, keep_final=False)[0].index_select(0, layout.own_rows_T)
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3e}, want 0"


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("splits", [None, (8, 8, 16)], ids=["one", "splits"])
def test_conv_reference_and_window_fix_continue_the_parent_window(case, splits):
    rows, g = Rows(*case), torch.Generator().manual_seed(2)
    x, x_w = rows.make(g, 32)
    weight = torch.randn(32, 4, generator=g)
    want = causal_conv1d_reference(x_w, weight, rows.whole, splits=splits)
    got = causal_conv1d_reference(x, weight, rows.linked, splits=splits)
    # The fast backends' path: convolve as if nothing were linked, then fix the windows.
    def unlinked(x_TC, w_CW, packed, splits=None):
        return causal_conv1d_reference(x_TC, w_CW, dataclasses.replace(packed, links=None), splits=splits)

    fixed = continue_windows(unlinked, x, weight, rows.linked, splits, unlinked(x, weight, rows.linked, splits))
    as_one = (lambda t: t) if splits is None else (lambda t: torch.cat(t, dim=-1))
    report("conv reference linked vs whole", as_one(got), rows.whole_of_linked(as_one(want)))
    report("conv window fix vs whole", as_one(fixed), rows.whole_of_linked(as_one(want)))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("fn", [causal_attention_reference, causal_attention_sdpa], ids=["reference", "sdpa"])
def test_attention_reads_the_parent_keys(case, fn):
    rows, g = Rows(*case), torch.Generator().manual_seed(3)
    q, q_w = rows.make(g, 4, 16)
    k, k_w = rows.make(g, 2, 16)
    v, v_w = rows.make(g, 2, 16)
    got = fn(q, k, v, rows.linked, 0.25)
    want = causal_attention_reference(q_w, k_w, v_w, rows.whole, 0.25)
    report(f"attention {fn.__name__} linked vs whole", got, rows.whole_of_linked(want))


def _bottom_right_reference(q_Tq, k_Tw, v_Tw, queries, whole, scale=0.25):
    """Float32 attention of each query segment, the suffix of its key segment, causal to the keys' end."""
    from torch.nn.attention.bias import causal_lower_right

    heads = lambda t: t.transpose(0, 1)[None].float()  # noqa: E731
    out = [torch.nn.functional.scaled_dot_product_attention(
        heads(q_Tq[qs:qe]), heads(k_Tw[ks:ke]), heads(v_Tw[ks:ke]), attn_mask=causal_lower_right(qe - qs, ke - ks),
        scale=scale, enable_gqa=True)[0].transpose(0, 1) for (qs, qe), (ks, ke) in zip(queries.segments(), whole.segments())]
    return torch.cat(out).to(q_Tq.dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_own_queries_once_against_whole_keys_are_the_whole_sequence_rows(case):
    """``LinkedLayout.on_own_queries`` (the varlen backend's linked rows): every token's query once,
    a suffix of its whole sequence, with that sequence's keys; the prompt's queries are not repeated."""
    rows, g = Rows(*case), torch.Generator().manual_seed(8)
    q, q_w = rows.make(g, 4, 16)
    k, k_w = rows.make(g, 2, 16)
    v, v_w = rows.make(g, 2, 16)
    layout = rows.linked.linked
    assert sorted(layout.query_tokens_T.tolist()) == list(range(rows.linked.total_tokens)), "every token queries once"
    assert layout.queries.total_tokens == rows.linked.total_tokens < layout.whole.total_tokens
    got = layout.on_own_queries(_bottom_right_reference, q, k, v)
    want = rows.whole_of_linked(causal_attention_reference(q_w, k_w, v_w, rows.whole, 0.25))
    report("own queries against whole keys vs whole attention", got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("fn", [causal_attention_reference, causal_attention_sdpa], ids=["reference", "sdpa"])
def test_attention_of_a_continuation_is_the_whole_sequence_tail_bit_for_bit(case, fn, dtype):
    # The same backend over the unshared row: the linked row runs it on the same whole sequences
    # (the prefix's rows are read from its first continuation's), so every row is equal to the bit.
    rows, g = Rows(*case), torch.Generator().manual_seed(4)
    q, q_w = (t.to(dtype) for t in rows.make(g, 4, 16))
    k, k_w = (t.to(dtype) for t in rows.make(g, 2, 16))
    v, v_w = (t.to(dtype) for t in rows.make(g, 2, 16))
    got = fn(q, k, v, rows.linked, 0.25)
    want = rows.whole_of_linked(fn(q_w, k_w, v_w, rows.whole, 0.25))
    report(f"attention {fn.__name__} {dtype} linked vs whole (bit for bit)", got, want, tol=0.0)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_narrow_gate_products_of_a_linked_row_are_the_whole_sequences_bit_for_bit(case):
    # On a GPU a product per segment rounds with the segment's row count, so a linked row runs it
    # over the unshared sequences; a CPU product rounds alike at any row count, so what this
    # checks here is that every token's row comes back in its place.
    rows, g = Rows(*case), torch.Generator().manual_seed(5)
    x, x_w = (t.to(torch.bfloat16) for t in rows.make(g, 64))
    linear = torch.nn.Linear(64, 8, bias=False).to(torch.bfloat16)
    (got,) = narrow_products(gate_projection_segment, (linear,), x, rows.linked)
    want = rows.whole_of_linked(gate_projection_segment(linear, x_w, rows.whole.segment_bounds))
    report("narrow gate product linked vs whole (bit for bit)", got.float(), want.float(), tol=0.0)


def test_whole_sequence_view_of_a_linked_row():
    # [prefix 3 | unrelated 2 | continuation 2 | continuation 1]
    packed = PackedBatch.from_lengths((3, 2, 2, 1), links=PrefixLinks((-1, -1, 0, 0), 2))
    layout = packed.linked
    assert layout.whole.lengths == (2, 5, 4) and layout.whole.links is None
    assert layout.whole_index_Tw.tolist() == [3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 7]
    # The prefix's rows are the head of its first continuation's sequence.
    assert layout.own_rows_T.tolist() == [2, 3, 4, 0, 1, 5, 6, 10]


def test_links_must_point_at_roots():
    with pytest.raises(ValueError, match="root"):
        PrefixLinks((-1, 0, 1), roots=1)
    with pytest.raises(ValueError, match="cannot have parents"):
        PrefixLinks((0, -1), roots=2)


def test_continuation_positions_go_on_from_the_parent():
    packed = PackedBatch.from_lengths((3, 2, 2), links=PrefixLinks((-1, 0, 0), 1))
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert packed.linked.local_positions.tolist() == [0, 1, 2, 0, 1, 0, 1]


# ---------------------------------------------------------------- row plans


def group_row(vocab: int, seed: int = 0):
    """Two groups, unrelated sequences, score_from inside a prefix, a member equal to its prompt,
    duplicates, and two temperatures inside one group."""
    rng = np.random.default_rng(seed)
    prompt, prompt2 = rng.integers(0, vocab, 140), rng.integers(0, vocab, 70)
    tail = lambda n: rng.integers(0, vocab, n)  # noqa: E731
    dup = np.concatenate([prompt2, tail(10)])
    return [
        SequenceInput(np.concatenate([prompt, tail(20)]), score_from=140),
        SequenceInput(tail(33), score_from=2),
        SequenceInput(np.concatenate([prompt, tail(7)]), score_from=10, top_k=3),
        SequenceInput(prompt.copy(), score_from=100),  # equal to the group's common prefix
        SequenceInput(dup, score_from=1, temperature=0.7),
        SequenceInput(np.concatenate([prompt, tail(30)]), score_from=139, temperature=0.7),
        SequenceInput(dup.copy(), score_from=1, temperature=0.7),  # a duplicate
        SequenceInput(prompt[:50].copy(), score_from=5),  # too short to share
        SequenceInput(np.concatenate([prompt, tail(1)]), score_from=60, temperature=0.7),
    ]


def test_groups_share_their_aligned_common_prefix():
    seqs = group_row(500)
    groups = find_groups(seqs, 64)
    assert [(g.members, g.shared) for g in groups] == [((0, 2, 3, 5, 8), 128), ((4, 6), 64)]
    assert tokens_saved(seqs, 64) == 4 * 128 + 64
    assert find_groups(seqs, 0) == [] and find_groups(seqs, 129) == []
    plan = plan_row(seqs, 64)
    assert plan.tokens_saved == 4 * 128 + 64
    assert sum(plan.lengths) == sum(s.length for s in seqs) - plan.tokens_saved
    assert list(plan.positions_N) == sorted(plan.positions_N)
    assert plan.expand_N.size == sum(s.num_scored for s in seqs)
    # Prefix positions asked for by several sequences at one temperature are scored once.
    assert plan.positions_N.size < plan.expand_N.size


def test_packing_keeps_a_group_in_one_row_and_cuts_one_too_large():
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 500, 200)
    seqs = [SequenceInput(np.concatenate([prompt, rng.integers(0, 500, 50)])) for _ in range(6)]
    seqs += [SequenceInput(rng.integers(0, 500, 120)) for _ in range(3)]
    shared = (200 - 1) // ALIGN * ALIGN
    # The group costs shared + 6 * (250 - shared) tokens: one row of that budget holds all six.
    budget = shared + 6 * (250 - shared)
    rows = pack_groups_first_fit(seqs, budget, 64)
    assert any(set(range(6)) <= set(r) for r in rows), rows
    assert sorted(i for r in rows for i in r) == list(range(9))
    cut = pack_groups_first_fit(seqs, budget - 1, 64)
    assert sorted(i for r in cut for i in r) == list(range(9))
    for r in cut:
        assert sum(seqs[i].length for i in r) - tokens_saved([seqs[i] for i in r], 64) <= budget - 1


# ---------------------------------------------------------------- the model, three architectures


@pytest.fixture(scope="module")
def loaded_models(checkpoint_dir):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = load_model(str(checkpoint_dir(kind)), device="cpu")
        return cache[kind]

    return get


def compare_results(name, got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.logprobs.shape == b.logprobs.shape, f"{name}: sequence {i} has {a.logprobs.shape} against {b.logprobs.shape}"
        if not a.logprobs.size:
            continue
        report(f"{name}: sequence {i} log-probs", a.logprobs, b.logprobs)
        report(f"{name}: sequence {i} entropy", a.entropy, b.entropy)
        if b.top_k_ids is not None:
            np.testing.assert_array_equal(a.top_k_ids, b.top_k_ids, err_msg=f"{name}: sequence {i} top-k ids")
            report(f"{name}: sequence {i} top-k log-probs", a.top_k_logprobs, b.top_k_logprobs)


def shared_equals_unshared(name, loaded, seqs, capsys):
    """Scores ``seqs`` in one row unshared and shared, prints the worst difference and compares;
    returns the unshared results."""
    plain = Scorer(loaded).score_row(seqs)
    shared = Scorer(loaded, prefix_min_tokens=64).score_row(seqs)
    worst = max(float(np.abs(a.logprobs - b.logprobs).max(initial=0.0)) for a, b in zip(shared, plain))
    with capsys.disabled():
        print(f"\n[prefix sharing {name}] max |dlogp| shared vs unshared {worst:.2e} (tol {TOL:.0e})")
    compare_results(name, shared, plain)
    return plain


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shared_row_equals_unshared(arch, loaded_models, capsys):
    loaded = loaded_models(arch)
    shared_equals_unshared(arch, loaded, group_row(loaded.vocab_size, seed=1), capsys)


def test_a_member_scored_alone_or_with_its_group_agrees(loaded_models):
    """Packing invariance: whether its group-mates came in the same request does not matter."""
    loaded = loaded_models("qwen3_5")
    seqs = group_row(loaded.vocab_size, seed=2)
    scorer = Scorer(loaded, prefix_min_tokens=64, max_batch_tokens=100_000)
    together = scorer.score(seqs)
    apart = scorer.score(seqs[:4]) + scorer.score(seqs[4:])
    compare_results("one request vs two", apart, together)
    members = (2, 3, 8)  # score_from inside the prefix, equal to the prompt, one token of its own
    compare_results("alone vs with the group", [scorer.score([seqs[i]])[0] for i in members], [together[i] for i in members])


def test_scorer_score_with_small_rows_equals_unshared(loaded_models):
    loaded = loaded_models("qwen3_5")
    seqs = group_row(loaded.vocab_size, seed=3)
    plain = Scorer(loaded, max_batch_tokens=100_000).score(seqs)
    shared = Scorer(loaded, max_batch_tokens=300, prefix_min_tokens=64).score(seqs)
    compare_results("rows of 300 tokens, shared", shared, plain)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiles_backend_shares_among_every_member_and_equals_unshared(arch, checkpoint_dir, capsys):
    """``--kernels gate_projection=tiles``: the narrow products compute a row alike in a product of
    any rows, so the model reports none whose rounding follows the length (every member shares),
    a linked row runs them over its own tokens, and shared scoring equals unshared scoring."""
    from model_runtime.scoring.rounding import measure, narrow_weights

    loaded = load_model(str(checkpoint_dir(arch)), device="cpu", kernel_overrides={"gate_projection": "tiles"})
    assert loaded.backends.names["gate_projection"] == "tiles"
    assert narrow_weights(loaded.model) == [], "a row-invariant backend leaves no product to measure"
    assert measure(loaded.model, 4096).kind_count == 1
    seqs = group_row(loaded.vocab_size, seed=4)
    plain = shared_equals_unshared(f"{arch}, gate_projection=tiles", loaded, seqs, capsys)
    default = load_model(str(checkpoint_dir(arch)), device="cpu")
    compare_results(f"{arch} tiles vs segment, unshared", plain, Scorer(default).score_row(seqs))


def test_tiles_narrow_products_ignore_links_and_cuts():
    from model_runtime.kernels.gate_projection import gate_projection_tiles, row_invariant
    from model_runtime.kernels.moe_experts import in_row_tiles

    rows, g = Rows(*CASES[0]), torch.Generator().manual_seed(6)
    x, _ = rows.make(g, 64)
    linear = torch.nn.Linear(64, 8, bias=False)
    assert row_invariant(gate_projection_tiles) and not row_invariant(gate_projection_segment)
    want = in_row_tiles(linear, x)
    (linked,) = narrow_products(gate_projection_tiles, (linear,), x, rows.linked)
    (cut,) = narrow_products(gate_projection_tiles, (linear,), x, rows.linked, local_bounds=((0, 5), (5, x.shape[0])))
    report("tiles on a linked row", linked, want, tol=0.0)
    report("tiles on a shard's cut segments", cut, want, tol=0.0)


def boundary_row(vocab: int, seed: int = 5):
    """Members one token past the shared segment (strict prefixes of their mates, 65 and 129
    tokens) or a chunk past it (192), duplicates of them, score_from at 1, inside the shared
    segment and at the length."""
    rng = np.random.default_rng(seed)
    p, q, r = rng.integers(0, vocab, 200), rng.integers(0, vocab, 100), rng.integers(0, vocab, 250)
    return [
        SequenceInput(p[:129].copy(), score_from=1),
        SequenceInput(p[:129].copy(), score_from=128),  # a duplicate, scored from inside the shared segment
        SequenceInput(p.copy(), score_from=129, top_k=3),  # the others are strict prefixes of it
        SequenceInput(p[:129].copy(), score_from=129),  # nothing scored
        SequenceInput(q[:65].copy(), score_from=65),
        SequenceInput(q[:65].copy(), score_from=2, temperature=0.7),
        SequenceInput(q.copy(), score_from=64),
        SequenceInput(q[:1].copy(), score_from=1),
        SequenceInput(q[:2].copy(), score_from=1),
        SequenceInput(r[:192].copy(), score_from=120),  # a multiple of 64 long: shares 128, not 192
        SequenceInput(r.copy(), score_from=191),
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_strict_prefixes_and_duplicates_shared_equal_unshared_and_hugging_face(arch, loaded_models, checkpoint_dir, capsys):
    """A member one token longer than the shared segment, its duplicates and its longer mates:
    shared equals unshared (1e-5) and Hugging Face one sequence at a time (1e-4, test_packed_parity)."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import hf_scores

    loaded = loaded_models(arch)
    seqs = boundary_row(loaded.vocab_size)
    assert [(g.members, g.shared) for g in find_groups(seqs, 64)] == [((0, 1, 2, 3), 128), ((4, 5, 6), 64), ((9, 10), 128)]
    shared = Scorer(loaded, prefix_min_tokens=64).score_row(seqs)
    shared_equals_unshared(f"{arch} strict prefixes", loaded, seqs, capsys)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint_dir(arch), dtype=torch.float32).eval()
    for i, (seq, got) in enumerate(zip(seqs, shared)):
        logprobs, entropy, _, _ = hf_scores(hf, seq, 1)
        assert got.logprobs.shape == (seq.length - seq.score_from,), f"sequence {i}: {got.logprobs.shape}"
        if not seq.num_scored:
            continue
        report(f"{arch} sequence {i} log-probs vs Hugging Face", got.logprobs, logprobs, tol=1e-4)
        report(f"{arch} sequence {i} entropy vs Hugging Face", got.entropy, entropy, tol=1e-4)
