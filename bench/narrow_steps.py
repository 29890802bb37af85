"""Where the narrow products' rounding follows the row count, and what that leaves of prefix sharing.

    python -m bench.narrow_steps --out DIR [--max-rows 65536]     # H200, about a minute
    python -m bench.narrow_steps --out DIR --device cpu --max-rows 600   # a dry run

For every narrow product of the presets (the Gated DeltaNet's decay and beta projections, the MoE
router and shared-expert gate), ``gate_projection.first_changed_rows`` finds the row counts at
which the product's rows change bits. Two sequences whose lengths lie between the same two such
row counts compute their shared prompt's rows of those products alike, so sharing their prompt is
exact (``model_runtime.scoring.rounding``); the benchmark workloads are then grouped that way and
the tokens saved counted against grouping by prompt alone. Writes ``narrow-steps.json`` to DIR.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.prefix_sharing import workloads
from model_runtime.kernels.gate_projection import first_changed_rows
from model_runtime.scoring.prefix import find_groups
from model_runtime.scoring.presets import PRESETS, build_config
from model_runtime.scoring.rounding import RowRounding


def narrow_shapes(preset: str) -> dict[str, tuple[int, int]]:
    config = build_config(PRESETS[preset])
    hidden = config.hidden_size
    shapes = {"gdn_gates": (hidden, config.linear_num_value_heads)}
    if getattr(config, "num_experts", 0):
        shapes["moe_router"] = (hidden, config.num_experts)
        shapes["moe_shared_gate"] = (hidden, 1)
    return shapes


def saved_by_class(sequences, changed: np.ndarray, min_tokens: int = 64) -> dict:
    plain = find_groups(sequences, min_tokens)
    exact = find_groups(sequences, min_tokens, RowRounding(changed))
    saved_plain = sum(g.tokens_saved for g in plain)
    saved_split = sum(g.tokens_saved for g in exact)
    total = sum(s.length for s in sequences)
    return {"tokens": total, "saved_by_prompt": saved_plain, "saved_by_prompt_and_class": saved_split,
            "groups": len(plain), "subgroups": len(exact),
            "token_bound_by_prompt": total / (total - saved_plain),
            "token_bound_by_class": total / (total - saved_split)}


def summary(shape, changed: np.ndarray) -> dict:
    """What the JSON keeps of one product's probe: how many row counts change rows, the lowest row
    they change, and the first 40 as ``(row count, first changed row)``."""
    steps = RowRounding(changed).steps
    return {"in_out": list(shape), "row_counts_changing": len(steps),
            "lowest_changed_row": int(changed[steps].min()) if steps else None,
            "first_changes": [[m, int(changed[m])] for m in steps[:40]]}


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
                probed[shape] = first_changed_rows(*shape, dtype, args.device, args.max_rows)
                print(f"{preset} {name} {shape}: {time.perf_counter() - t0:.1f} s, {summary(shape, probed[shape])}", flush=True)
            entry["shapes"][name] = summary(shape, probed[shape])
        changed = np.minimum.reduce([probed[tuple(v["in_out"])] for v in entry["shapes"].values()])
        vocab = build_config(PRESETS[preset]).vocab_size
        for wname, sequences in workloads(vocab, tiny=False).items():
            entry["workloads"][wname] = saved_by_class(sequences, changed)
            print(preset, wname, entry["workloads"][wname], flush=True)
        out["presets"][preset] = entry
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "narrow-steps.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
