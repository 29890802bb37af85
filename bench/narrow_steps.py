"""Where the narrow products' rounding follows the row count, and what that leaves of prefix sharing.

    python -m bench.narrow_steps --out DIR [--max-rows 65536]     # H200, about a minute
    python -m bench.narrow_steps --out DIR --device cpu --max-rows 600   # a dry run

For every narrow product of the presets (the Gated DeltaNet's decay and beta projections, the MoE
router and shared-expert gate), ``gate_projection.row_kinds`` finds which row counts compute their
common rows alike (a kind: one kernel of cuBLAS, wherever it recurs). Two sequences whose lengths
are of one kind compute their shared prompt's rows of those products alike, so sharing their
prompt is exact (``model_runtime.scoring.rounding``); the benchmark workloads are then grouped
that way and the tokens saved counted against grouping by prompt alone and against the ranges
between changes (how packscore grouped before kinds). Writes ``narrow-steps.json`` to DIR.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.prefix_sharing import workloads
from model_runtime.kernels.gate_projection import row_kinds
from model_runtime.scoring.prefix import find_groups
from model_runtime.scoring.presets import PRESETS, build_config
from model_runtime.scoring.rounding import RowRounding, combine


def narrow_shapes(preset: str) -> dict[str, tuple[int, int]]:
    config = build_config(PRESETS[preset])
    hidden = config.hidden_size
    shapes = {"gdn_gates": (hidden, config.linear_num_value_heads)}
    if getattr(config, "num_experts", 0):
        shapes["moe_router"] = (hidden, config.num_experts)
        shapes["moe_shared_gate"] = (hidden, 1)
    return shapes


def saved_by_kind(sequences, rounding: RowRounding, min_tokens: int = 64) -> dict:
    plain = find_groups(sequences, min_tokens)
    exact = find_groups(sequences, min_tokens, rounding)
    ranges = find_groups(sequences, min_tokens, RowRounding(np.cumsum(np.isin(np.arange(rounding.max_rows + 1),
                                                                             rounding.steps))))
    total = sum(s.length for s in sequences)
    saved = {name: sum(g.tokens_saved for g in groups) for name, groups in
             (("prompt", plain), ("kind", exact), ("range", ranges))}
    return {"tokens": total, "groups": len(plain), "subgroups": len(exact),
            **{f"saved_by_{k}": v for k, v in saved.items()},
            **{f"token_bound_by_{k}": total / (total - v) for k, v in saved.items()}}


def summary(shape, kinds: np.ndarray) -> dict:
    """What the JSON keeps of one product's probe: its kinds, the ranges of one kind, and the
    first 40 ranges as ``(first row count, kind)``."""
    r = RowRounding(kinds)
    return {"in_out": list(shape), "kinds": r.kind_count, "ranges": len(r.runs),
            "rows_of_largest_kinds": {int(k): int(n) for n, k in sorted(zip(*np.unique(kinds[1:], return_counts=True)[::-1]),
                                                                         reverse=True)[:8]},
            "first_runs": r.runs[:40]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-rows", type=int, default=65536)
    parser.add_argument("--presets", default="qwen3.5-9b,qwen3.5-35b-a3b")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "max_rows": args.max_rows,
           "dtype": str(dtype), "presets": {}}
    probed: dict[tuple[int, int], np.ndarray] = {}
    for preset in args.presets.split(","):
        entry = {"shapes": {}, "workloads": {}}
        for name, shape in narrow_shapes(preset).items():
            if shape not in probed:
                t0 = time.perf_counter()
                probed[shape] = row_kinds(*shape, dtype, args.device, args.max_rows)
                print(f"{preset} {name} {shape}: {time.perf_counter() - t0:.1f} s, {summary(shape, probed[shape])}", flush=True)
            entry["shapes"][name] = summary(shape, probed[shape])
        rounding = combine([probed[tuple(v["in_out"])] for v in entry["shapes"].values()], args.max_rows)
        vocab = build_config(PRESETS[preset]).vocab_size
        for wname, sequences in workloads(vocab, tiny=False).items():
            entry["workloads"][wname] = saved_by_kind(sequences, rounding)
            print(preset, wname, entry["workloads"][wname], flush=True)
        out["presets"][preset] = entry
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "narrow-steps.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
