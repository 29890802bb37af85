"""Everything measured on one H200, in one device call (bench/h200.sh installs the carried
wheels, sets the caches and runs this):

    MODE=all bash bench/h200.sh            # the suite, then every extra module present
    MODE="suite tests" bash bench/h200.sh  # any parts, in the order given

Parts (``MODE``, space- or comma-separated; ``all`` = ``suite`` and then the extras):
- ``suite``: the 9B benchmark against Hugging Face (``bench.gpu_suite --mode ab``): the
  headline tokens/s, fraction of the measured matmul peak, speedup and log-prob agreement.
- ``profile``: the 9B profile of one full row, the head's memory, idle latency (no HF).
- ``probe``: every Triton tile of the memory-bound steps against eager (``bench.elementwise_probe``).
- ``tests``: ``pytest tests/gpu`` (kernels, bf16 parity against HF, isolation; ``TESTS_PATHS``
  picks other paths or test ids).
- extras, each run only when its module exists: ``http_burst`` (``--mode gpu``),
  ``weights_swap``, ``prefix_sharing``, ``moe``; ``product_steps`` only by name (which row
  counts compute each dense product's rows alike, bench/product_steps.py); ``fla_configs`` only by
  name (every configuration fla offers for its forward kernels: bits and time, bench/fla_configs.py,
  about two minutes); ``narrow_steps`` only
  by name (the same for the narrow gate products, up to ``NARROW_MAX_ROWS``, default 32768, and
  what it leaves of prefix sharing, bench/narrow_steps.py); ``hf_divergence``
  only by name (packscore against Hugging Face module by module, ``HF_DIVERGENCE_PRESET``, default the 35B-A3B;
  ``HF_DIVERGENCE_LAYERS``, default 8; ``HF_DIVERGENCE_LENGTHS``, default 2000; the whole 35B-A3B
  on 3,000 and 6,000 tokens takes about 75 s).

Time: ``TOTAL_S`` (default 530) bounds the whole call; each part gets its own budget
(``SUITE_S``, ``PROFILE_S``, ``PROBE_S``, ``TESTS_S``, ``HTTP_BURST_S``, ...; defaults in
``PARTS``) clipped to what is left, and is stopped (its process group killed) when it runs out.
With less than ``MIN_PART_S`` (30) left, the remaining parts are skipped. ``SUITE_HF`` (default
``single``: Hugging Face one sequence at a time, the faster form, about 5 minutes in all;
``both`` adds the padded form, about 3 minutes more, with ``SUITE_S=540``) and ``SUITE_SWAPS``
(kernel swaps timed beside the defaults, ``;``-separated, about a minute each) shape the suite;
``PROBE_ONLY`` (e.g. ``conv``) limits the probe to the steps whose name contains it;
``MOE_SEQUENCES`` (default 24; 256, the whole workload: with Hugging Face beside it about 8
minutes, so the part's budget is then 500 s unless ``MOE_S`` says otherwise) and ``MOE_HF``
(default ``single``; ``none``: packscore's own sides only, about 2 minutes for the whole
workload) and ``MOE_ALSO`` (kernel overrides timed beside the defaults, ``;``-separated) and
``MOE_MAX_BATCH_TOKENS`` (the rows' token budget, default 65536) and ``MOE_BLOCK=1`` (the
block's backends timed with ``MOE_HF=none`` too, about 30 s) the MoE benchmark;
``PREFIX_SHARING_PRESET`` (default the 9B) and ``PREFIX_SHARING_ALSO`` (rows of 16384 too; 0:
not) and ``PREFIX_SHARING_PROFILE=1`` (one row profiled unshared, as served and every member
instead of the timed workloads) and ``PREFIX_SHARING_WORKLOADS`` (comma-separated, default all) and
``PREFIX_SHARING_PASSES`` (1: one timed pass a side, for the 27B) and ``PREFIX_SHARING_KERNELS``
(``--kernels`` for every side, e.g. ``gate_projection=tiles``) and ``PREFIX_SHARING_HF`` (N: each side's
distance to Hugging Face one at a time on the RL mix's first N sequences) and ``PREFIX_SHARING_SEEDS``
(``1,2,...``: the RL mix drawn with other seeds too, beside ``PREFIX_SHARING_WORKLOADS``, while the part's
time lasts) the prefix-sharing benchmark.

Output: at most 8 files in ``OUT`` (default bench/out), none in a folder: each part's results
JSON (the suite's as ``h200-<date>-ab.json`` with its chart), and ``summary.md``: every part's own
markdown table, then one combined table (printed last). Each part's full log stays in
``WORK_DIR`` (default /tmp/packscore-h200); a failed part's last lines are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILES = 8
MIN_PART_S = 30.0


@dataclass(frozen=True)
class Part:
    """One measurement: ``argv`` gets ``--out DIR`` appended; ``module`` must exist for it to run."""

    name: str
    argv: tuple[str, ...]
    budget_s: float
    module: str | None = None  # an extra: skipped unless bench/<module>.py exists


def _suite_argv() -> tuple[str, ...]:
    return ("-m", "bench.gpu_suite", "--mode", "ab", "--swaps", os.environ.get("SUITE_SWAPS", ""),
            "--hf", os.environ.get("SUITE_HF", "single"))


def _moe_budget_s() -> float:
    """The MoE part's default budget: the whole workload with Hugging Face beside it needs up to
    about 500 s (docs/benchmarks.md); anything less fits in 300."""
    whole = int(os.environ.get("MOE_SEQUENCES", "24")) > 24
    with_hf = os.environ.get("MOE_HF", "single") != "none"
    return 500.0 if whole and with_hf else 300.0


PARTS = {
    "suite": lambda: Part("suite", _suite_argv(), 360),
    "profile": lambda: Part("profile", ("-m", "bench.gpu_suite", "--mode", "profile"), 200),
    "probe": lambda: Part("probe", ("-m", "bench.elementwise_probe", "--only", os.environ.get("PROBE_ONLY", "")), 150),
    "tests": lambda: Part("tests", ("-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                                    *os.environ.get("TESTS_PATHS", "tests/gpu").split()), 300),
    "http_burst": lambda: Part("http_burst", ("-m", "bench.http_burst", "--mode", "gpu"), 150, "http_burst"),
    "weights_swap": lambda: Part("weights_swap", ("-m", "bench.weights_swap"), 240, "weights_swap"),
    "prefix_sharing": lambda: Part("prefix_sharing", ("-m", "bench.prefix_sharing", "--preset", os.environ.get(
        "PREFIX_SHARING_PRESET", "qwen3.5-9b"), "--also-tokens", os.environ.get("PREFIX_SHARING_ALSO", "16384"),
        "--workloads", os.environ.get("PREFIX_SHARING_WORKLOADS", ""), "--passes", os.environ.get("PREFIX_SHARING_PASSES", "2"),
        "--kernels", os.environ.get("PREFIX_SHARING_KERNELS", ""), "--hf-sequences", os.environ.get("PREFIX_SHARING_HF", "0"),
        "--seeds", os.environ.get("PREFIX_SHARING_SEEDS", ""),
        *(("--profile-row",) if os.environ.get("PREFIX_SHARING_PROFILE") == "1" else ())), 400,
        "prefix_sharing"),
    "moe": lambda: Part("moe", ("-m", "bench.moe", "--sequences", os.environ.get("MOE_SEQUENCES", "24"),
                                "--hf", os.environ.get("MOE_HF", "single"),
                                "--max-batch-tokens", os.environ.get("MOE_MAX_BATCH_TOKENS", "65536"),
                                *(("--block",) if os.environ.get("MOE_BLOCK") == "1" else ()),
                                *(a for k in os.environ.get("MOE_ALSO", "").split(";") if k for a in ("--also", k))),
                        _moe_budget_s(), "moe"),
    "product_steps": lambda: Part("product_steps", ("-m", "bench.product_steps"), 120),
    "fla_configs": lambda: Part("fla_configs", ("-m", "bench.fla_configs"), 300),
    "narrow_steps": lambda: Part("narrow_steps", ("-m", "bench.narrow_steps", "--max-rows", os.environ.get(
        "NARROW_MAX_ROWS", "32768")), 200),
    "hf_divergence": lambda: Part("hf_divergence", ("-m", "bench.hf_divergence", "--preset", os.environ.get(
        "HF_DIVERGENCE_PRESET", "qwen3.5-35b-a3b"), "--layers", os.environ.get("HF_DIVERGENCE_LAYERS", "8"),
        "--lengths", os.environ.get("HF_DIVERGENCE_LENGTHS", "2000")), 90, "hf_divergence"),
}
BUDGETED = {"suite", "profile", "moe", "prefix_sharing", "fla_configs"}  # parts that take --budget-s and stop starting phases in time
EXTRAS = ("http_burst", "weights_swap", "prefix_sharing", "moe")  # hf_divergence: by name only, a probe


def parse_mode(mode: str) -> list[str]:
    """``MODE`` as the parts' names, in order, ``all`` and ``extras`` expanded."""
    names: list[str] = []
    for name in re.split(r"[\s,]+", mode.strip()):
        expanded = ["suite", *EXTRAS] if name == "all" else list(EXTRAS) if name == "extras" else [name]
        names += [n for n in expanded if n and n not in names]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise SystemExit(f"MODE: unknown part(s) {unknown}; known: all, extras, {', '.join(PARTS)}")
    return names


