"""Multi-GPU runs (the multi-GPU issue) in one command: SP scaling, FSDP against replicas, HTTP.

    python -m bench.multi_gpu --gpus N --out DIR            # on a machine with N GPUs
    python -m bench.multi_gpu --gpus 2 --device cpu --quick  # smoke run here, gloo, tiny model

Phases (each timed after one untimed pass, each result kept even if a later phase fails):
1. ``sp``: one long sequence (262,144 tokens on the 9B shape) through a pool with world = sp =
   1, 2, 4, 8 (up to N): tokens/s, latency and peak memory per GPU (nvidia-smi samples).
2. ``fsdp``: the GRPO workload of bench/workload.py on the 27B and 35B-A3B shapes, sharded with
   FSDP over all N GPUs against one replica per GPU (dp = N): tokens/s per GPU.
3. ``http``: ``packscore serve --world-size N`` driven by the async client with the workload,
   against the same pool in process (``pool``, also a phase of its own).
``--kernels`` pins kernel backends as ``packscore --kernels`` does (A/B runs of a kernel).
Writes ``multi_gpu-<date>[-quick][-FAMILY-BACKEND...].json`` (``output_name``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.workload import WorkloadSpec, describe, grpo_workload  # noqa: E402
from model_runtime.kernels.overrides import parse_kernel_overrides  # noqa: E402
from model_runtime.model.packing import pack_first_fit_decreasing  # noqa: E402
from model_runtime.types import SequenceInput  # noqa: E402


class GpuMemorySampler:
    """Peak ``memory.used`` per GPU (MiB) from nvidia-smi, sampled every 200 ms in a thread."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.peak: list[int] = []
        self._stop = threading.Event()

    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True,
            ).stdout.split()
            used = [int(x) for x in out if x.isdigit()]
            self.peak = [max(a, b) for a, b in zip(self.peak, used)] if self.peak else used
            self._stop.wait(0.2)

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join()


def pool_settings(args, model: str, world: int, sp: int, fsdp: bool, budget: int) -> dict:
    return {"model": model, "device": args.device, "dtype": "auto", "world_size": world, "sp": sp, "fsdp": fsdp,
            "max_batch_tokens": budget, "allow_slow_kernels": args.device == "cpu", "served_model_name": None,
            "kernels": parse_kernel_overrides(args.kernels or "")}


def run_rows(pool, sequences: list[SequenceInput], budget: int, row_seconds: list | None = None) -> float:
    """Scores ``sequences`` in rows of ``budget`` tokens, ``pool.concurrency`` at a time; seconds.
    ``row_seconds`` collects each row's duration (as the server's forward histogram counts it)."""
    rows = pack_first_fit_decreasing([s.length for s in sequences], budget)

    def one(row):
        t = time.perf_counter()
        pool.score_row([sequences[i] for i in row])
        if row_seconds is not None:
            row_seconds.append(time.perf_counter() - t)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=pool.concurrency) as ex:
        list(ex.map(one, rows))
    return time.perf_counter() - started


