"""Runs a function on N processes joined over 127.0.0.1 (gloo on CPU, or NCCL with one GPU each)
and collects what each returns."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_runtime.pool.ports import free_port


def _entry(rank: int, world: int, port: int, backend: str, fn, args: tuple, out_dir: str) -> None:
    # Two cores in CI: one intra-op thread per rank keeps ranks from oversubscribing them.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Test results cross the process boundary here; no request data from outside is involved.
        out.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks fork from one server process that imported these once (no CUDA: NCCL ranks are safe too),
# instead of each rank importing torch and transformers' modeling stack again.
_PRELOAD = ["tests.distributed.harness", "tests.distributed.parity_cases", "transformers.models.qwen3_5.modeling_qwen3_5",
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "transformers.models.qwen3_next.modeling_qwen3_next"]


def run_world(fn, world: int, *args, backend: str = "gloo") -> list:
    """Calls ``fn(rank, world, *args)`` on ``world`` forked processes; returns their results by rank."""
    mp.set_forkserver_preload(_PRELOAD)  # read when the fork server starts, on the first call
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_entry, args=(world, free_port(), backend, fn, args, out_dir), nprocs=world, join=True,
                               start_method="forkserver")
        except Exception:
            pass  # the per-rank tracebacks below say more than spawn's summary
        results = []
        for rank in range(world):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                raise RuntimeError(f"rank {rank} of {world} exited without a result")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            results.append(value)
        return results


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