def env_budget(part: Part) -> float:
    return float(os.environ.get(f"{part.name.upper()}_S", part.budget_s))


def run_part(part: Part, out_dir: Path, seconds: float) -> tuple[str, float]:
    """Runs one part in its own process group, killed after ``seconds``; (status, seconds taken)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, *part.argv]
    if part.name != "tests":
        argv += ["--out", str(out_dir)]
    if part.name in BUDGETED:
        argv += ["--budget-s", str(max(seconds - 20, 60))]  # it skips the phases that would not fit
    env = {**os.environ, "PACKSCORE_GPU_REPORT": str(out_dir / "gpu-report.jsonl")}
    started = time.perf_counter()
    with open(out_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=seconds)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"stopped after {seconds:.0f}s"
    return status, time.perf_counter() - started


def headline(name: str, out_dir: Path) -> str:
    """One line of the part's figures for the combined table."""
    if name == "tests":
        lines = [line for line in (out_dir / "log.txt").read_text(errors="replace").splitlines()
                 if re.search(r"\d+ (passed|failed|error)", line)]
        return lines[-1].strip("= ") if lines else ""
    for path in sorted(out_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("headline"), str):
            return data["headline"]
        bench = data.get("qwen3.5-9b") if isinstance(data, dict) else None
        if isinstance(bench, dict) and "sides" in bench:
            ours = bench["sides"].get("packscore", {})
            parts = [f"{ours.get('tokens_per_s', 0):,.0f} tokens/s", f"{bench.get('mfu_of_measured_peak', 0):.3f} of peak"]
            if "speedup_vs_hf" in bench:
                parts.append(f"{bench['speedup_vs_hf']:.2f}x HF")
            diff = bench.get("diff_packscore_vs_hf_single")
            if diff:
                parts.append(f"log-probs {diff['logprob_mean']:.1e} mean from HF one at a time")
            return ", ".join(parts)
    return ""


