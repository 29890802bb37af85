"""The head's chunk size is a memory setting, not a numerical one.

On the real vocabulary and hidden sizes, a position's log-prob and entropy from the fused head
are the same bits whatever the chunk size (``Scorer.set_head_budget`` sizes chunks from the
memory left, so two servers may run different sizes).
"""

import pytest
import torch

from model_runtime.kernels.logprob_head import logprob_entropy_triton
from model_runtime.scoring.head import score_positions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused head needs CUDA"),
]

VOCAB = 248320
CHUNKS = (256, 512, 768, 1024, 1536, 1600)


@pytest.mark.parametrize("hidden", [2048, 4096])
def test_chunk_size_changes_no_number(hidden, gpu_record):
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    weight_VD = (torch.randn(VOCAB, hidden, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    N = 3000  # no chunk size divides it: every size has a padded last chunk
    hidden_ND = torch.randn(N, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    targets_N = torch.randint(0, VOCAB, (N,), device="cuda", generator=gen)
    temperature_N = torch.ones(N, device="cuda")
    outs = {c: score_positions(hidden_ND, weight_VD, targets_N, temperature_N, chunk_tokens=c,
                               logprob_fn=logprob_entropy_triton) for c in CHUNKS}
    ref = outs[CHUNKS[0]]
    differing = {c: int((o.logprobs_N != ref.logprobs_N).sum() + (o.entropy_N != ref.entropy_N).sum())
                 for c, o in outs.items()}
    gpu_record("head_chunks", hidden=hidden, positions=N, differing=differing)
    assert all(n == 0 for n in differing.values()), f"values differing from chunks of {CHUNKS[0]}: {differing}"



def test_top_k_ranks_ties_by_lowest_id_on_the_gpu(gpu_record):
    """Log-probs of bf16 logits over the 9B's vocabulary (many exact ties): the ranking equals a
    stable sort's at every k, so a position's first k ids never depend on the k its row ranked."""
    from model_runtime.kernels.logprob_head import tempered_log_softmax
    from model_runtime.scoring.head import top_k_ranked, top_k_ranked_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(37, 248320, device="cuda", generator=g) * 2).bfloat16().round()  # integers: ties everywhere
    logp = tempered_log_softmax(z, torch.ones(37, device="cuda"))
    firsts = {}
    for k in (1, 5, 20):
        got_v, got_i = top_k_ranked(logp, k)
        want_v, want_i = top_k_ranked_reference(logp, k)
        assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v), f"k={k}: {got_i[0].tolist()} vs {want_i[0].tolist()}"
        firsts[k] = got_i
    assert torch.equal(firsts[20][:, :5], firsts[5]) and torch.equal(firsts[5][:, :1], firsts[1]), "a wider top-k reorders the narrower one's ids"
    gpu_record("top-k ties by lowest id (GPU)", rows=37, vocab=248320)
