"""Start-up as a restarted server sees it: load a preset, warm up, report the times as JSON.

Run it twice against the same cache directory to compare a cold start with a warm one:

    python -m bench.warmup_probe --model qwen3.5-9b --max-batch-tokens 65536 --kernel-cache /tmp/kc
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3.5-9b")
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--kernel-cache", required=True, help="directory for Triton and Inductor caches")
    args = parser.parse_args()

    started = time.perf_counter()
    from model_runtime.kernels.cache import configure_kernel_cache

    dirs = configure_kernel_cache(args.kernel_cache)  # before anything compiles

    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    loaded = load_model(args.model, device="cuda", dtype="bfloat16")
    load_s = time.perf_counter() - started
    scorer = Scorer(loaded, max_batch_tokens=args.max_batch_tokens)
    scorer.warm_up()
    print(
        "WARMUP_PROBE "
        + json.dumps(
            {
                "model": args.model,
                "max_batch_tokens": args.max_batch_tokens,
                "load_s": load_s,
                "warm_up_s": scorer.warm_up_seconds,
                "warm_up_steps_s": scorer.warm_up_steps,
                "ready_s": time.perf_counter() - started,
                "kernels": loaded.backends.names,
                "caches": dirs,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
