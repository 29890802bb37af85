"""In bfloat16, packscore is as close to the float32 truth as Hugging Face's own bf16 forward.

Both bf16 forwards carry rounding error of their own (about 1.6e-2 mean on these random
checkpoints), so bf16-vs-bf16 agreement cannot be tighter than that noise;
what a trainer needs is that packscore's bf16 error is no larger than the reference's.
"""

import numpy as np
import torch

from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from tests.unit.test_packed_parity import hf_reference, make_batch


def test_bf16_error_against_float32_is_no_worse_than_huggingface_bf16(checkpoint_dir, capsys):
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir("qwen3_5")
    truth = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = load_model(str(path), device="cpu", dtype="bfloat16")
    seqs = make_batch(ours.vocab_size)
    packed = Scorer(ours).score_row(seqs)
    alone = [Scorer(ours).score_row([s])[0] for s in seqs]

    t = np.concatenate([hf_reference(truth, s)[0] for s in seqs])
    h = np.concatenate([hf_reference(hf_bf16, s)[0] for s in seqs])
    o = np.concatenate([r.logprobs for r in packed])
    a = np.concatenate([r.logprobs for r in alone])
    ours_err, hf_err = float(np.mean(np.abs(o - t))), float(np.mean(np.abs(h - t)))
    with capsys.disabled():
        print(
            f"\n[bf16 cpu] mean |diff| to float32: packscore {ours_err:.2e}, HF bf16 {hf_err:.2e}; "
            f"packscore vs HF bf16 {np.mean(np.abs(o - h)):.2e}; packed vs alone {np.max(np.abs(o - a)):.1e} (max)"
        )
    assert ours_err <= 1.25 * hf_err, f"packscore bf16 error {ours_err:.3e} > 1.25 x HF bf16 error {hf_err:.3e}"
    # On CPU the reference kernels work per segment, but oneDNN's bf16 GEMM (AMX) picks its kernel
    # from the product's shape, and one bf16 rounding that goes the other way moves a log-prob by
    # bf16 noise; so packing may move a sequence by no more than bf16 rounding itself does.
    packing_err = float(np.mean(np.abs(o - a)))
    assert packing_err <= hf_err, f"packed vs alone differ by {packing_err:.3e} (mean) > HF bf16 rounding error {hf_err:.3e}"