def collect(name: str, work: Path, out: Path, written: list[str]) -> list[str]:
    """Copies the part's JSON (and the suite's chart) to ``out``, within MAX_FILES; returns its
    markdown tables."""
    report = work / "gpu-report.jsonl"  # what the GPU tests recorded (tests/gpu/conftest.py), as one JSON file
    if report.exists():
        records = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
        (work / "gpu-report.json").write_text(json.dumps({"records": records}, indent=1))
    found = sorted(work.glob("*.json")) + sorted(work.glob("*.png"))
    for path in found:
        alone = sum(p.suffix == path.suffix for p in found) == 1
        target = path.name if path.name.startswith("h200-") else f"{name}{path.suffix}" if alone else f"{name}-{path.name}"
        if target in written:
            continue
        if len(written) >= MAX_FILES - 1:  # summary.md takes the last place
            print(f"[h200] {path.name}: not copied, {MAX_FILES} files already in OUT (it stays in {work})")
            continue
        shutil.copyfile(path, out / target)
        written.append(target)
    tables = [p.read_text() for p in sorted(work.glob("*.md"))]
    if not tables:  # the suite prints its table; rebuild it from its JSON
        from bench.report import benchmarks, markdown

        for path in sorted(work.glob("h200-*.json")):
            results = json.loads(path.read_text())
            if benchmarks(results):
                tables.append(markdown(results))
    return tables


def main(argv=None, parts: dict[str, Part] | None = None) -> int:
    """``parts`` replaces entries of PARTS (the tests run stand-ins)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default=os.environ.get("MODE", "all"))
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "bench" / "out")))
    parser.add_argument("--work", default=os.environ.get("WORK_DIR", "/tmp/packscore-h200"))
    parser.add_argument("--total-s", type=float, default=float(os.environ.get("TOTAL_S", 530)))
    args = parser.parse_args(argv)
    names = parse_mode(args.mode)
    parts = {**{name: make() for name, make in PARTS.items()}, **(parts or {})}
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    rows, tables, written = [], [], []
    for name in names:
        part = parts[name]
        if part.module and not (REPO / "bench" / f"{part.module}.py").exists():
            rows.append((name, "not present", 0.0, ""))
            continue
        left = args.total_s - (time.perf_counter() - started)
        seconds = min(env_budget(part), left)
        if left < MIN_PART_S:
            rows.append((name, f"skipped: {left:.0f}s left", 0.0, ""))
            continue
        print(f"[h200] {name}: up to {seconds:.0f}s ({' '.join(part.argv)})", flush=True)
        status, took = run_part(part, work / name, seconds)
        if status != "ok":
            tail = (work / name / "log.txt").read_text(errors="replace").splitlines()[-40:]
            print(f"[h200] {name}: {status}; last lines of its log:\n" + "\n".join(tail), flush=True)
        tables += [f"## {name}\n\n{t.strip()}\n" for t in collect(name, work / name, out, written)]
        rows.append((name, status, took, headline(name, work / name)))
        print(f"[h200] {name}: {status} in {took:.0f}s", flush=True)

    combined = ["| part | status | seconds | figures |", "| --- | --- | ---: | --- |"]
    combined += [f"| {n} | {s} | {t:.0f} | {h} |" for n, s, t, h in rows]
    summary = "\n".join(tables + ["## all parts\n", *combined]) + "\n"
    (out / "summary.md").write_text(summary)
    print("\n" + summary, flush=True)
    return 0 if all(s in ("ok", "not present") for _, s, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
