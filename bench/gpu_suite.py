"""The H200 suite: the 9B benchmark against Hugging Face, its profile and probes, in one call.

    python -m bench.gpu_suite --mode ab --swaps '' --out DIR     (bench/h200.sh wraps this)

Modes (each fits one 10-minute device call):
- ``ab``: the 9B benchmark on the whole workload (256 sequences) against Hugging Face, with
  kernel swaps (several families joined by commas count as one swap): the headline figures
  and a kernel change's speed and closeness to Hugging Face, in about 7 minutes plus one
  minute per swap; ``--hf single`` leaves out the padded Hugging Face form (about 3 minutes less).
- ``full``: the same with its profile, the head's memory and idle latency, packscore again with
  attention=varlen and elementwise=inductor_exact, and the 35B-A3B experts (grouped_mm vs eager).
- ``profile``: the 9B model's profile of one full row, the head's memory and idle latency, with
  packscore alone on the first 48 sequences (about 3 minutes).
- ``smoke``: a quick pass over the benchmark (32 sequences) and most GPU tests.
- ``extra``: the full-depth 35B-A3B experts comparison and the 35B-A3B (with Hugging Face one at a time) and 27B benchmarks.

Phases run in order while the time budget (``--budget-s``) lasts; the results JSON is rewritten
after every phase so a run cut short still returns what it measured. The phases' shared state
and helpers are in bench/suite_harness.py, the probes beside the benchmark in bench/gpu_probes.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import traceback

import numpy as np
import torch

from bench import suite_harness as H
from bench.gpu_probes import GpuClocks, environment, matmul_ceiling, matmul_sustained, moe_experts, run_tests
from bench.hf_reference import diff_stats
from bench.suite_harness import GiB, Stopwatch, Suite, allocated, log, peak_allocated, reset_peak, sync, timed


# ---------------------------------------------------------------- the benchmark


def run_benchmark(suite: Suite, preset: str, num_sequences: int, *, hf_single: bool, max_batch_tokens: int,
                  key: str, extras: bool, spec=None, alternatives: tuple[str, ...] = (), hf: str = "both") -> dict:
    from bench.flops import flop_model
    from bench.hf_reference import build_twin, score_padded, score_padded_fitting, score_single, to_numpy
    from bench.workload import WorkloadSpec, describe, grpo_workload
    from model_runtime.scoring.scorer import Scorer

    ceiling = suite.results.get("ceiling", {}).get("tflops_mean") or 788.0
    t0 = time.perf_counter()
    twin = build_twin(preset, device=H.DEVICE, dtype=torch.bfloat16 if H.DEVICE == "cuda" else torch.float32)
    sync()
    build_s = time.perf_counter() - t0
    loaded = twin.loaded
    sequences = grpo_workload(loaded.vocab_size, spec or WorkloadSpec())[:num_sequences]
    flops = flop_model(loaded.model.layers, loaded.model.config)
    work = describe(sequences)
    total_flops = flops.workload_flops(sequences)
    total_flops_all = flops.workload_flops(sequences, all_positions=True)
    bench = {
        "preset": preset,
        "build_s": build_s,
        "weights_gib": allocated() / GiB,
        "kernels": loaded.backends.names,
        "workload": work,
        "flop_model": flops.as_dict(),
        "model_tflop": total_flops / 1e12,
        "model_tflop_all_positions": total_flops_all / 1e12,
        "ceiling_tflops": ceiling,
        "sides": {},
    }
    suite.results[key] = bench
    log(f"{preset}: built in {build_s:.1f}s; workload {work}; {total_flops / work['tokens'] / 1e9:.2f} GFLOP/token")

    def side(name, seconds, peak_gib, **extra):
        entry = {
            "seconds": seconds,
            "tokens_per_s": work["tokens"] / seconds,
            "model_tflops": total_flops / seconds / 1e12,
            "mfu_of_measured_peak": total_flops / seconds / 1e12 / ceiling,
            "mfu_all_positions_counted": total_flops_all / seconds / 1e12 / ceiling,
            "peak_memory_gib": peak_gib,
            **extra,
        }
        bench["sides"][name] = entry
        log(f"{preset} {name}: {entry['tokens_per_s']:.0f} tokens/s, {entry['model_tflops']:.0f} TFLOP/s, "
            f"{100 * entry['mfu_of_measured_peak']:.1f}% of measured peak, peak {peak_gib:.1f} GiB")
        suite.save()

    # (a) packscore in-process: warm-up (compiles and autotunes), untimed pass, timed pass.
    scorer = Scorer(loaded, max_batch_tokens=max_batch_tokens)
    scorer.warm_up()
    bench["warm_up_s"] = scorer.warm_up_seconds
    bench["kernel_cache_files_at_start"] = suite.results.get("kernel_cache_files_at_start")
    bench["warm_up_steps_s"] = scorer.warm_up_steps
    bench["head_chunk_tokens"] = scorer.head_chunk_tokens
    # rows one narrow product may span (gate_projection=runs), by module name without the layer
    bench["narrow_runs"] = {re.sub(r"^layers\.\d+\.", "", name): rows for name, rows in (scorer.narrow_runs or {}).items()}
    log(f"warm-up {scorer.warm_up_seconds:.1f}s (caches as the run started), head chunk {scorer.head_chunk_tokens} tokens")
    # The first pass meets every row shape for the first time, as a server's traffic does: its
    # rate shows what compiling or planning per new shape would cost a real client.
    compiled_before = H.compiled_kernels()
    _, first_s, _ = timed(lambda: scorer.score(sequences))
    # Triton kernels the warm-up left for the first pass to compile (each costs it a compilation)
    bench["compiled_during_first_pass"] = H.compiled_between(compiled_before, H.compiled_kernels())
    with GpuClocks() as clocks:
        ours_raw, seconds, peak = timed(lambda: scorer.score(sequences))
    ours = [(r.logprobs, r.entropy) for r in ours_raw]
    side("packscore", seconds, peak, max_batch_tokens=max_batch_tokens,
         first_pass_tokens_per_s=work["tokens"] / first_s, clocks=clocks.summary())
    # The same kernels with each row's results read back before the next row is queued: what
    # overlapping the host's work between rows with the GPU's gains.
    scorer.queue_ahead = False
    serial_raw, seconds, peak = timed(lambda: scorer.score(sequences))
    scorer.queue_ahead = True
    side("packscore_rows_read_back_one_by_one", seconds, peak, max_batch_tokens=max_batch_tokens)
    bench["diff_packscore_rows_read_back_one_by_one_vs_packscore"] = diff_stats([(r.logprobs, r.entropy) for r in serial_raw], ours)
    del serial_raw

    if extras:
        try:
            extra_measurements(suite, bench, scorer, sequences)
        except Exception as err:  # the comparison with Hugging Face still runs
            log(traceback.format_exc())
            suite.results["errors"][f"{key} extras"] = f"{type(err).__name__}: {err}"[:2000]

    # (b) Hugging Face, padded batches as large as memory allows, then one sequence at a time.
    padded = single = None
    if hf != "none":
        with twin.hf() as hf_model:
            if hf == "both":
                _, budget = score_padded_fitting(hf_model, sequences, H.DEVICE)
                padded_raw, seconds, peak = timed(lambda: score_padded(hf_model, sequences, H.DEVICE, budget))
                padded = to_numpy(padded_raw)
                del padded_raw
                side("hf_padded", seconds, peak, padded_token_budget=budget)
                bench["diff_packscore_vs_hf_padded"] = diff_stats(ours, padded)
                log(f"packscore vs HF padded: {bench['diff_packscore_vs_hf_padded']}")
            # Two passes one sequence at a time; on the H200 it runs at about the padded rate, so
            # 0.7 of that (or 20k tokens/s, about 0.9 of its own rate, without it) is a safe floor.
            floor_rate = 0.7 * bench["sides"]["hf_padded"]["tokens_per_s"] if padded is not None else 20000.0
            single_needs_s = 2 * work["tokens"] / floor_rate + 30
            if hf_single and suite.remaining() > single_needs_s:
                score_single(hf_model, sequences, H.DEVICE)
                single_raw, seconds, peak = timed(lambda: score_single(hf_model, sequences, H.DEVICE))
                single = to_numpy(single_raw)
                del single_raw
                side("hf_single", seconds, peak)
                bench["diff_packscore_vs_hf_single"] = diff_stats(ours, single)
                if padded is not None:
                    bench["diff_hf_padded_vs_hf_single"] = diff_stats(padded, single)
            elif hf_single:
                bench["hf_single"] = (f"skipped: {suite.remaining():.0f}s left in this call, "
                                      f"about {single_needs_s:.0f}s needed")
    for alternative in alternatives:
        if suite.remaining() < 2.5 * work["tokens"] / 30000 + 30:
            bench[f"packscore_{alternative}"] = "skipped: not enough time left in this call"
            continue
        # (a') packscore again with kernel families swapped ("attention=varlen": the varlen kernel
        # over the whole row instead of SDPA per segment; several joined by commas): its speed and
        # its closeness to (b).
        from bench.hf_reference import kernel_swaps

        name = "packscore_" + "_".join(part.replace("=", "_") for part in alternative.split(","))
        try:
            with kernel_swaps(loaded.model, alternative):
                scorer.score(sequences)
                alt_raw, seconds, peak = timed(lambda: scorer.score(sequences))
        except Exception as exc:  # one broken swap must not cost the others or the headline numbers
            bench[name] = f"failed: {type(exc).__name__}: {exc}"
            log(f"{alternative} failed:\n{traceback.format_exc()}")
            continue
        alt = [(r.logprobs, r.entropy) for r in alt_raw]
        side(name, seconds, peak, max_batch_tokens=max_batch_tokens)
        if padded is not None:
            bench[f"diff_{name}_vs_hf_padded"] = diff_stats(alt, padded)
        if single is not None:
            bench[f"diff_{name}_vs_hf_single"] = diff_stats(alt, single)
        bench[f"diff_{name}_vs_packscore"] = diff_stats(alt, ours)
        log(f"{alternative}: " + str({k: v for k, v in bench.items() if k.startswith(f"diff_{name}_")}))
    if H.DEVICE == "cuda":
        # The ceiling again, last (it heats nothing timed after it), with the GPU as hot as the passes
        # left it: the matmul rate a long forward can hold. The headline divides by the idle GPU's.
        hot = bench["ceiling_hot"] = matmul_sustained()
        held = hot["8192x8192x8192"]["tflops_median"]
        bench["mfu_of_hot_sustained_peak"] = total_flops / bench["sides"]["packscore"]["seconds"] / 1e12 / held
        log(f"{preset}: {bench['mfu_of_hot_sustained_peak']:.3f} of the hot GPU's sustained {held:.0f} TFLOP/s")
    hf_rates = [s["tokens_per_s"] for n, s in bench["sides"].items() if n.startswith("hf_")]
    if hf_rates:
        bench["speedup_vs_hf"] = bench["sides"]["packscore"]["tokens_per_s"] / max(hf_rates)
    bench["mfu_of_measured_peak"] = bench["sides"]["packscore"]["mfu_of_measured_peak"]
    log(f"{preset}: speedup_vs_hf {bench.get('speedup_vs_hf', float('nan')):.2f}, mfu {bench['mfu_of_measured_peak']:.3f}")
    del scorer, twin, loaded
    return bench


def extra_measurements(suite: Suite, bench: dict, scorer, sequences):
    """Profile of one full row, the head's memory at 64k tokens, and idle latency (same model)."""
    from bench.breakdown import format_breakdown, module_times, profile_row
    from model_runtime.model.packing import pack_first_fit_decreasing
    from model_runtime.scoring.head import score_positions
    from model_runtime.types import SequenceInput

    loaded = scorer.loaded
    rows = pack_first_fit_decreasing([s.length for s in sequences], scorer.max_batch_tokens)
    on_gpu = H.DEVICE == "cuda"
    # The CPU dry run only proves the path runs: a row of its shortest sequence, fewer repeats
    # (the reference delta rule and the profiler's event list grow with the row's tokens).
    row = [sequences[i] for i in rows[len(rows) // 2]] if on_gpu else [min(sequences, key=lambda s: s.length)]
    row_tokens = sum(s.length for s in row)

    # Forward and head apart, with events (three repeats each, median).
    from model_runtime.model.packing import PackedBatch
    from model_runtime.scoring.rows import plan_row

    plan = plan_row(row)
    ids = torch.from_numpy(plan.ids_T).to(H.DEVICE)
    fwd_ms, head_ms = [], []
    with torch.inference_mode():
        for _ in range(3 if on_gpu else 1):
            packed = PackedBatch.from_lengths(plan.lengths, device=H.DEVICE)
            forward, head = Stopwatch(), Stopwatch()
            forward.start()
            hidden = loaded.model(ids, packed)
            fwd_ms.append(forward.stop())
            head.start()
            score_positions(hidden, loaded.model.lm_head.weight, torch.from_numpy(plan.targets_N),
                            torch.from_numpy(plan.temperature_N), chunk_tokens=scorer.head_chunk_tokens,
                            rows_N=torch.from_numpy(plan.positions_N), logprob_fn=scorer.logprob_fn)
            head_ms.append(head.stop())
    breakdown = profile_row(lambda: scorer.score_row(row))
    breakdown["modules"] = module_times(loaded.model.layers, lambda: scorer.score_row(row))
    breakdown.update({"row_tokens": row_tokens, "row_sequences": len(row), "scored_positions": int(plan.targets_N.size),
                      "forward_ms_events": float(np.median(fwd_ms)), "head_ms_events": float(np.median(head_ms))})
    bench["profile"] = breakdown
    text = f"profile of one packed row: {row_tokens} tokens, {len(row)} sequences, {plan.targets_N.size} scored\n"
    text += f"forward {np.median(fwd_ms):.1f} ms, head {np.median(head_ms):.1f} ms (CUDA events, median of {len(fwd_ms)})\n"
    text += format_breakdown(breakdown)
    text += "\nper module kind (CUDA events): " + json.dumps(breakdown["modules"])
    suite.texts[f"profile-{bench['preset']}.txt"] = text
    log(text)

    # The head alone at 64k scored positions: extra memory over the hidden states it reads.
    n = 65536 if on_gpu else 512
    D, V = loaded.model.lm_head.weight.shape[1], loaded.vocab_size
    hidden = torch.randn(n + 1, D, device=H.DEVICE, dtype=loaded.dtype)
    targets = torch.randint(0, V, (n,))
    temps = torch.ones(n)
    head = {}
    # As served: log-probs and entropy, then the same with a top-k ranking pass beside them.
    for name, top_k in (("fused", 0), ("fused_top_k_5", 5)):
        with torch.inference_mode():
            run = lambda m: scorer.head(hidden, loaded.model.lm_head.weight, targets[:m], temps[:m],  # noqa: E731
                                        top_k=top_k, rows_N=torch.arange(m))
            run(256)
            sync()
            reset_peak()
            base = allocated()
            t0 = time.perf_counter()
            run(n)
            sync()
            head[name] = {"positions": n, "seconds": time.perf_counter() - t0,
                          "extra_peak_gib": (peak_allocated() - base) / GiB, "chunk_tokens": scorer.head_chunk_tokens,
                          "ranking_rows": scorer.head_chunk_tokens_top_k if top_k else None}
    del hidden
    bench["head_64k"] = head
    log(f"head at {n} positions: {head}")

    # Idle latency: one 512-token sequence, nothing else queued.
    seq = [SequenceInput(np.random.default_rng(1).integers(0, V, 512), score_from=1)]
    for _ in range(3 if on_gpu else 1):
        scorer.score(seq)
    lat = []
    for _ in range(20 if on_gpu else 3):
        sync()
        t0 = time.perf_counter()
        scorer.score(seq)
        lat.append(time.perf_counter() - t0)
    bench["idle_latency_512_ms"] = {"median": 1e3 * float(np.median(lat)), "p90": 1e3 * float(np.quantile(lat, 0.9))}
    log(f"idle latency, one 512-token sequence: {bench['idle_latency_512_ms']}")


# ---------------------------------------------------------------- main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("ab", "full", "profile", "smoke", "extra"), default="ab")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting phases after this many seconds")
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny preset, tiny workload, on the CPU")
    parser.add_argument("--swaps", help="ab mode: the kernel swaps to time, ';'-separated (each 'family=backend', "
                        "several joined by ','), instead of the mode's own")
    parser.add_argument("--hf", choices=("both", "single", "none"), default="both",
                        help="ab mode: the Hugging Face forms to time (single: one sequence at a time only)")
    args = parser.parse_args(argv)
    suite = Suite(args)
    if args.dry_run_cpu:
        return dry_run(suite)

    suite.results["environment"] = suite.phase("environment", environment, 5) or {}
    suite.results["ceiling"] = suite.phase("matmul ceiling", matmul_ceiling, 5) or {}

    if args.mode == "smoke":
        suite.phase("benchmark qwen3.5-9b (32 sequences)", lambda: run_benchmark(
            suite, "qwen3.5-9b", 32, hf_single=True, max_batch_tokens=65536, key="qwen3.5-9b", extras=True), 60)
        suite.results["moe_experts"] = suite.phase("35B-A3B experts grouped_mm vs eager (4 layers)",
                                                   lambda: moe_experts(4, 16384), 30)
        suite.results["gpu_tests"] = suite.phase("GPU tests (smoke)", lambda: run_tests(
            suite, True, select="not long_sequence and not isolation"), 60)
    elif args.mode == "full":
        suite.phase("benchmark qwen3.5-9b", lambda: run_benchmark(
            suite, "qwen3.5-9b", 256, hf_single=True, max_batch_tokens=65536, key="qwen3.5-9b", extras=True,
            alternatives=("attention=varlen", "elementwise=inductor_exact")), 60)
        suite.results["moe_experts"] = suite.phase("35B-A3B experts grouped_mm vs eager (4 layers)",
                                                   lambda: moe_experts(4, 16384), 30)
    elif args.mode == "ab":
        suite.phase("benchmark qwen3.5-9b (kernel swaps)", lambda: run_benchmark(
            suite, "qwen3.5-9b", 256, hf_single=True, max_batch_tokens=65536, key="qwen3.5-9b", extras=False,
            alternatives=tuple(x for x in args.swaps.split(";") if x) if args.swaps is not None
            else ("elementwise=inductor", "conv1d=fla"),
            hf=args.hf), 60)
    elif args.mode == "profile":
        suite.phase("profile qwen3.5-9b (48 sequences, no HF)", lambda: run_benchmark(
            suite, "qwen3.5-9b", 48, hf_single=False, max_batch_tokens=65536, key="qwen3.5-9b", extras=True,
            hf="none"), 60)
    else:
        suite.results["moe_experts"] = suite.phase("35B-A3B experts grouped_mm vs eager", lambda: moe_experts(None, 16384), 60)
        for preset in ("qwen3.5-35b-a3b", "qwen3.5-27b"):
            # the MoE entry carries diff_packscore_vs_hf_single and diff_hf_padded_vs_hf_single as the 9B's does
            suite.phase(f"benchmark {preset}", lambda p=preset: run_benchmark(
                suite, p, 64, hf_single=p == "qwen3.5-35b-a3b", max_batch_tokens=65536, key=p, extras=False), 120)
    finish(suite)


def finish(suite: Suite):
    from bench.report import write_report

    suite.phase("report", lambda: write_report(suite.results, suite.out, suite.json_path.stem), 0)
    suite.save()
    log(f"done in {time.perf_counter() - suite.started:.0f}s; phases: {json.dumps(suite.results['phases'], indent=1)}")


def dry_run(suite: Suite):
    """Every phase that needs no GPU, on the CPU with the tiny presets (reference kernels)."""
    from bench.workload import WorkloadSpec
    from model_runtime.scoring.presets import PRESETS, Preset

    device = H.DEVICE
    H.set_device("cpu")
    suite.args.budget_s = 1e6  # every phase runs, however slow a shared CPU is
    tiny = PRESETS["tiny"]
    PRESETS["tiny-moe"] = Preset("tiny-moe", "qwen3_5_moe_text", {
        **{k: v for k, v in tiny.config.items() if k != "intermediate_size"},
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    }, seed=0, initializer_range=0.05)
    try:
        spec = WorkloadSpec(num_sequences=16, prompt_median=20, prompt_clip=(4, 60), response_median=30, response_clip=(2, 90))
        suite.results["ceiling"] = {"tflops_mean": 1.0}
        suite.phase("benchmark tiny", lambda: run_benchmark(
            suite, "tiny", 16, hf_single=True, max_batch_tokens=300, key="tiny", extras=True, spec=spec,
            alternatives=("attention=sdpa", "gate_projection=row")), 0)
        suite.phase("benchmark tiny, no HF, two swaps at once", lambda: run_benchmark(
            suite, "tiny", 16, hf_single=True, max_batch_tokens=300, key="tiny_no_hf", extras=False, spec=spec,
            alternatives=("attention=sdpa,gate_projection=row",), hf="none"), 0)
        suite.results["moe_experts"] = suite.phase("experts grouped_mm vs eager (tiny)", lambda: moe_experts(None, 200, spec), 0)
        suite.results["gpu_tests"] = suite.phase("GPU tests (all skip on CPU)", lambda: run_tests(
            suite, True, select="not long_sequence and not isolation"), 0)
        finish(suite)
    finally:  # a dry run inside a test process leaves the device and the presets as they were
        H.set_device(device)
        PRESETS.pop("tiny-moe", None)


if __name__ == "__main__":
    main()
