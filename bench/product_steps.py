"""Which row counts compute a row of each dense bf16 product of the 9B and 35B-A3B shapes alike.

    python -m bench.product_steps --out DIR
    python -m bench.product_steps --out DIR --device cpu --max-rows 1024   # a check of the script

For every ``[M, K] x [K, N]`` linear shape of the two models (the narrow gate products aside:
bench/narrow_steps.py), the first 256 rows are computed inside products of M = 256, 272, ...,
8192 rows (multiples of ROW_MULTIPLE), then every 256 rows up to ``--max-rows``, on operands that
make a change of summation order visible (``gate_projection.order_sensitive_operands``). Each
row count gets a kind: row counts whose first 256 rows are equal (one kernel of cuBLAS, wherever
it recurs). A sequence scored alone (a row of its own length) keeps its numbers packed in a
longer row only where both row counts are of one kind, so ``head.CUDA_MIN_ROW_TOKENS`` must lie
at or above the row count from which every count is of the largest count's kind
(``uniform_from``). Writes ``product-steps.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from model_runtime.kernels.gate_projection import order_sensitive_operands

SHAPES = {  # (K, N) of each product, by where it runs
    "9b": {"gdn in_proj_qkv": (4096, 8192), "gdn in_proj_z / out_proj in": (4096, 4096), "attn q (+gate)": (4096, 8192),
           "attn k / v": (4096, 1024), "mlp gate / up": (4096, 12288), "mlp down": (12288, 4096)},
    "35b-a3b": {"gdn in_proj_qkv / attn q": (2048, 8192), "gdn in_proj_z": (2048, 4096), "out_proj": (4096, 2048),
                "attn k / v": (2048, 512), "shared expert gate / up": (2048, 512), "shared expert down": (512, 2048)},
}
COMPARED_ROWS = 256


def row_counts(max_rows: int) -> list[int]:
    fine = list(range(COMPARED_ROWS, min(8192, max_rows) + 1, 16))
    return fine + list(range(fine[-1] + 256, max_rows + 1, 256))


@torch.inference_mode()
def kinds_of(k: int, n: int, counts: list[int], device, dtype=torch.bfloat16) -> list[int]:
    """The kind of every row count of ``counts`` for a ``[M, k] x [k, n]`` product."""
    x, w = order_sensitive_operands(k, n, dtype, device, max(counts))
    reps: list[torch.Tensor] = []
    kinds = []
    for m in counts:
        rows = (x[:m] @ w.t())[:COMPARED_ROWS]
        kind = next((i for i, r in enumerate(reps) if torch.equal(rows, r)), None)
        if kind is None:
            kind = len(reps)
            reps.append(rows)
        kinds.append(kind)
    return kinds


def summary(counts: list[int], kinds: list[int]) -> dict:
    last = kinds[-1]
    first_uniform = next(counts[i] for i in range(len(counts)) if all(k == last for k in kinds[i:]))
    runs = [[m, kd] for i, (m, kd) in enumerate(zip(counts, kinds)) if i == 0 or kinds[i - 1] != kd]
    return {"kinds": len(set(kinds)), "ranges": len(runs), "uniform_from": first_uniform,
            "row_counts_unlike_the_largest": sum(k != last for k in kinds), "first_runs": runs[:40]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--max-rows", type=int, default=65536)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script (small --max-rows)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    counts = row_counts(args.max_rows)
    out = {"device": name, "torch": torch.__version__, "max_rows": args.max_rows, "compared_rows": COMPARED_ROWS,
           "row_counts": f"{COMPARED_ROWS} to 8192 every 16, then every 256", "shapes": {}}
    for model, shapes in SHAPES.items():
        for label, (k, n) in shapes.items():
            t0 = time.perf_counter()
            entry = summary(counts, kinds_of(k, n, counts, args.device))
            out["shapes"][f"{model} {label} K={k} N={n}"] = entry
            print(f"{model:8s} {label:32s} K={k:5d} N={n:5d}: {entry['kinds']} kinds in {entry['ranges']} ranges, "
                  f"uniform from {entry['uniform_from']} rows ({time.perf_counter() - t0:.1f} s); "
                  f"runs {entry['first_runs'][:12]}", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    out["uniform_from"] = max(e["uniform_from"] for e in out["shapes"].values())
    out["seconds"] = time.perf_counter() - started
    print(f"every shape uniform from {out['uniform_from']} rows; {out['seconds']:.0f} s", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "product-steps.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
