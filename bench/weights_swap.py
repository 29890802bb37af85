"""Weight updates of one GPU's scorer under load: load at start, update from a warm page cache, swap.

    python -m bench.weights_swap --out DIR                       # H200: the 9B shape, ~4 minutes
    python -m bench.weights_swap --out DIR --preset tiny --device cpu   # dry run on CPU

1. Writes a random checkpoint of ``--preset``'s shape (bf16 on CUDA) to ``--work`` as safetensors
   shards of ``--shard-gb``, and a second one (``B``) whose files are links to the first's except
   the shard holding the final norm, rewritten with every tensor scaled by 1.01.
2. Reads every file once (the page cache is warm, as after a trainer's write), then times the
   start: ``load_model`` (Hugging Face's ``from_pretrained``) and the sharded reader the worker
   pool uses under FSDP (the model built empty, then ``materialize``), and checks both score alike.
3. Runs a scoring loop in a thread (``--loop-seqs`` sequences of ``--loop-len`` tokens per row)
   and, while it runs, ``update_weights(B)``: the time from the request to serving B, the load and
   swap times, the loop's longest gap between two rows against its median row time, host peak
   RSS and GPU peak memory during the update. Then back to A with no version (the content hash),
   checking A's numbers come back bit for bit, and once more in place (as when a second copy
   does not fit), whose copy pauses the loop. Each update with a version and with the content
   hash runs twice: a process's first update may differ from later ones (it allocates the new
   weights' device memory; later ones reuse it).
   For each update, ``StackSampler`` says where the updating and the scoring threads were during
   the loop's longest gap, and the allocator's counters say how many device allocations it made.
Writes ``weights-swap.json`` and ``weights-swap.md`` under ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.weights_cpu import TreeMemory
from model_runtime.scoring.backend import LocalBackend, favour_forward_threads
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.presets import PRESETS, build_config
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput


def write_checkpoints(preset: str, root: Path, device: torch.device, dtype: torch.dtype, shard_bytes: int) -> tuple[Path, Path, dict]:
    """Checkpoint A (random weights of ``preset``'s shape) and B (A with the final norm's shard scaled)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    a, b = root / "A", root / "B"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    started = time.perf_counter()
    config = build_config(PRESETS[preset])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = {name: f for f, names in zip(files, shards) for name in names}
    total = 0
    for f, names in zip(files, shards):
        part = {n: state[n].detach().to("cpu").contiguous() for n in names}
        total += sum(t.numel() * t.element_size() for t in part.values())
        save_file(part, a / f, metadata={"format": "pt"})
        if "model.norm.weight" in names:
            save_file({n: (t * 1.01).to(t.dtype) for n, t in part.items()}, b / f, metadata={"format": "pt"})
        else:
            os.symlink(a / f, b / f)
        del part
    config.save_pretrained(a)
    config.save_pretrained(b)
    for d in (a, b):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    del model, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return a, b, {"write_s": time.perf_counter() - started, "bytes": total, "files": len(files)}


def warm_page_cache(path: Path) -> float:
    started = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - started


class ScoringLoop:
    """Scores one row again and again in a thread; records when each row ended and its version."""

    def __init__(self, backend: LocalBackend, row: list[SequenceInput]):
        self.backend, self.row = backend, row
        self.ends: list[tuple[float, float, str]] = []  # (start, end, version)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.thread_ident = self._thread.ident

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                out = self.backend.score_row(self.row)
                self.ends.append((t0, time.perf_counter(), out[0].weights_version))
        except BaseException as error:
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def gaps(self, lo: float, hi: float) -> tuple[float, float]:
        """(longest time between two row ends within [lo, hi], median row time over the whole loop)."""
        ends = [e for _, e, _ in self.ends]
        inside = [b - a for a, b in zip(ends, ends[1:]) if b >= lo and a <= hi]
        return max(inside, default=float("nan")), statistics.median(e - s for s, e, _ in self.ends)

    def longest_gap_end(self, lo: float, hi: float) -> float | None:
        ends = [e for _, e, _ in self.ends]
        inside = [(b - a, b) for a, b in zip(ends, ends[1:]) if b >= lo and a <= hi]
        return max(inside)[1] if inside else None


