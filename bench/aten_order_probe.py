"""Collects what it takes to find ATen's float32 summation order offline: for a few widths D,
random bf16 rows and ATen's ``x.float().pow(2).mean(-1)`` of them, written as
``aten-order-D{D}.npz`` (x as raw bf16 bits), and how many rows each of norm_triton's candidate
plans gets wrong; also the excerpt the CPU interpreter test replays
(``aten_mean_of_squares_h200.npz``, the file in tests/unit/data).

    python -m bench.aten_order_probe --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


# Rows of each width kept in the excerpt that tests/unit/test_norm_triton_interpret.py replays
# (tests/unit/data/aten_mean_of_squares_h200.npz, about 70 kB).
EXCERPT_ROWS = {128: 32, 256: 32, 4096: 8}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=2048)
    args = parser.parse_args(argv)
    from model_runtime.kernels import norm_triton as NT

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    excerpt = {}
    for dim in (128, 256, 4096):
        x = (torch.randn(args.rows, dim, device="cuda", generator=g) * 3).to(torch.bfloat16)
        arrays = {"x_bf16_bits": x.view(torch.int16).cpu().numpy(), "aten_ms": NT.mean_square_reference(x).cpu().numpy()}
        for vec, bw in NT._candidates(dim):
            print(f"D={dim} vec={vec} bw={bw}: {NT.unequal_rows(x, (vec, bw))} rows differ")
        np.savez_compressed(out / f"aten-order-D{dim}.npz", **arrays)
        keep = EXCERPT_ROWS[dim]
        excerpt[f"x_bits_D{dim}"], excerpt[f"aten_ms_D{dim}"] = arrays["x_bf16_bits"][:keep], arrays["aten_ms"][:keep]
    np.savez_compressed(out / "aten_mean_of_squares_h200.npz", **excerpt)


if __name__ == "__main__":
    main()
