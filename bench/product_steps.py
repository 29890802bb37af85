"""Which row counts change a row of each dense bf16 product of the 9B and 35B-A3B shapes.

    python -m bench.product_steps --out DIR

For every ``[M, K] x [K, N]`` linear shape of the two models (the narrow gate products aside:
bench/narrow_steps.py), the first 256 rows are computed inside products of M = 256, 272, ...,
8192 rows (multiples of ROW_MULTIPLE) and compared with the same rows inside an M = 16,384
product (``--reference-rows``). A row count whose rows differ takes another kernel (split-K, another tile order): rows
of fewer tokens than the largest such count would change with their neighbours, which is what
``head.CUDA_MIN_ROW_TOKENS`` must stay above. Writes ``product-steps.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHAPES = {  # (K, N) of each product, by where it runs
    "9b": {"gdn in_proj_qkv": (4096, 8192), "gdn in_proj_z / out_proj in": (4096, 4096), "attn q (+gate)": (4096, 8192),
           "attn k / v": (4096, 1024), "mlp gate / up": (4096, 12288), "mlp down": (12288, 4096)},
    "35b-a3b": {"gdn in_proj_qkv / attn q": (2048, 8192), "gdn in_proj_z": (2048, 4096), "out_proj": (4096, 2048),
                "attn k / v": (2048, 512), "shared expert gate / up": (2048, 512), "shared expert down": (512, 2048)},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--max-rows", type=int, default=8192)
    parser.add_argument("--reference-rows", type=int, default=16384)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script (small --max-rows)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(0)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    out = {"device": name, "torch": torch.__version__, "max_rows": args.max_rows, "reference_rows": args.reference_rows,
           "shapes": {}}
    for model, shapes in SHAPES.items():
        for label, (k, n) in shapes.items():
            w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            x = torch.randn(args.reference_rows, k, device=dev, generator=g).to(torch.bfloat16)
            ref = (x @ w.t())[:256]
            changed = [m for m in range(256, args.max_rows + 1, 16) if not torch.equal((x[:m] @ w.t())[:256], ref)]
            out["shapes"][f"{model} {label} K={k} N={n}"] = {"row_counts_unlike_reference": len(changed),
                                                          "largest": max(changed) if changed else None,
                                                          "first": changed[:40]}
            print(f"{model:8s} {label:32s} K={k:5d} N={n:5d}: {len(changed)} row counts differ, largest "
                  f"{max(changed) if changed else None}", flush=True)
            del w, x
    out["seconds"] = time.perf_counter() - started
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "product-steps.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
