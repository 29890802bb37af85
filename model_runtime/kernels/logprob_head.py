"""Log-probability and entropy of one chunk of logits, without a float32 copy of the chunk.

Legend: C = positions in the chunk, V = vocabulary.

Backends share one signature: ``fn(z_CV, targets_C, temperature_C) -> (logp_C, entropy_C)``
where ``z_CV`` are raw logits (any float dtype), ``z / temperature`` is taken in float32, and
``entropy = logsumexp(z) - sum softmax(z) * z``.

The ``triton`` backend reads each logit once: one program per position streams the row and
keeps per-lane running (max, sum of exp, sum of exp * z), rescaled whenever the max grows
(the online softmax). The ``torch`` backend is the plain float32 computation it must match.
"""

from __future__ import annotations

import torch


def tempered_log_softmax(z_CV: torch.Tensor, temperature_C: torch.Tensor) -> torch.Tensor:
    """float32 ``log softmax(z / T)`` of one chunk (a new tensor; ``z_CV`` is left alone)."""
    logp_CV = z_CV.float()
    if logp_CV is z_CV:
        logp_CV = logp_CV.clone()
    logp_CV.div_(temperature_C.float()[:, None])
    logp_CV.sub_(torch.logsumexp(logp_CV, dim=-1, keepdim=True))
    return logp_CV


def entropy_of(logp_CV: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` as a batched dot product: no third ``[C, V]`` tensor, and no cancellation
    between two large numbers as in ``lse - sum(p z)`` at low temperatures."""
    p_CV = logp_CV.exp()
    return -torch.bmm(p_CV.unsqueeze(1), logp_CV.unsqueeze(2))[:, 0, 0]


def logprob_entropy_torch(z_CV: torch.Tensor, targets_C: torch.Tensor, temperature_C: torch.Tensor):
    """Reference: float32 tempered log-softmax, gather, ``-sum p log p``."""
    _check(z_CV, targets_C, temperature_C)
    logp_CV = tempered_log_softmax(z_CV, temperature_C)
    return logp_CV.gather(1, targets_C.long()[:, None])[:, 0], entropy_of(logp_CV)


def logprob_entropy_triton(z_CV: torch.Tensor, targets_C: torch.Tensor, temperature_C: torch.Tensor):
    """Fused single pass over each row of ``z_CV`` (CUDA, Triton)."""
    _check(z_CV, targets_C, temperature_C)
    if z_CV.stride(1) != 1:
        z_CV = z_CV.contiguous()
    C, V = z_CV.shape
    logp_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
    entropy_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
    if C == 0:
        return logp_C, entropy_C
    kernel = _kernel()
    block = 2048 if V >= 2048 else max(16, 1 << (V - 1).bit_length())
    kernel[(C,)](
        z_CV,
        z_CV.stride(0),
        targets_C.to(device=z_CV.device, dtype=torch.int64).contiguous(),
        temperature_C.to(device=z_CV.device, dtype=torch.float32).contiguous(),
        logp_C,
        entropy_C,
        V,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return logp_C, entropy_C


def _check(z_CV, targets_C, temperature_C) -> None:
    if z_CV.dim() != 2:
        raise ValueError(f"logits must be [C, V], got {tuple(z_CV.shape)}")
    if targets_C.shape != z_CV.shape[:1] or temperature_C.shape != z_CV.shape[:1]:
        raise ValueError(
            f"targets and temperature must be [C={z_CV.shape[0]}], got "
            f"{tuple(targets_C.shape)} and {tuple(temperature_C.shape)}"
        )


_KERNEL = None


def _kernel():
    """Builds the Triton kernel on first use (Triton is imported only on machines that run it)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def logprob_entropy_kernel(
        z_ptr, stride_row, target_ptr, temp_ptr, logp_ptr, entropy_ptr, V, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride_row
        temp = tl.load(temp_ptr + row)
        lanes = tl.arange(0, BLOCK)
        # A finite floor instead of -inf keeps exp(m_old - m_new) defined for lanes that only
        # ever see masked columns (vocabularies smaller than BLOCK).
        m = tl.full([BLOCK], -1.0e30, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m)
        t = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - m) * z
        for start in range(0, V, BLOCK):
            cols = start + lanes
            valid = cols < V
            z = tl.load(z_row + cols, mask=valid, other=float("-inf")).to(tl.float32) / temp
            m_new = tl.maximum(m, z)
            rescale = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            s = s * rescale + e
            t = t * rescale + tl.where(valid, e * z, 0.0)
            m = m_new
        m_row = tl.max(m, axis=0)
        w = tl.exp(m - m_row)
        s_row = tl.sum(s * w, axis=0)
        t_row = tl.sum(t * w, axis=0)
        lse = m_row + tl.log(s_row)
        target = tl.load(target_ptr + row)
        z_target = tl.load(z_row + target).to(tl.float32) / temp
        tl.store(logp_ptr + row, z_target - lse)
        tl.store(entropy_ptr + row, lse - t_row / s_row)

    _KERNEL = logprob_entropy_kernel
    return _KERNEL
