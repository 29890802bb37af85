"""FP8 checkpoints (``quant_method: fp8``, as Qwen publishes them), dequantized at load.

Each quantized weight ``<name>.weight`` is stored as float8 e4m3 with a float32
``<name>.weight_scale_inv`` holding one multiplier per ``weight_block_size`` block (128 x 128 in
Qwen's releases; one for the whole tensor without a block size): ``w = float(q) * scale`` over
its block, the layout of DeepSeek-V3's ``weight_dequant``. packscore multiplies that out in
float32 and rounds once to the serving dtype, then hands Hugging Face the plain weights, so the
model runs the same unquantized arithmetic as for a bfloat16 checkpoint (and no FP8 kernel,
``accelerate`` or quantizer is involved). The cost is host memory for the dequantized weights
during the load.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from model_runtime.scoring.checkpoint import FP8_SCALE_SUFFIX, IGNORED_PREFIXES, CheckpointSpec
from model_runtime.scoring.checkpoint_config import fp8_block_size


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (float8, ``[..., R, C]``) times its block scales (``[..., ceil(R/br), ceil(C/bc)]``), as ``dtype``."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is None or w.dim() < 2:
        return (w * s.reshape(())).to(dtype) if s.numel() == 1 else (w * s).to(dtype)
    rows, cols = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return w.mul_(s).to(dtype)


def read_dequantized(spec: CheckpointSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a checked FP8 checkpoint, by its checkpoint name, FP8 weights dequantized
    to ``dtype`` and the rest cast to it (the vision tower and ``mtp.*`` are not read)."""
    from model_runtime.scoring.tensor_file import TensorFile

    block = fp8_block_size(spec.config)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = [stack.enter_context(TensorFile(f)) for f in spec.files]
        where = {key: h for h in handles for key in h.keys()}
        for key, handle in where.items():
            if key.endswith(FP8_SCALE_SUFFIX) or key.startswith(IGNORED_PREFIXES):
                continue
            tensor = handle.read(key)
            scale_key = key + FP8_SCALE_SUFFIX
            if scale_key in where:
                out[key] = dequantize_fp8(tensor, where[scale_key].read(scale_key), block, dtype)
            elif tensor.is_floating_point():
                out[key] = tensor.to(dtype)
            else:
                out[key] = tensor
    return out