def phase_sp(args, out: dict) -> None:
    from model_runtime.pool.pool import start_pool

    length = args.sp_tokens
    rng = np.random.default_rng(0)
    for sp in [s for s in (1, 2, 4, 8) if s <= args.gpus]:
        budget = -(-length // sp)  # ceil: each rank holds length / sp tokens
        pool = start_pool(pool_settings(args, args.dense_model, sp, sp, False, budget))
        try:
            seq = [SequenceInput(rng.integers(0, pool.info.vocab_size, length), score_from=1)]
            pool.score_row(seq)  # untimed: autotuning and compilation for this shape
            with GpuMemorySampler(args.device == "cuda") as mem:
                started = time.perf_counter()
                pool.score_row(seq)
                latency = time.perf_counter() - started
            row = {"sp": sp, "tokens": length, "latency_s": latency, "tokens_per_s": length / latency,
                   "peak_memory_mib_per_gpu": mem.peak[:sp]}
            print(f"[sp] sp={sp}: {length} tokens in {latency:.2f}s ({length / latency:,.0f} tok/s), memory {mem.peak[:sp]} MiB")
            out.setdefault("sp_scaling", []).append(row)
        finally:
            pool.close()


def phase_fsdp(args, out: dict) -> None:
    from model_runtime.pool.pool import start_pool

    for model in args.fsdp_models:
        for fsdp in (True, False):
            label = f"{model} {'fsdp' if fsdp else 'replicas'} x{args.gpus}"
            try:
                pool = start_pool(pool_settings(args, model, args.gpus, 1, fsdp, args.budget))
            except Exception as exc:  # a replica that does not fit one GPU is a result, not a crash
                print(f"[fsdp] {label}: could not start: {exc}")
                out.setdefault("fsdp", []).append({"run": label, "error": str(exc)[:500]})
                continue
            try:
                work = grpo_workload(pool.info.vocab_size, args.workload)
                run_rows(pool, work, args.budget)  # untimed pass
                before = dict(pool.step_counts)
                with GpuMemorySampler(args.device == "cuda") as mem:
                    seconds = run_rows(pool, work, args.budget)
                steps = pool.step_counts["steps"] - before["steps"]
                tokens = describe(work)["tokens"]
                row = {"run": label, "model": model, "fsdp": fsdp, "gpus": args.gpus, "seconds": seconds,
                       "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / args.gpus,
                       "peak_memory_mib_per_gpu": mem.peak,
                       # FSDP steps every group together: rows per step near dp means no group idled.
                       "rows_per_step": (pool.step_counts["rows"] - before["rows"]) / steps if steps else None}
                print(f"[fsdp] {label}: {tokens / seconds:,.0f} tok/s, {tokens / seconds / args.gpus:,.0f} per GPU")
                out.setdefault("fsdp", []).append(row)
            finally:
                pool.close()


def phase_pool(args, out: dict) -> tuple[float, list[SequenceInput]]:
    """One replica per GPU in this process, the whole workload: seconds of the timed pass, and
    the workload."""
    from model_runtime.pool.pool import start_pool

    pool = start_pool(pool_settings(args, args.dense_model, args.gpus, 1, False, args.budget))
    try:
        work = grpo_workload(pool.info.vocab_size, args.workload)
        run_rows(pool, work, args.budget)
        row_seconds: list[float] = []
        seconds = run_rows(pool, work, args.budget, row_seconds)
        kernels = dict(pool.info.kernels)
    finally:
        pool.close()
    tokens = describe(work)["tokens"]
    out["pool"] = {"model": args.dense_model, "gpus": args.gpus, "kernels": kernels, "seconds": seconds,
                   "tokens_per_s": tokens / seconds, "rows": len(row_seconds),
                   "row_seconds_mean": float(np.mean(row_seconds)),
                   # Share of the run's GPU time spent inside rows: what is left is fill, drain and gaps.
                   "busy_fraction": sum(row_seconds) / (seconds * args.gpus)}
    print(f"[pool] {args.dense_model} x{args.gpus} in process, kernels {kernels}: {tokens / seconds:,.0f} tok/s")
    return seconds, work


def phase_http(args, out: dict) -> None:
    from bench.http_bench import forward_totals, start_server
    from packscore_client import AsyncScoreClient

    model = args.dense_model
    in_process, work = phase_pool(args, out)
    extra = ("--world-size", str(args.gpus), "--device", args.device) + (("--kernels", args.kernels) if args.kernels else ())
    server = start_server(model, args.budget, 5, extra)
    try:
        server.wait_ready(timeout=1800)

        async def drive() -> float:
            payload = [{"input_ids": s.input_ids, "score_from": s.score_from} for s in work]
            async with AsyncScoreClient(server.url, max_concurrency=4 * args.gpus) as client:
                await client.score(payload)  # untimed
                before = forward_totals(server.url)
                started = time.perf_counter()
                await client.score(payload)
                seconds = time.perf_counter() - started
                after = forward_totals(server.url)
                return seconds, {k: after[k] - before[k] for k in after}

        seconds, forwards = asyncio.run(drive())
    finally:
        server.stop(timeout=120)
    tokens = describe(work)["tokens"]
    rows = max(forwards["count"], 1)
    row = {"model": model, "gpus": args.gpus, "in_process_tokens_per_s": tokens / in_process,
           "http_tokens_per_s": tokens / seconds, "ratio": in_process / seconds,
           # Where the time goes: the server's forwards (rows, their mean duration as its scheduler
           # saw them, and their share of the GPUs' time) against the in-process pass's.
           "server_rows": int(forwards["count"]), "server_row_tokens_mean": forwards["tokens"] / rows,
           "server_row_seconds_mean": forwards["seconds"] / rows,
           "server_busy_fraction": forwards["seconds"] / (seconds * args.gpus),
           "in_process_rows": out["pool"]["rows"], "in_process_row_seconds_mean": out["pool"]["row_seconds_mean"],
           "in_process_busy_fraction": out["pool"]["busy_fraction"]}
    print(f"[http] {model} x{args.gpus}: HTTP {tokens / seconds:,.0f} tok/s, in process {tokens / in_process:,.0f}, "
          f"ratio {in_process / seconds:.3f}; rows {row['server_rows']} of {row['server_row_seconds_mean']:.2f} s mean, "
          f"busy {row['server_busy_fraction']:.2f} (in process: {row['in_process_rows']} of "
          f"{row['in_process_row_seconds_mean']:.2f} s, busy {row['in_process_busy_fraction']:.2f})")
    out["http"] = row


def output_name(date: str, quick: bool, kernels: str | None) -> str:
    """``multi_gpu-<date>[-quick][-FAMILY-BACKEND[_FAMILY-BACKEND...]].json``."""
    pinned = "-" + kernels.replace("=", "-").replace(",", "_") if kernels else ""
    return f"multi_gpu-{date}{'-quick' if quick else ''}{pinned}.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (or CPU processes) to use")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="tiny model and short sequences (a smoke run)")
    parser.add_argument("--phases", default="sp,fsdp,http", help="comma-separated subset of sp,fsdp,http,pool "
                        "(pool: the in-process half of http alone)")
    parser.add_argument("--kernels", default=None, metavar="FAMILY=BACKEND", help="pin kernel backends (packscore --kernels)")
    parser.add_argument("--sequences", type=int, default=None, help="workload size (multiple of 8; default 256)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "bench" / "out")))
    args = parser.parse_args(argv)
    # NVLink multicast stays off on the lent machines (NCCL, PyTorch symmetric memory, NVSHMEM);
    # the workers and the server inherit this environment.
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    if args.quick:
        args.dense_model, args.fsdp_models, args.sp_tokens, args.budget = "tiny", ["tiny"], 512, 2048
        args.workload = WorkloadSpec(num_sequences=16, prompt_median=60, prompt_clip=(8, 256),
                                     response_median=100, response_clip=(4, 512))
    else:
        args.dense_model, args.fsdp_models = "qwen3.5-9b", ["qwen3.5-27b", "qwen3.5-35b-a3b"]
        args.sp_tokens, args.budget, args.workload = 262_144, 65_536, WorkloadSpec()
    if args.sequences:
        args.workload = WorkloadSpec(**{**args.workload.__dict__, "num_sequences": args.sequences})
    out: dict = {"date": dt.date.today().isoformat(), "gpus": args.gpus, "device": args.device, "quick": args.quick,
                 "errors": {}}
    phases = {"sp": phase_sp, "fsdp": phase_fsdp, "http": phase_http, "pool": phase_pool}
    for name in args.phases.split(","):
        started = time.perf_counter()
        try:
            phases[name](args, out)
        except Exception as exc:  # keep what the other phases measured
            out["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"[{name}] failed: {exc}")
        print(f"[{name}] {time.perf_counter() - started:.0f}s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    target = Path(args.out) / output_name(out["date"], args.quick, args.kernels)
    target.write_text(json.dumps(out, indent=1))
    print(f"wrote {target}")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