class StackSampler:
    """Samples the stacks of every thread every ``period_s``: where the scoring loop's thread and
    all the others (the update and its readers) spent a window of time, by innermost frame and the
    innermost of packscore's own; threads waiting idle are left out. A sample needs the GIL, so a
    long gap between samples is a native call that held it."""

    IDLE = ("threading.py:", "queue.py:", "thread.py:_worker", "selectors.py:")

    def __init__(self, loop_ident: int, ignore: tuple[int, ...] = (), period_s: float = 0.005):
        self.loop_ident, self.ignore, self.period_s = loop_ident, ignore, period_s
        self.samples: list[tuple[float, str, str]] = []  # (time, "loop" or "others", place)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _place(frame) -> str:
        inner, own = None, None
        while frame is not None and own is None:
            name = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
            inner = inner or name
            if any(part in frame.f_code.co_filename for part in ("model_runtime", "/bench/")):
                own = name
            frame = frame.f_back
        return inner if own in (None, inner) else f"{own} > {inner}"

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period_s):
            frames, now = sys._current_frames(), time.perf_counter()
            for ident, frame in frames.items():
                if ident != me and ident not in self.ignore:
                    place = self._place(frame)
                    idle = place.split(" > ")[-1].startswith(self.IDLE) or place == "weights_swap.py:run"  # its sleeps
                    if ident == self.loop_ident or not idle:
                        self.samples.append((now, "loop" if ident == self.loop_ident else "others", place))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def where(self, lo: float, hi: float, top: int = 4) -> dict:
        """The loop's and the other threads' most frequent places within [lo, hi] with their sample
        counts, and the sampler's own longest gap there (a native call holding the GIL) with the
        places sampled just before it."""
        inside = [x for x in self.samples if lo <= x[0] <= hi]
        out: dict = {who: Counter(p for _, w, p in inside if w == who).most_common(top) for who in ("others", "loop")}
        times = sorted({t for t, _, _ in inside})
        if len(times) > 1:
            gap, at = max((b - a, a) for a, b in zip(times, times[1:]))
            out["longest_sample_gap_s"] = gap
            out["before_it"] = sorted({p for t, _, p in inside if t == at})
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_diff(a, b) -> float:
    return max(float(np.abs(x.logprobs - y.logprobs).max()) for x, y in zip(a, b))


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"preset": args.preset, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    a, b, written = write_checkpoints(args.preset, args.work, device, dtype, int(args.shard_gb * 2**30))
    out["checkpoint"] = written
    out["page_cache_read_s"] = warm_page_cache(a)
    mem = TreeMemory(period_s=0.05)

    # Start: Hugging Face's from_pretrained, as the single-process server loads.
    started = time.perf_counter()
    favour_forward_threads()  # as packscore serve does
    backend = LocalBackend(Scorer(load_model(str(a), device=device), max_batch_tokens=args.loop_seqs * args.loop_len),
                           updates=True)  # as served with --weights-root
    _sync(device)
    out["start_load_s"] = time.perf_counter() - started
    out["start_host_peak_rss"] = mem.peak_rss
    rng = np.random.default_rng(0)
    vocab = backend.info.vocab_size
    row = [SequenceInput(rng.integers(0, vocab, args.loop_len), score_from=1) for _ in range(args.loop_seqs)]
    t0 = time.perf_counter()
    for _ in range(3):  # compiles and autotunes the loop's shapes (fla: about a minute on a cold cache)
        reference_a = backend.score_row(row)
    out["warm_up_s"] = time.perf_counter() - t0

    # Start through the sharded reader (the worker pool's path under FSDP), on its own.
    from model_runtime.scoring.weights import materialize

    started = time.perf_counter()
    empty = load_model(str(a), device=device, weights_later=True)
    materialize(empty.model, a, device)
    _sync(device)
    out["start_sharded_reader_s"] = time.perf_counter() - started
    other = Scorer(empty, max_batch_tokens=args.loop_seqs * args.loop_len).score_row(row)
    out["sharded_reader_max_diff"] = max_diff(other, reference_a)
    del empty, other
    if device.type == "cuda":
        torch.cuda.empty_cache()

    updates = []
    for label, path, version, in_place in (
        ("A -> B, beside", b, "B", False),
        ("B -> A, beside, content hash", a, None, False),
        ("A -> B, beside, again", b, "B3", False),
        ("B -> A, beside, content hash, again", a, None, False),
        ("A -> B, in place", b, "B2", True),
    ):
        loop = ScoringLoop(backend, row)
        sampler = StackSampler(loop.thread_ident, ignore=(mem._thread.ident,))
        allocs = torch.cuda.memory_stats(device).get("num_device_alloc", 0) if device.type == "cuda" else 0
        time.sleep(args.idle_s)  # the loop's own rhythm before the request
        backend.update_in_place = in_place
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        mem.reset()
        requested = time.perf_counter()
        update = backend.update_weights(path, version)
        served = time.perf_counter()
        gpu_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        time.sleep(args.idle_s)
        loop.stop()
        sampler.stop()
        if loop.error is not None:
            raise loop.error
        gap, median = loop.gaps(requested, served + args.idle_s)
        gap_end = loop.longest_gap_end(requested, served + args.idle_s)
        result = backend.score_row(row)
        after = [v for s, _, v in loop.ends if s > served] + [result[0].weights_version]
        updates.append({
            "update": label,
            "request_to_serving_s": served - requested,
            "load_s": update.load_s,
            "swap_ms": update.swap_ms,
            "loop_max_gap_s": gap,
            "loop_median_row_s": median,
            "rows_during_update": sum(1 for s, e, _ in loop.ends if e >= requested and s <= served),
            "rows_after_named_new": all(v == update.weights_version for v in after),
            "host_peak_rss": mem.peak_rss,
            "gpu_peak_bytes": gpu_peak,
            "max_diff_vs_A": max_diff(result, reference_a),
            "device_allocations": (torch.cuda.memory_stats(device).get("num_device_alloc", 0) - allocs
                                   if device.type == "cuda" else 0),
            "in_longest_gap": sampler.where(gap_end - gap, gap_end) if gap_end is not None else {},
        })
        print(json.dumps(updates[-1]), flush=True)
    out["updates"] = updates
    if device.type == "cuda":
        out["device_memory_alone"] = device_memory_alone(backend, row, args.idle_s)
    out["B_differs_from_A"] = updates[0]["max_diff_vs_A"] > 0
    out["A_restored_exactly"] = updates[1]["max_diff_vs_A"] == 0.0 and updates[3]["max_diff_vs_A"] == 0.0
    out["gpu_weights_bytes"] = sum(p.numel() * p.element_size() for p in backend.scorer.loaded.model.parameters())
    mem.stop()
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return out


