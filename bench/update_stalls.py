"""Probe: which settings of an update beside the old weights stall the 9B's scoring loop least.

    python -m bench.update_stalls --out DIR [--rounds 2]

Writes the 9B-shaped checkpoints A and B as ``bench.weights_swap`` does, serves A with a scoring
loop in a thread, then, in rounds, for each variant (the reader threads' nice value and the
content hash's thread count, patched in ``model_runtime.scoring.weights``) updates A -> B with a
version and B -> A with the content hash, recording request-to-serving time and the loop's
longest gap. Writes update-stalls.json/.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.weights_swap import ScoringLoop, warm_page_cache, write_checkpoints
from model_runtime.scoring import weights
from model_runtime.scoring.backend import LocalBackend
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput

VARIANTS = {"nice 0, hash 16": (0, 16), "nice 10, hash 16": (10, 16), "nice 10, hash 8": (10, 8), "nice 0, hash 8": (0, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/packscore-update-stalls"))
    args = ap.parse_args()
    device = torch.device("cuda")
    a, b, _ = write_checkpoints("qwen3.5-9b", args.work, device, torch.bfloat16, 5 << 30)
    warm_page_cache(a)
    warm_page_cache(b)
    backend = LocalBackend(Scorer(load_model(str(a), device=device), max_batch_tokens=4096))
    backend.update_in_place = False
    rng = np.random.default_rng(0)
    row = [SequenceInput(rng.integers(0, backend.info.vocab_size, 1024), score_from=1) for _ in range(4)]
    for _ in range(3):
        backend.score_row(row)
    backend.update_weights(b, "warm")  # the staging slots and the allocator's segments, once
    backend.update_weights(a, "A")
    results = []
    for r in range(args.rounds):
        for name, (nice, hash_threads) in VARIANTS.items():
            weights.BACKGROUND_NICE, weights.HASH_THREADS = nice, hash_threads
            for label, path, version in (("A -> B, version", b, f"B{r}{name}"), ("B -> A, content hash", a, None)):
                loop = ScoringLoop(backend, row)
                time.sleep(1.5)
                t0 = time.perf_counter()
                backend.update_weights(path, version)
                t1 = time.perf_counter()
                time.sleep(1.5)
                loop.stop()
                gap, median = loop.gaps(t0, t1 + 1.5)
                results.append({"round": r, "variant": name, "update": label, "request_to_serving_s": t1 - t0,
                                "loop_max_gap_s": gap, "loop_median_row_s": median})
                print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "update-stalls.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| variant | update | request to serving s (each round) | loop's longest gap s (each round) |",
             "| --- | --- | --- | --- |"]
    for name in VARIANTS:
        for label in ("A -> B, version", "B -> A, content hash"):
            rs = [x for x in results if x["variant"] == name and x["update"] == label]
            lines.append(f"| {name} | {label} | " + ", ".join(f"{x['request_to_serving_s']:.2f}" for x in rs)
                         + " | " + ", ".join(f"{x['loop_max_gap_s']:.2f}" for x in rs) + " |")
    lines.append(f"\nloop median row: {statistics.median(x['loop_median_row_s'] for x in results):.3f} s")
    (args.out / "update-stalls.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
