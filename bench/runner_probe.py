"""Why a worker pool's forward may be slower than the serving process's, on one GPU.

    python -m bench.runner_probe --out DIR [--sequences 128]     (on a CUDA machine with fla)

On the H200s (2026-11-29) one 9B replica per GPU in the worker pool scored 24k tokens/s per GPU
with SDPA per segment and 33k with the varlen kernel, where the serving process's ``Scorer``
scored 36.5k with SDPA. The pool's ranks differed from ``Scorer`` in the runner
(``ParallelScorer``), in the autograd mode (``no_grad`` where ``Scorer`` uses ``inference_mode``;
FSDP needs ``no_grad``, a replica does not) and in the row's padding (to a multiple of sp, not
of 16). Since 2026-11-29 (late) the runner pads as ``Scorer`` does and uses ``inference_mode`` without
FSDP. Timed here on the same packed rows of the benchmark workload, in this one process:
``Scorer.score_row``, the same under ``no_grad``, ``ParallelScorer.score_row_flat`` (a world of
one rank) as it is now, and the same under ``no_grad``.

Each configuration runs with both attention kernels (SDPA per segment, varlen), untimed once,
then timed, with the first runner again at the end so a drifting clock shows. Prints a table
and writes ``runner_probe.json``.

Measured on the H200 (2026-11-29, 64 sequences, 201k tokens): every runner and mode within
0.2% (SDPA 36.2k-36.3k tokens/s, varlen 35.4k): the pool's slowdown with SDPA is not its runner.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def _init_world_of_one(device: str) -> None:
    import torch.distributed as dist

    from model_runtime.pool.ports import free_port

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--preset", default="qwen3.5-9b")
    parser.add_argument("--sequences", type=int, default=128, help="first N sequences of the benchmark workload")
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--dry-run-cpu", action="store_true", help="the tiny preset on the CPU (checks the code path)")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run_cpu else "cuda"
    if args.dry_run_cpu:
        args.preset, args.sequences, args.max_batch_tokens = "tiny", 8, 256

    from bench.hf_reference import build_twin, kernel_backend
    from bench.workload import WorkloadSpec, describe, grpo_workload
    from model_runtime.model.packing import pack_first_fit_decreasing
    from model_runtime.parallel.dims import ParallelDims
    from model_runtime.parallel.runner import ParallelScorer
    from model_runtime.scoring.scorer import Scorer

    if device == "cuda":
        torch.cuda.set_device(0)
    _init_world_of_one(device)
    dims = ParallelDims.from_world(1, 1, False)
    mesh = dims.build_mesh(device)
    loaded = build_twin(args.preset, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32).loaded
    spec = WorkloadSpec()
    if args.dry_run_cpu:  # short sequences: the reference kernels are slow
        spec = WorkloadSpec(num_sequences=8, prompt_median=20, prompt_clip=(4, 60), response_median=30, response_clip=(2, 90))
    work = grpo_workload(loaded.vocab_size, spec)[: args.sequences]
    tokens = describe(work)["tokens"]
    rows = [[work[i] for i in row] for row in pack_first_fit_decreasing([s.length for s in work], args.max_batch_tokens)]
    scorer = Scorer(loaded, max_batch_tokens=args.max_batch_tokens)
    runner = ParallelScorer(loaded, dims=dims, mesh=mesh, rank=0, max_batch_tokens=args.max_batch_tokens)

    def scorer_no_grad(row):
        with torch.no_grad():
            return Scorer.score_row.__wrapped__(scorer, row)

    def runner_no_grad(row):
        with torch.no_grad():
            return runner._score_row_flat(row)

    runners = {
        "Scorer.score_row (inference_mode)": scorer.score_row,
        "Scorer.score_row under no_grad": scorer_no_grad,
        "ParallelScorer.score_row_flat (inference_mode without FSDP)": runner.score_row_flat,
        "ParallelScorer under no_grad (the pool before this probe)": runner_no_grad,
    }

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        for row in rows:
            fn(row)
        sync()
        started = time.perf_counter()
        for row in rows:
            fn(row)
        sync()
        return time.perf_counter() - started

    results = {"preset": args.preset, "sequences": len(work), "tokens": tokens, "rows": len(rows), "runs": []}
    print(f"{args.preset}: {len(work)} sequences, {tokens:,} tokens in {len(rows)} rows", flush=True)
    for attention in ("sdpa", "varlen") if device == "cuda" else ("reference",):
        with kernel_backend(loaded.model, "attention", attention):
            for repeat, name in enumerate(list(runners) + [next(iter(runners))]):
                seconds = timed(runners[name])
                run = {"runner": name, "attention": attention, "seconds": seconds, "tokens_per_s": tokens / seconds,
                       "repeat": repeat == len(runners)}
                results["runs"].append(run)
                print(f"| {attention} | {name}{' (again)' if run['repeat'] else ''} | {tokens / seconds:,.0f} |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runner_probe.json").write_text(json.dumps(results, indent=1))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
