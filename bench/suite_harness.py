"""What the GPU suite's phases share: the run's state (``Suite``: time budget, results file),
logging, the device the run measures on, and timing and memory helpers.

``DEVICE`` is "cuda", or "cpu" for ``--dry-run-cpu`` (``set_device``); read it as
``suite_harness.DEVICE`` when a function runs, not imported by name.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import torch

DATE = datetime.date.today().isoformat()  # names the results file
GiB = 2**30
# "cuda" on the H200; "cpu" only for --dry-run-cpu, which walks every code path with the tiny
# preset and a miniature workload to catch mistakes before spending device time.
DEVICE = "cuda"


def kernel_cache_files() -> int | None:
    """Files in the Triton (and Inductor) cache directories; None where neither is set."""
    roots = {os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")} - {None, ""}
    if not roots:
        return None
    # a set: the Inductor cache usually lies inside the Triton one
    return len({os.path.join(d, f) for root in roots if os.path.isdir(root) for d, _, files in os.walk(root) for f in files})


class Suite:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        suffix = "" if args.mode == "full" else f"-{args.mode}"
        self.json_path = self.out / f"h200-{DATE}{suffix}.json"
        self.results: dict = {"date": DATE, "mode": args.mode, "phases": {}, "errors": {},
                              # before anything compiles: a warm-up time is start-up time only from empty caches
                              "kernel_cache_files_at_start": kernel_cache_files()}
        self.texts: dict[str, str] = {}

    def remaining(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def phase(self, name: str, fn, needs_s: float):
        left = self.remaining()
        if left < needs_s:
            log(f"== skip {name}: {left:.0f}s left, needs about {needs_s:.0f}s")
            self.results["phases"][name] = f"skipped ({left:.0f}s left, needs {needs_s:.0f}s)"
            self.save()
            return None
        log(f"== {name} ({left:.0f}s left)")
        t0 = time.perf_counter()
        try:
            value = fn()
            self.results["phases"][name] = f"ok in {time.perf_counter() - t0:.1f}s"
            return value
        except Exception as err:  # one phase failing must not lose the others
            log(traceback.format_exc())
            self.results["phases"][name] = f"failed after {time.perf_counter() - t0:.1f}s"
            self.results["errors"][name] = f"{type(err).__name__}: {err}"[:2000]
            return None
        finally:
            free_memory()
            self.save()

    def save(self):
        self.json_path.write_text(json.dumps(self.results, indent=1, default=_jsonable))
        for name, text in self.texts.items():
            (self.out / name).write_text(text)


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    return repr(x)


def free_memory():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def peak_allocated() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


class Stopwatch:
    """CUDA events on the GPU, the host clock on the CPU; ``ms`` after ``stop``."""

    def __init__(self):
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if DEVICE == "cuda" else None

    def start(self):
        if self.events:
            self.events[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.events:
            self.events[1].record()
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1])
        return (time.perf_counter() - self.t0) * 1e3


def set_device(name: str) -> None:
    global DEVICE
    DEVICE = name


def timed(fn):
    """``(fn(), seconds, peak GiB)``, synchronised on both sides."""
    sync()
    reset_peak()
    t0 = time.perf_counter()
    value = fn()
    sync()
    return value, time.perf_counter() - t0, peak_allocated() / GiB


def compiled_kernels() -> dict[str, str]:
    """Triton's on-disk cache as ``{entry: kernel name}``: a difference of two snapshots names the
    kernels compiled between them (each compilation writes one entry with the kernel's cubin)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return {}
    return {entry.name: cubin.stem for entry in root.iterdir() if entry.is_dir() for cubin in entry.glob("*.cubin")}


def compiled_between(before: dict[str, str], after: dict[str, str]) -> dict[str, int]:
    """How many times each kernel was compiled between two ``compiled_kernels`` snapshots."""
    return dict(Counter(name for entry, name in after.items() if entry not in before).most_common())
