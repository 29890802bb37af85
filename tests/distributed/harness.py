"""Runs a function on N processes joined over 127.0.0.1 (gloo on CPU, or NCCL with one GPU each)
and collects what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, listener: socket.socket, backend: str, fn, args: tuple, out_dir: str) -> None:
    # Two cores in CI: one intra-op thread per rank keeps ranks from oversubscribing them.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        # Rank 0 serves the store on the socket run_world bound: the port cannot be taken before it listens.
        store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], world, is_master=rank == 0,
                              master_listen_fd=listener.fileno() if rank == 0 else None)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Test results cross the process boundary here; no request data from outside is involved.
        out.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world: int, *args, backend: str = "gloo") -> list:
    """Calls ``fn(rank, world, *args)`` on ``world`` spawned processes; returns their results by rank."""
    with tempfile.TemporaryDirectory() as out_dir, socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        try:  # each rank gets its own copy of the listening socket (multiprocessing passes its descriptor)
            mp.spawn(_entry, args=(world, listener, backend, fn, args, out_dir), nprocs=world, join=True)
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
