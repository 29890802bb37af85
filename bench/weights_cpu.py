"""Host memory and time of loading and swapping weights on CPU: one process and the FSDP pool.

    python -m bench.weights_cpu --out bench/results [--baseline-tree DIR] [--ranks 2 4]
    python -m bench.weights_cpu --in-place --out bench/results [--baseline-tree DIR] [--repeats 3]

Builds two random qwen3_5 checkpoints of a few hundred MB (bf16, save_pretrained; served in
float32, so every loader makes real copies rather than mapping the files), then for
each code tree (this one, and ``--baseline-tree``: a checkout of an older commit, for the
"before" figures) and each rank count starts the worker pool with ``--fsdp`` on CPU (gloo),
sampling the resident memory of the whole process tree (the pool's process and its workers)
every 20 ms: its peak while starting (loading), then what it holds after a first row, and during an update to the second
checkpoint (where the tree has ``update_weights``). RSS counts a page shared by two processes
twice; PSS (``/proc/PID/smaps_rollup``) splits it, so both are reported. The single process
(``LocalBackend``) is measured the same way. Each measurement runs in a fresh process.
Writes ``weights-cpu.json`` and ``weights-cpu.md`` under ``--out`` and prints the table.

``--in-place``: a larger pair (``IN_PLACE_CONFIG``, 2.0 GB bf16 each, in 5 shards) and
``LocalBackend`` updates in place (``update_in_place``), with the content hash and with a named
version, each with the files in the page cache and dropped from it first (``posix_fadvise``
``DONTNEED``): the update's wall time and the checkpoint's bytes it read, positioned reads
(``/proc/self/io`` ``rchar``) and mapped ones (``_MappedFile.read``), in checkpoints. The trees run
in turn, ``--rounds`` fresh processes each. Writes ``weights-cpu-in-place.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TREE = HERE.parent.parent
CONFIG = dict(
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


# --in-place: twice the hidden size, 20 layers: 2.0 GB bf16
IN_PLACE_CONFIG = {**CONFIG, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 20}


def build_checkpoints(root: Path, config: dict = CONFIG, tag: str = "ckpt", shard: str = "200MB") -> tuple[Path, Path]:
    import torch
    import transformers as tf

    from model_runtime.scoring.presets import _ROPE_QWEN35

    out = []
    for seed in (0, 1):
        path = root / f"{tag}-seed{seed}"
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**config, rope_parameters=dict(_ROPE_QWEN35)))
            model.to(torch.bfloat16).save_pretrained(path, max_shard_size=shard)
            del model
        out.append(path)
    return out[0], out[1]


class TreeMemory:
    """Samples RSS and PSS summed over this process and its descendants; keeps the peaks."""

    def __init__(self, period_s: float = 0.02):
        self.period_s = period_s
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def now(self) -> tuple[int, int]:
        rss = pss = 0
        for pid in self._tree(os.getpid()):
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) << 10
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) << 10
            except OSError:
                continue
        return rss, pss

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = self.now()
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            time.sleep(self.period_s)

    def reset(self) -> None:
        self.peak_rss, self.peak_pss = self.now()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(args) -> dict:
    """One measurement in this process (run by the orchestrator with PYTHONPATH set to a tree)."""
    import numpy as np
    import torch

    from model_runtime.types import SequenceInput

    torch.set_num_threads(1)
    ranks = args.ranks[0]
    mem = TreeMemory()
    out: dict = {"ranks": ranks}
    started = time.perf_counter()
    if ranks == 0:
        from model_runtime.scoring.backend import LocalBackend, favour_forward_threads
        from model_runtime.scoring.loading import load_model
        from model_runtime.scoring.scorer import Scorer

        favour_forward_threads()  # as packscore serve does
        backend = LocalBackend(Scorer(load_model(args.checkpoint, device="cpu")))
    else:
        from model_runtime.pool.pool import start_pool

        backend = start_pool(dict(model=args.checkpoint, device="cpu", dtype="float32", world_size=ranks, sp=1,
                                  fsdp=True, max_batch_tokens=256))
    out["start_s"] = time.perf_counter() - started
    time.sleep(0.1)  # one more sample
    out["start_peak_rss"], out["start_peak_pss"] = mem.peak_rss, mem.peak_pss
    out["loaded_rss"], out["loaded_pss"] = mem.now()
    row = [SequenceInput(np.random.default_rng(0).integers(0, backend.info.vocab_size, 64))]
    backend.score_row(row)
    out["first_row_peak_rss"], out["first_row_peak_pss"] = mem.peak_rss, mem.peak_pss
    out["serving_rss"], out["serving_pss"] = mem.now()
    if hasattr(backend, "update_weights") and args.checkpoint != "tiny":
        mem.reset()
        t0 = time.perf_counter()
        update = backend.update_weights(Path(args.update), "v2")
        out["update_wall_s"] = time.perf_counter() - t0
        out["update_load_s"], out["update_swap_ms"] = update.load_s, update.swap_ms
        out["update_peak_rss"], out["update_peak_pss"] = mem.peak_rss, mem.peak_pss
        backend.score_row(row)
    backend.close()
    mem.stop()
    return out


def _drop_from_cache(path: Path) -> None:
    """Drops the checkpoint's files from the page cache (pages nothing maps)."""
    for file in path.iterdir():
        with open(file, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _warm(path: Path) -> None:
    for file in path.iterdir():
        with open(file, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def _io() -> dict[str, int]:
    return {k: int(v) for k, v in (ln.split(": ") for ln in Path("/proc/self/io").read_text().splitlines())}


def measure_in_place(args) -> dict:
    """Updates in place back and forth between the two checkpoints (``--in-place --measure``)."""
    import statistics

    import torch

    import model_runtime
    from model_runtime.scoring import weights
    from model_runtime.scoring.backend import LocalBackend
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    torch.set_num_threads(1)
    if args.nice is not None:  # where the tree keeps it: the background threads' priority
        for module in ("model_runtime.scoring.content_hash", "model_runtime.scoring.weights"):
            try:
                setattr(importlib.import_module(module), "BACKGROUND_NICE", args.nice)
            except ImportError:
                pass
    mapped = [0]
    real = weights._MappedFile.read

    def counted(self, name, rows=None):
        out = real(self, name, rows)
        mapped[0] += out.numel() * out.element_size()
        return out

    weights._MappedFile.read = counted  # the copy into place (and, before, the NaN pass) reads the mapping
    paths = [Path(args.checkpoint), Path(args.update)]
    tensor_bytes = _model_bytes(paths[1]) // 2  # float32's bytes: the checkpoint holds bf16
    backend = LocalBackend(Scorer(load_model(str(paths[0]), device="cpu")))
    backend.update_in_place = True
    runs: dict[str, list[dict]] = {}
    at = 0
    for repeat in range(args.repeats):
        at = 1 - at  # four updates a round: each kind goes to either checkpoint in turn
        for cache in ("page cache", "cold"):
            for how in ("content hash", "named version")[::1 if repeat % 2 else -1]:  # each first in turn
                target = paths[1 - at]
                for path in paths:
                    if cache == "cold":
                        _drop_from_cache(path)
                    else:
                        _warm(path)
                before, mapped[0] = _io(), 0
                t0 = time.perf_counter()
                update = backend.update_weights(target, None if how == "content hash" else f"v{len(runs)}-{at}")
                wall = time.perf_counter() - t0
                after = _io()
                positioned = after["rchar"] - before["rchar"]
                runs.setdefault(f"{how}, {cache}", []).append(dict(
                    wall_s=wall, swap_ms=update.swap_ms, unlocked_s=wall - update.swap_ms / 1e3,
                    disk_bytes=after["read_bytes"] - before["read_bytes"], reads=(positioned + mapped[0]) / tensor_bytes,
                    positioned_reads=positioned / tensor_bytes, mapped_reads=mapped[0] / tensor_bytes))
                at = 1 - at
    summary = {key: {"median_wall_s": statistics.median(r["wall_s"] for r in rs),
                     "median_unlocked_s": statistics.median(r["unlocked_s"] for r in rs),
                     "median_swap_ms": statistics.median(r["swap_ms"] for r in rs),
                     "reads": statistics.median(r["reads"] for r in rs),
                     "positioned_reads": statistics.median(r["positioned_reads"] for r in rs),
                     "mapped_reads": statistics.median(r["mapped_reads"] for r in rs),
                     "disk_gb": statistics.median(r["disk_bytes"] for r in rs) / 1e9, "runs": rs}
               for key, rs in runs.items()}
    return {"model_runtime": model_runtime.__file__, "tensor_bytes": tensor_bytes, "served": backend.info.dtype,
            "results": summary}


def main_in_place(args) -> None:
    old, new = build_checkpoints(args.work, IN_PLACE_CONFIG, "in-place", "500MB")
    trees = [("after", TREE)] + ([("before", args.baseline_tree.resolve())] if args.baseline_tree else [])
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for label, tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
            cmd = [sys.executable, str(HERE), "--in-place", "--measure", "--repeats", str(args.repeats),
                   "--checkpoint", str(old), "--update", str(new)] + ([] if args.nice is None else ["--nice", str(args.nice)])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
            results.setdefault(label, []).append(json.loads(line[0][len("RESULT "):]))
            print(label, {k: round(v["median_wall_s"], 2) for k, v in results[label][-1]["results"].items()}, flush=True)
    report = {"config": IN_PLACE_CONFIG, "checkpoint_gb": results["after"][0]["tensor_bytes"] / 1e9,
              "shards": len(list(new.glob("*.safetensors"))), "served": results["after"][0]["served"],
              "device": "cpu", "cpus": os.cpu_count(), "nice": args.nice, "trees": results}
    _write(args.out, "weights-cpu-in-place", report, _in_place_table(report))


def _in_place_table(report: dict) -> str:
    import statistics

    lines = [f"`LocalBackend` updates in place on CPU ({report['cpus']} cores): a {report['checkpoint_gb']:.2f} GB bf16 "
             f"checkpoint ({report['shards']} shards), served in {report['served']}. Median over every update of every "
             "process; reads in whole checkpoints, positioned + mapped; cold: the files dropped from the page cache "
             "before each update.",
             *([] if report["nice"] is None else ["", f"The background threads at nice {report['nice']}."]),
             "", "| code | update | cache | updates | request to serving s | of which the old weights serve s | copy "
             "(forwards paused) s | checkpoint reads (positioned + mapped) | read from disk GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, procs in report["trees"].items():
        for key in procs[0]["results"]:
            runs = [r for p in procs for r in p["results"][key]["runs"]]
            med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
            how, cache = key.split(", ")
            lines.append(f"| {label} | {how} | {cache} | {len(runs)} | {med('wall_s'):.2f} | {med('unlocked_s'):.2f} | "
                         f"{med('swap_ms') / 1e3:.2f} | "
                         f"{med('reads'):.2f} ({med('positioned_reads'):.2f} + {med('mapped_reads'):.2f}) | "
                         f"{med('disk_bytes') / 1e9:.2f} |")
    return "\n".join(lines)


def _model_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * 4  # float32 on CPU
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/packscore-weights-cpu"))
    parser.add_argument("--baseline-tree", type=Path, default=None, help="an older checkout, for the 'before' figures")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--in-place", action="store_true", help="time updates in place (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="--in-place: updates of each kind a process")
    parser.add_argument("--rounds", type=int, default=2, help="--in-place: processes a tree, in turn")
    parser.add_argument("--nice", type=int, default=None, help="--in-place: the background threads' nice value")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--update", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print("RESULT " + json.dumps(measure_in_place(args) if args.in_place else measure(args)), flush=True)
        return
    if args.in_place:
        args.work.mkdir(parents=True, exist_ok=True)
        return main_in_place(args)
    args.work.mkdir(parents=True, exist_ok=True)
    old, new = build_checkpoints(args.work)
    model_bytes = _model_bytes(old)
    trees = [("after", TREE)] + ([("before", args.baseline_tree.resolve())] if args.baseline_tree else [])
    rows = []
    # The same processes serving the tiny preset (weights of a few MB): what the interpreters,
    # torch and the process group take without the weights.
    runs = [("control (tiny preset)", TREE, "tiny", ranks) for ranks in [0] + list(args.ranks)]
    runs += [(label, tree, str(old), ranks) for label, tree in trees for ranks in [0] + list(args.ranks)]
    for label, tree, model, ranks in runs:
        env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, str(HERE), "--measure", "--ranks", str(ranks), "--checkpoint", model, "--update", str(new)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"{label} ranks={ranks} failed:\n{proc.stderr[-3000:]}")
        result = {"code": label, **json.loads(line[0][len("RESULT "):])}
        rows.append(result)
        print(f"{label} ranks={ranks}: {result}", flush=True)
    report = {"model_bytes": model_bytes, "config": CONFIG, "dtype": "float32", "device": "cpu", "results": rows}
    _write(args.out, "weights-cpu", report, _table(report))


def _write(out: Path, stem: str, report: dict, table: str) -> None:
    """``report`` as ``out/stem.json`` and its ``table`` as ``out/stem.md``, the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


def _table(report: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f}" if b else "-"  # noqa: E731
    one = report["model_bytes"]
    lines = [
        f"One copy of the weights: {gib(one)} GiB (float32). Peaks summed over the process tree; the share of the "
        "weights is the peak PSS less the control's (the same processes serving the tiny preset).",
        "",
        "| code | processes | start s | start peak RSS GiB | start peak PSS GiB | weights' share of the start peak, in copies | "
        "PSS after the first row GiB | update load s | swap ms | update peak PSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    control = {r["ranks"]: r for r in report["results"] if r["code"].startswith("control")}
    for r in report["results"]:
        extra = r["start_peak_pss"] - control[r["ranks"]]["start_peak_pss"] if r["ranks"] in control else 0
        copies = "-" if r["code"].startswith("control") else f"{extra / one:.2f}"
        procs = "1 (LocalBackend)" if r["ranks"] == 0 else f"1 + {r['ranks']} FSDP ranks"
        lines.append(
            f"| {r['code']} | {procs} | {r['start_s']:.1f} | {gib(r['start_peak_rss'])} | {gib(r['start_peak_pss'])} | "
            f"{copies} | {gib(r['serving_pss'])} | "
            f"{r.get('update_load_s', float('nan')):.2f} | {r.get('update_swap_ms', float('nan')):.1f} | "
            f"{gib(r.get('update_peak_pss', 0))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
