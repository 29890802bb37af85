"""The Triton log-prob / entropy head (model_runtime/kernels/logprob_head.py) in Triton's CPU
interpreter, where its arithmetic is NumPy's float32:
- bit for bit against a NumPy model of its blocks: per lane (a run of adjacent logits) the run's
  max, one rescale of the lane's two sums, then each logit's exp once;
- within float32 rounding of the ``torch`` backend (the plain float32 log-softmax).
Rows cover temperature 1 (the kernel's branch without division) and others, a vocabulary smaller
than, equal to and not a multiple of the block, logits of wide range, an extreme temperature, and
tiles other than the default.

Runs only under the interpreter:
    TRITON_INTERPRET=1 python -m pytest tests/unit/test_head_triton_interpret.py
"""

import numpy as np
import pytest
import torch

from tests.interpret import only_when_interpreting, require_triton

pytestmark = only_when_interpreting
triton = require_triton()

from model_runtime.kernels.logprob_head import (  # noqa: E402
    LOGP_FLOOR,
    head_tile,
    logprob_entropy_torch,
    logprob_entropy_triton,
    temperature32,
)

TEMPERATURES = (1.0, 0.5, 1e-30, 7.0, 1.0, 2.0)
SCALES = (1.0, 5.0, 30.0, 0.1, 100.0, 3.0)


def block_model(z_CV: np.ndarray, targets, temps, lanes: int, run: int):
    """The kernel's arithmetic in NumPy: blocks of ``lanes`` runs of ``run`` logits; whole blocks
    guard exp(d) * d only where the temperature divides, the masked tail always."""
    f32 = np.float32
    C, V = z_CV.shape
    block = lanes * run
    logp, ent = np.empty(C, f32), np.empty(C, f32)
    with np.errstate(all="ignore"):
        for r in range(C):
            temp = f32(temps[r])
            divide = temp != f32(1)
            m = np.full(lanes, f32(LOGP_FLOOR), f32)
            s = np.zeros(lanes, f32)
            t = np.zeros(lanes, f32)
            for start in range(0, V, block):
                z = np.full(block, -np.inf, f32)
                n = min(block, V - start)
                z[:n] = z_CV[r, start:start + n]
                z = z.reshape(lanes, run)
                m_new = np.maximum(m, np.nanmax(z, axis=1))
                shift = (m_new - m) / temp if divide else m_new - m
                rescale = np.exp(-shift)
                t = np.where(rescale > 0, rescale * (t - s * shift), f32(0))
                s = s * rescale
                d = (z - m_new[:, None]) / temp if divide else z - m_new[:, None]
                e = np.exp(d)
                ed = np.where(e > 0, e * d, f32(0)) if (divide or n < block) else e * d
                s = s + np.sum(e, axis=1)
                t = t + np.sum(ed, axis=1)
                m = m_new
            m_row = m.max()
            shift = (m_row - m) / temp
            w = np.exp(-shift)
            s_row = np.sum(s * w)
            t_row = np.sum(np.where(w > 0, w * (t - s * shift), f32(0)))
            lse = np.log(s_row)
            d_target = (f32(z_CV[r, targets[r]]) - m_row) / temp
            logp[r] = max(d_target - lse, f32(LOGP_FLOOR))
            h = lse - t_row / s_row
            ent[r] = h if h > 0 else f32(0)
    return logp, ent


@pytest.mark.parametrize("V, tile", [(5, None), (100, None), (4096, None), (5000, None), (2048, (64, 8, 4)),
                                     (700, (16, 16, 4))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_kernel_equals_the_block_model_and_the_reference(V, tile, dtype):
    g = torch.Generator().manual_seed(V)
    z = (torch.randn(len(SCALES), V, generator=g) * torch.tensor(SCALES)[:, None]).to(dtype)
    z[2, 7 % V] = 1e4  # one logit far above the rest
    z[3, -1] = 50.0  # the maximum in the last block
    targets = torch.randint(0, V, (len(SCALES),), generator=g)
    temps = torch.tensor(TEMPERATURES)
    logp, ent = logprob_entropy_triton(z, targets, temps, tile=tile)
    lanes, run, _ = tile or head_tile(V)
    want_logp, want_ent = block_model(z.float().numpy(), targets.numpy(), temperature32(temps).numpy(), lanes, run)
    differing = int((logp.numpy().view(np.int32) != want_logp.view(np.int32)).sum()
                    + (ent.numpy().view(np.int32) != want_ent.view(np.int32)).sum())
    assert differing == 0, (f"{differing} values differ from the block model (tolerance: bit for bit): logp "
                            f"{logp.tolist()} vs {want_logp.tolist()}, entropy {ent.tolist()} vs {want_ent.tolist()}")
    ref_logp, ref_ent = logprob_entropy_torch(z, targets, temps)
    tol = 2e-6 * max(1.0, float(ref_logp.abs().max()))
    worst = max(float((logp - ref_logp).abs().max()), float((ent - ref_ent).abs().max()))
    assert worst <= tol, f"max |diff| to the float32 reference {worst:.3e} > tolerance {tol:.3e}"