def device_memory_alone(backend: LocalBackend, row: list[SequenceInput], idle_s: float) -> list[dict]:
    """The loop's longest gap while, beside it, a second copy of the weights is allocated on the
    update's side stream from an empty cache (cudaMalloc), then while the cache is emptied (cudaFree)."""
    from model_runtime.scoring.tensor_file import staging_for

    model = backend.scorer.loaded.model
    device = backend.scorer.loaded.device
    stream = staging_for(device).stream
    torch.cuda.empty_cache()
    steps, copy = [], []

    def allocate() -> None:
        with torch.cuda.stream(stream):
            copy.extend(torch.empty_like(p) for p in model.parameters())
        stream.synchronize()

    def release() -> None:
        copy.clear()
        torch.cuda.empty_cache()

    for label, step in (("allocate a second copy (cudaMalloc)", allocate), ("free it, empty the cache (cudaFree)", release)):
        loop = ScoringLoop(backend, row)
        time.sleep(idle_s)
        before = torch.cuda.memory_stats(device).get("num_device_alloc", 0)
        t0 = time.perf_counter()
        step()
        took = time.perf_counter() - t0
        time.sleep(idle_s)
        loop.stop()
        gap, median = loop.gaps(t0, t0 + took)
        steps.append({"step": label, "s": took, "loop_max_gap_s": gap, "loop_median_row_s": median,
                      "device_allocations": torch.cuda.memory_stats(device).get("num_device_alloc", 0) - before})
        print(json.dumps(steps[-1]), flush=True)
    return steps


def table(r: dict) -> str:
    gib = lambda x: f"{x / 2**30:.1f}"  # noqa: E731
    lines = [
        f"{r['preset']} ({r['dtype']}, {r.get('gpu', r['device'])}): checkpoint {gib(r['checkpoint']['bytes'])} GiB in "
        f"{r['checkpoint']['files']} files; page cache read {r['page_cache_read_s']:.1f} s",
        f"start: from_pretrained {r['start_load_s']:.1f} s (host peak RSS {gib(r['start_host_peak_rss'])} GiB), sharded reader "
        f"{r['start_sharded_reader_s']:.1f} s (max |diff| vs from_pretrained {r['sharded_reader_max_diff']:.1e}); warm-up {r['warm_up_s']:.0f} s",
        f"B differs from A: {r['B_differs_from_A']}; A restored bit for bit: {r['A_restored_exactly']}",
        "",
        "| update | request to serving s | load s | swap ms | loop max gap s | loop median row s | rows during | "
        "rows after name new | host peak RSS GiB | GPU peak GiB | device allocations |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for u in r["updates"]:
        lines.append(
            f"| {u['update']} | {u['request_to_serving_s']:.2f} | {u['load_s']:.2f} | {u['swap_ms']:.1f} | "
            f"{u['loop_max_gap_s']:.2f} | {u['loop_median_row_s']:.3f} | {u['rows_during_update']} | "
            f"{u['rows_after_named_new']} | {gib(u['host_peak_rss'])} | {gib(u['gpu_peak_bytes'])} | "
            f"{u['device_allocations']} |"
        )
    if r.get("device_memory_alone"):
        lines += ["", "| beside the loop, alone | s | loop max gap s | loop median row s | device allocations |", "|---|---|---|---|---|"]
        lines += [f"| {x['step']} | {x['s']:.2f} | {x['loop_max_gap_s']:.2f} | {x['loop_median_row_s']:.3f} | "
                  f"{x['device_allocations']} |" for x in r["device_memory_alone"]]
    lines += ["", "Where the threads were during each update's longest gap of the loop (samples every 5 ms):", ""]
    for u in r["updates"]:
        w = u["in_longest_gap"]
        places = "; ".join(f"{who}: " + ", ".join(f"{p} ({n})" for p, n in w.get(who, [])) for who in ("others", "loop"))
        lines.append(f"- {u['update']}: {places}; longest gap between samples {w.get('longest_sample_gap_s', 0):.3f} s "
                     f"after {', '.join(w.get('before_it', []))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="weight update timings of one scorer under load")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="qwen3.5-9b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--work", type=Path, default=Path("/tmp/packscore-weights-swap"), help="local disk for the checkpoints")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--loop-seqs", type=int, default=4)
    parser.add_argument("--loop-len", type=int, default=1024)
    parser.add_argument("--idle-s", type=float, default=2.0, help="loop time before and after each update")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights-swap.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (args.out / "weights-swap.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
