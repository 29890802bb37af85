"""Log-probability / entropy head, computed in token chunks so full logits never exist.

Legend: N = scored positions, D = hidden size, V = vocabulary, C = tokens in one chunk,
K = top-k width.

For every scored position: ``z = (h @ W^T) / temperature`` in float32, ``log p = z - logsumexp(z)``,
``logprob = log p[target]``, ``entropy = -sum(p * log p)`` and optionally the top-k ids with their
``log p``. Only one ``[C, V]`` chunk (plus its probabilities) is alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Bytes per (token, vocab) entry alive at a chunk's peak, measured in tests/unit/test_head.py:
# float32 log-probs (4), a temporary of logsumexp or top-k (4), float32 probabilities (4), and
# the matmul output in the compute dtype before its float32 copy (up to 4).
BYTES_PER_LOGIT = 16
MAX_TOP_K = 20


@dataclass
class HeadOutput:
    logprobs_N: torch.Tensor  # float32
    entropy_N: torch.Tensor  # float32
    top_k_ids_NK: torch.Tensor | None  # int64
    top_k_logprobs_NK: torch.Tensor | None  # float32


def chunk_tokens_for_budget(vocab_size: int, budget_bytes: int) -> int:
    """How many positions one chunk may hold so that its logits stay within ``budget_bytes``."""
    return max(1, int(budget_bytes) // (vocab_size * BYTES_PER_LOGIT))


def _check(hidden_ND, weight_VD, targets_N, temperature_N, top_k):
    if hidden_ND.dim() != 2 or weight_VD.dim() != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(f"head expects hidden [N, D] and weight [V, D], got {tuple(hidden_ND.shape)}, {tuple(weight_VD.shape)}")
    if targets_N.shape != hidden_ND.shape[:1] or temperature_N.shape != hidden_ND.shape[:1]:
        raise ValueError(
            f"targets and temperature must be [N={hidden_ND.shape[0]}], got {tuple(targets_N.shape)}, {tuple(temperature_N.shape)}"
        )
    if not 0 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {top_k}")


@torch.inference_mode()
def score_positions(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    temperature_N: torch.Tensor,
    *,
    top_k: int = 0,
    chunk_tokens: int = 1024,
) -> HeadOutput:
    """Chunked head. ``temperature_N`` is per position (a row may mix requests)."""
    _check(hidden_ND, weight_VD, targets_N, temperature_N, top_k)
    N = hidden_ND.shape[0]
    dev = hidden_ND.device
    logprobs = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    top_ids = torch.empty(N, top_k, dtype=torch.long, device=dev) if top_k else None
    top_logp = torch.empty(N, top_k, dtype=torch.float32, device=dev) if top_k else None
    temperature_N = temperature_N.to(device=dev, dtype=torch.float32)
    targets_N = targets_N.to(device=dev, dtype=torch.long)
    for start in range(0, N, max(1, chunk_tokens)):
        end = min(N, start + chunk_tokens)
        # F.linear reads W as [V, D] in place; `h @ W.t()` can copy the whole weight per chunk.
        logp_CV = F.linear(hidden_ND[start:end], weight_VD).float()
        logp_CV.div_(temperature_N[start:end, None])
        logp_CV.sub_(torch.logsumexp(logp_CV, dim=-1, keepdim=True))
        logprobs[start:end] = logp_CV.gather(1, targets_N[start:end, None])[:, 0]
        if top_k:
            top_logp[start:end], top_ids[start:end] = logp_CV.topk(top_k, dim=-1)
        # -sum p log p as a batched dot product: no third [C, V] tensor, and no cancellation
        # between two large numbers as in `lse - sum(p z)` at low temperatures.
        p_CV = logp_CV.exp()
        entropy[start:end] = -torch.bmm(p_CV.unsqueeze(1), logp_CV.unsqueeze(2))[:, 0, 0]
        del p_CV, logp_CV
    return HeadOutput(logprobs, entropy, top_ids, top_logp)


@torch.inference_mode()
def score_positions_reference(hidden_ND, weight_VD, targets_N, temperature_N, *, top_k: int = 0) -> HeadOutput:
    """Plain unchunked reference: full float32 logits and ``log_softmax``."""
    _check(hidden_ND, weight_VD, targets_N, temperature_N, top_k)
    logits = (hidden_ND.float() @ weight_VD.float().t()) / temperature_N.float()[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    out = HeadOutput(
        logp.gather(1, targets_N.long()[:, None])[:, 0],
        -(logp.exp() * logp).sum(-1),
        None,
        None,
    )
    if top_k:
        out.top_k_logprobs_NK, out.top_k_ids_NK = logp.topk(top_k, dim=-1)
    return out
