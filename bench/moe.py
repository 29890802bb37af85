"""The 35B-A3B MoE on one GPU: packscore's MoE block against Hugging Face's, in numbers and speed.

    python -m bench.moe --out DIR [--sequences 24]     (H200: about 3 minutes; 256 sequences about 8, 2 with --hf none)
    python -m bench.moe --out DIR --dry-run-cpu        (tiny MoE preset on the CPU: every code path, under a minute)

Phases (results JSON rewritten after each, a markdown table printed last and written to DIR), the
benchmark early so that its Hugging Face one-at-a-time pass fits in ``--budget-s``:
1. the measured bf16 matmul ceiling (bench.gpu_probes.matmul_ceiling);
2. ``block_timing``: one sparse-MoE block of the 35B-A3B shape (random bf16 weights) on a 16k- and
   a 64k-token row of the RL mix's lengths: ms per block for packscore with the default kernels,
   the plain composition (``PLAIN``) and each step between them (fused experts, rows scattered,
   the select router, the shared expert on a second stream), and for Hugging Face's block
   (``grouped_mm`` experts, the whole row); how many values each differs from the composition in
   (0: bit for bit); the top CUDA kernels of one default forward on the 64k row (torch.profiler);
3. the suite's benchmark (bench.gpu_suite.run_benchmark) on the first ``--sequences`` of the RL
   mix: packscore, HF padded and HF one at a time, tokens/s, ``mfu_of_measured_peak`` on active
   parameters, ``diff_packscore_vs_hf_single`` and ``diff_hf_padded_vs_hf_single``; then
   packscore again with the plain MoE kernels (``PLAIN``: its speed, its diff to HF one at a time
   and to packscore, which must be 0); its entry is ``qwen3.5-35b-a3b`` as in
   the suite's results, with the suite's extras (``profile``: one row's kernels by category and
   each layer kind's device time; the head at 64k positions; idle latency);
4. ``block_divergence``: the block step by step (router logits, top-k ids and weights, routed
   experts on the same routing, shared expert, shared gate, block output), packscore against
   Hugging Face on each sequence alone, with its experts as ``grouped_mm`` (its default) and
   ``eager``; and Hugging Face's own whole-row call against its per-sequence calls (its batching noise);
5. ``alone_vs_packed``: the packed 35B-A3B model (first 4 layers), each sequence alone against the
   same sequence inside one packed row: must be bit for bit equal on the GPU;
6. ``moe_experts``: one 16k-token row through 4 layers with packscore's block, then Hugging Face's
   block (``grouped_mm`` experts) and its ``eager`` experts: forward time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench import suite_harness as H
from bench.suite_harness import Suite, log

PRESET = "qwen3.5-35b-a3b"
DIVERGENCE_LENGTHS = (1, 7, 100, 513, 2000, 5000)
INVARIANCE_LENGTHS = (1, 5, 64, 300, 1000, 3000)
BLOCK_ROWS = (16384, 65536)  # tokens of the rows the block is timed on
BLOCK_PROFILE_TOP = 10
# The plain reference every other MoE variant must equal bit for bit.
PLAIN = {"moe_experts": "grouped_mm", "moe_router": "topk", "moe_shared": "inline"}


def _block_class(model_type: str):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    if model_type.startswith("qwen3_5_moe"):
        return modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock
    return modeling_qwen3_next.Qwen3NextSparseMoeBlock


def random_block(preset: str, device, dtype=torch.bfloat16, seed: int = 0):
    """One Hugging Face sparse-MoE block of ``preset``'s shape, weights N(0, initializer_range)."""
    from model_runtime.scoring.presets import PRESETS, build_config

    spec = PRESETS[preset]
    config = build_config(spec, num_hidden_layers=1)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    with torch.device(device):
        block = _block_class(spec.model_type)(config)
        for p in block.parameters():
            p.data = (torch.randn_like(p, dtype=torch.float32) * config.initializer_range).to(dtype)
    return block.eval().requires_grad_(False)


def _set_experts(block, implementation: str) -> None:
    config = block.experts.config
    config._experts_implementation = implementation
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = implementation


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()
    return {"max": float(d.max()), "mean": float(d.mean()), "differing_fraction": float((d > 0).float().mean())}


def block_steps(block, ours, x_TD: torch.Tensor, packed) -> tuple[dict, torch.Tensor]:
    """Packscore's block ``ours`` on the packed row ``x_TD`` against Hugging Face's ``block`` on each
    of its segments alone, step by step (router logits, top-k ids and weights, routed experts on
    Hugging Face's routing, shared expert, shared gate, output); returns the differences and
    Hugging Face's per-segment output."""
    import torch.nn.functional as F

    our_logits = ours._narrow(lambda x: F.linear(x, ours.gate.weight), x_TD, packed)
    our_w, our_i = ours.route(x_TD, packed)
    our_gate, our_shared = ours._shared(x_TD, packed)
    our_out = ours(x_TD, packed)
    pieces = {k: [] for k in ("logits", "w", "i", "routed_same_routing", "ours_routed_same_routing", "shared", "gate", "out")}
    for start, end in packed.segment_bounds:
        x = x_TD[start:end]
        logits, w, i = block.gate(x)
        pieces["logits"].append(logits)
        pieces["w"].append(w)
        pieces["i"].append(i)
        pieces["routed_same_routing"].append(block.experts(x, i, w))
        pieces["ours_routed_same_routing"].append(ours.experts_fn(x, i, w, ours.experts.gate_up_proj, ours.experts.down_proj))
        pieces["shared"].append(block.shared_expert(x))
        pieces["gate"].append(torch.sigmoid(block.shared_expert_gate(x)))
        pieces["out"].append(block(x[None])[0])
    hf = {k: torch.cat(v) for k, v in pieces.items()}
    same_ids = (hf["i"] == our_i).all(dim=-1)
    return {
        "router_logits": _diff(our_logits, hf["logits"]),
        "top_k_ids_token_mismatch_fraction": float(1 - same_ids.float().mean()),
        "top_k_weights_where_ids_agree": _diff(our_w[same_ids], hf["w"][same_ids]),
        "routed_experts_same_routing": _diff(hf["ours_routed_same_routing"], hf["routed_same_routing"]),
        "shared_expert": _diff(our_shared, hf["shared"]),
        "shared_gate": _diff(our_gate, hf["gate"]),
        "block_output": _diff(our_out, hf["out"]),
    }, hf["out"]


def block_divergence(preset: str = PRESET, lengths=DIVERGENCE_LENGTHS) -> dict:
    """Step-by-step differences of packscore's block (one packed row) from Hugging Face's (per sequence)."""
    from model_runtime.kernels.registry import select_backends
    from model_runtime.model.moe import PackedSparseMoe
    from model_runtime.model.packing import PackedBatch

    device = torch.device(H.DEVICE)
    dtype = torch.bfloat16
    block = random_block(preset, device, dtype)
    backends = select_backends(device, allow_slow=True)
    ours = PackedSparseMoe(block, backends)
    packed = PackedBatch.from_lengths(list(lengths), device=device)
    g = torch.Generator(device=device).manual_seed(1)
    x_TD = torch.randn(sum(lengths), block.gate.hidden_dim, device=device, generator=g).to(dtype)
    out = {"preset": preset, "lengths": list(lengths), "experts_backend": backends.moe_experts}
    with torch.no_grad():
        for impl in ("grouped_mm", "eager"):
            _set_experts(block, impl)
            out[f"vs_hf_{impl}_single"], hf_out = block_steps(block, ours, x_TD, packed)
            out[f"hf_{impl}_whole_row_vs_single"] = {"block_output": _diff(block(x_TD[None])[0], hf_out)}
        _set_experts(block, "grouped_mm")
    log(f"MoE block divergence: {json.dumps(out)}")
    return out


def _row_lengths(tokens: int, vocab_size: int, spec=None) -> list[int]:
    """Sequence lengths of the RL mix, in order, the last one cut so that they sum to ``tokens``."""
    from bench.workload import WorkloadSpec, grpo_workload

    lengths, total = [], 0
    while total < tokens:
        for s in grpo_workload(vocab_size, spec or WorkloadSpec()):
            n = min(s.length, tokens - total)
            lengths.append(n)
            total += n
            if total == tokens:
                break
    return lengths


def _median_ms(fn, warm: int = 2, repeats: int = 5) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        watch = H.Stopwatch()
        watch.start()
        fn()
        times.append(watch.stop())
    return float(sorted(times)[len(times) // 2])


def top_kernels(fn, top: int = BLOCK_PROFILE_TOP) -> list[dict]:
    """The kernels of one call of ``fn`` by total device time (on the CPU: operators by self CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = H.DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        H.sync()
    rows = []
    events = prof.key_averages()
    # kernels are the device-typed events; should a torch not type them, those with device time only
    kernels = [e for e in events if e.device_type == DeviceType.CUDA] or [
        e for e in events if e.self_device_time_total > 0 and e.self_cpu_time_total == 0]
    for e in kernels if cuda else events:
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "calls": e.count, "total_ms": us / 1e3})
    total = sum(r["total_ms"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["total_ms"])
    for r in rows:
        r["share"] = r["total_ms"] / total
    return rows[:top] + ([{"name": f"(all {len(rows)} kernels)", "calls": sum(r["calls"] for r in rows), "total_ms": total,
                           "share": 1.0}] if rows else [])


def block_timing(preset: str = PRESET, rows=BLOCK_ROWS, spec=None) -> dict:
    """One sparse-MoE block of ``preset``'s shape (random bf16 weights) on a packed row of each size
    in ``rows`` (the RL mix's lengths): ms per block forward for packscore with each grouped experts
    backend and router (the opt-in ones too) and for Hugging Face's block (``grouped_mm`` experts)
    on the whole row; how many values each differs from the composition in (0: bit for bit); and
    the top kernels of one fused forward on the largest row. On the CPU (``--dry-run-cpu``) the CPU
    kernels stand in."""
    from model_runtime.kernels.registry import select_backends
    from model_runtime.model.moe import PackedSparseMoe
    from model_runtime.model.packing import PackedBatch
    from model_runtime.scoring.presets import PRESETS, build_config

    device = torch.device(H.DEVICE)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    block = random_block(preset, device, dtype)
    vocab_size = build_config(PRESETS[preset], num_hidden_layers=1).vocab_size
    # name -> kernel overrides; "composition" is the plain reference the others must equal bit for bit
    variants = {
        "default": {},  # what select_backends gives
        "composition": PLAIN,
        "fused": {**PLAIN, "moe_experts": "grouped_mm_fused"},
        "fused_scatter": {**PLAIN, "moe_experts": "grouped_mm_fused_scatter"},
        "fused_scatter_select": {**PLAIN, "moe_experts": "grouped_mm_fused_scatter", "moe_router": "select"},
        "fused_scatter_select_stream": {"moe_experts": "grouped_mm_fused_scatter", "moe_router": "select",
                                        "moe_shared": "stream"},
    } if cuda else {"default": {}, "composition": {}}
    from model_runtime.kernels import expert_gemm

    if cuda and expert_gemm.unavailable_reason() is None:  # packscore's CUTLASS products, without and with the SiLU epilogue
        variants["tiles"] = {"moe_experts": "expert_tiles", "moe_router": "select", "moe_shared": "inline"}
        variants["tiles_silu"] = {"moe_experts": "expert_tiles_silu", "moe_router": "select", "moe_shared": "inline"}
    chosen = {key: select_backends(device, allow_slow=True, overrides=o) for key, o in variants.items()}
    # a variant that is what the defaults select already (tiles_silu where its library loads) is not timed twice
    chosen = {key: b for key, b in chosen.items()
              if key in ("default", "composition") or b.names != chosen["default"].names}
    ours = {key: PackedSparseMoe(block, b) for key, b in chosen.items()}
    out = {"preset": preset, "dtype": str(dtype), "rows": {},
           "backends": {k: ",".join(f"{f}={getattr(b, f)}" for f in PLAIN) for k, b in chosen.items()}}
    g = torch.Generator(device=device).manual_seed(2)
    with torch.inference_mode():
        for tokens in rows:
            lengths = _row_lengths(tokens, vocab_size, spec)
            packed = PackedBatch.from_lengths(lengths, device=device)
            x_TD = torch.randn(tokens, block.gate.hidden_dim, device=device, generator=g).to(dtype)
            entry = {"sequences": len(lengths)}
            plain_out = ours["composition"](x_TD, packed)
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            for key in ours:
                if key != "composition":
                    got = ours[key](x_TD, packed)
                    entry[f"{key}_vs_composition_differing"] = int((got.view(bits) != plain_out.view(bits)).sum())
                    entry[f"{key}_vs_composition_max_abs_diff"] = float((got.float() - plain_out.float()).abs().max())
                    del got
            entry["default_vs_composition_bitwise_equal"] = entry["default_vs_composition_differing"] == 0
            del plain_out
            for key in ours:
                entry[f"packscore_{key}_ms"] = _median_ms(lambda key=key: ours[key](x_TD, packed))
            _set_experts(block, "grouped_mm")
            entry["hf_grouped_mm_ms"] = _median_ms(lambda: block(x_TD[None]))
            entry["default_speedup_over_composition"] = entry["packscore_composition_ms"] / entry["packscore_default_ms"]
            entry["default_speedup_over_hf"] = entry["hf_grouped_mm_ms"] / entry["packscore_default_ms"]
            out["rows"][str(tokens)] = entry
            log(f"MoE block, {tokens} tokens: {entry}")
            if tokens == max(rows):
                out["profile_tokens"] = tokens
                out["profile_default"] = top_kernels(lambda: ours["default"](x_TD, packed))
            del x_TD
    log(f"MoE block timing: {json.dumps(out)}")
    return out


def alone_vs_packed(preset: str = PRESET, num_layers: int = 4, lengths=INVARIANCE_LENGTHS, experts: str | None = None) -> dict:
    """Each sequence alone against the same sequence in one packed row, through the packed model
    (``experts``: a ``moe_experts`` backend instead of the default)."""
    import numpy as np

    from bench.hf_reference import build_twin
    from model_runtime.scoring.scorer import Scorer
    from model_runtime.types import SequenceInput

    dtype = torch.bfloat16 if H.DEVICE == "cuda" else torch.float32
    twin = build_twin(preset, num_layers=num_layers, device=H.DEVICE, dtype=dtype,
                      kernel_overrides={"moe_experts": experts} if experts else None)
    scorer = Scorer(twin.loaded)
    rng = np.random.default_rng(0)
    seqs = [SequenceInput(rng.integers(0, twin.loaded.vocab_size, n), score_from=1) for n in lengths]
    row = scorer.score_row(seqs)
    worst = {}
    for seq, in_row in zip(seqs, row):
        alone = scorer.score_row([seq])[0]
        worst[str(seq.length)] = max(float(np.abs(alone.logprobs - in_row.logprobs).max(initial=0.0)),
                                     float(np.abs(alone.entropy - in_row.entropy).max(initial=0.0)))
    out = {"preset": f"{preset}[:{num_layers}]", "dtype": str(dtype), "kernels": twin.loaded.backends.names,
           "max_abs_diff_by_length": worst, "bitwise_equal": all(v == 0.0 for v in worst.values())}
    log(f"alone vs packed: {out}")
    del scorer, twin
    return out


def _table(title: str, columns) -> list[str]:
    """A blank line, ``title`` and a markdown table's header: the first column left-aligned, the
    others (numbers) right-aligned."""
    columns = tuple(columns)
    return ["", title, "| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]


def markdown(results: dict, key: str) -> str:
    lines = ["| | tokens/s | of measured peak (active params) | mean / max abs diff of log-probs to HF one at a time |",
             "| --- | ---: | ---: | ---: |"]
    bench = results.get(key) or {}
    sides = bench.get("sides", {})
    for name, side in sides.items():
        d = bench.get(f"diff_{name}_vs_hf_single")
        diff = f"{d['logprob_mean']:.3g} / {d['logprob_max']:.3g}" if d else ("reference" if name == "hf_single" else "")
        lines.append(f"| {name} | {side['tokens_per_s']:,.0f} | {side['mfu_of_measured_peak']:.3f} | {diff} |")
    if isinstance(bench.get("hf_single"), str):
        lines.append(f"\nHF one at a time {bench['hf_single']}")
    for name in sides:
        d = bench.get(f"diff_{name}_vs_packscore")
        if d:
            lines.append(f"\n{name} vs packscore, log-probs mean / max abs diff: {d['logprob_mean']:.3g} / {d['logprob_max']:.3g}")
    modules = (bench.get("profile") or {}).get("modules")
    if modules:
        lines += _table(f"One row of {bench['profile']['row_tokens']:,} tokens, {modules['wall_ms']:.0f} ms: device time by "
                        "module kind", ("module", "count", "ms", "ms each", "share"))
        for kind, m in modules.items():
            if isinstance(m, dict):
                lines.append(f"| {kind} | {m['count']} | {m['ms']:.1f} | {m['ms_each']:.2f} | {m['ms'] / modules['wall_ms']:.3f} |")
        lines.append(f"| other (norms, adds, embedding, head) | | {modules['other_ms']:.1f} | | "
                     f"{modules['other_ms'] / modules['wall_ms']:.3f} |")
    timing = results.get("block_timing") or {}
    if timing.get("rows"):
        keys = [k[len("packscore_"):-len("_ms")] for k in next(iter(timing["rows"].values())) if k.startswith("packscore_")]
        others = [k for k in keys if k != "composition"]
        lines += _table(f"One MoE block ({timing['preset']}, {timing['dtype']}), ms per forward; kernels: "
                        + "; ".join(f"{k} = {v}" for k, v in timing["backends"].items()) + ":",
                        ("row tokens", *(f"{k} ms" for k in keys), "HF grouped_mm (whole row) ms",
                         *(f"{k}: values differing from composition" for k in others)))
        for tokens, e in timing["rows"].items():
            lines.append(f"| {int(tokens):,} | " + " | ".join(f"{e[f'packscore_{k}_ms']:.2f}" for k in keys)
                         + f" | {e['hf_grouped_mm_ms']:.2f} | "
                         + " | ".join(str(e.get(f"{k}_vs_composition_differing", "")) for k in others) + " |")
    if timing.get("profile_default"):
        lines += _table(f"Top kernels of one block forward with the default kernels ({timing['profile_tokens']:,} tokens):",
                        ("kernel", "calls", "total ms", "share"))
        for r in timing["profile_default"]:
            lines.append(f"| {r['name'][:110]} | {r['calls']} | {r['total_ms']:.3f} | {r['share']:.3f} |")
    probe = results.get("moe_experts") or {}
    if "packscore" in probe:
        lines.append("")
        lines.append("4-layer forward of one row, tokens/s: " + ", ".join(
            f"{name} {probe[name]['tokens_per_s']:,.0f}" for name in ("packscore", "grouped_mm", "eager") if name in probe)
            + " (grouped_mm, eager: Hugging Face's block)")
    inv = results.get("alone_vs_packed")
    if inv:  # not run with --hf none, or cut by the time budget
        lines.append("")
        lines.append(f"alone vs packed ({inv.get('preset')}, {inv.get('dtype')}): bitwise equal = {inv.get('bitwise_equal')}, "
                     f"max |diff| by length {inv.get('max_abs_diff_by_length')}")
    div = results.get("block_divergence") or {}
    for impl in ("grouped_mm", "eager"):
        steps = div.get(f"vs_hf_{impl}_single")
        if steps:
            lines += _table(f"MoE block, packscore (one row) vs HF {impl} (each sequence alone):",
                            ("step", "max", "mean", "differing fraction"))
            for step, d in steps.items():
                if isinstance(d, dict):
                    lines.append(f"| {step} | {d['max']:.3g} | {d['mean']:.3g} | {d['differing_fraction']:.3g} |")
                else:
                    lines.append(f"| {step} | | | {d:.3g} |")
            whole = div.get(f"hf_{impl}_whole_row_vs_single", {}).get("block_output")
            if whole:
                lines.append(f"| HF {impl} whole row vs alone (its batching noise) | {whole['max']:.3g} | {whole['mean']:.3g} | "
                             f"{whole['differing_fraction']:.3g} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--sequences", type=int, default=24, help="the first N sequences of the RL mix (24 to 256, the whole workload)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting phases after this many seconds")
    parser.add_argument("--hf", choices=("single", "none"), default="single",
                        help="none: packscore's own sides of the benchmark only, without the block timing, "
                             "the plain kernels and the probes after it")
    parser.add_argument("--also", action="append", default=[], metavar="KERNELS",
                        help="time the benchmark again with these --kernels overrides, beside the defaults "
                             "(e.g. moe_experts=grouped_mm_fused_scatter); repeatable")
    parser.add_argument("--max-batch-tokens", type=int, default=65536,
                        help="the rows' token budget (the suite's standard 65,536; the server's own default differs)")
    parser.add_argument("--block", action="store_true",
                        help="time the MoE block's backends (about 30 s) with --hf none too")
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny MoE preset, tiny workload, on the CPU")
    args = parser.parse_args(argv)
    args.mode = "moe"
    suite = Suite(args)
    from bench.gpu_probes import matmul_ceiling, moe_experts
    from bench.gpu_suite import run_benchmark

    preset, spec, key = PRESET, None, PRESET
    device = H.DEVICE
    if args.dry_run_cpu:
        from bench.workload import WorkloadSpec
        from model_runtime.scoring.presets import PRESETS, Preset

        H.set_device("cpu")
        tiny = PRESETS["tiny"]
        PRESETS["tiny-moe"] = Preset("tiny-moe", "qwen3_5_moe_text", {
            **{k: v for k, v in tiny.config.items() if k != "intermediate_size"},
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        }, seed=0, initializer_range=0.05)
        preset = "tiny-moe"
        spec = WorkloadSpec(num_sequences=16, prompt_median=20, prompt_clip=(4, 60), response_median=30, response_clip=(2, 90))
        suite.results["ceiling"] = {"tflops_mean": 1.0}
        key = preset
    else:
        suite.results["ceiling"] = suite.phase("matmul ceiling", matmul_ceiling, 5) or {}

    # the whole-model benchmark also runs with the plain MoE kernels: its speed, and equal bit for bit
    plain = ",".join(f"{f}={b}" for f, b in PLAIN.items()) if H.DEVICE == "cuda" else "default"
    try:
        # The block timing and the benchmark first: the benchmark's Hugging Face one-at-a-time pass
        # is skipped when less than its time is left, and it carries the numbers.
        full = args.hf != "none"
        if full or args.block:
            suite.results["block_timing"] = suite.phase(
                "MoE block: packscore fused vs composition vs Hugging Face, ms per block", lambda: block_timing(
                    preset, (200, 500) if args.dry_run_cpu else BLOCK_ROWS, spec), 30)
        suite.phase(f"benchmark {preset} ({args.sequences} sequences)", lambda: run_benchmark(
            suite, preset, args.sequences, hf_single=full, max_batch_tokens=args.max_batch_tokens if not args.dry_run_cpu else 300,
            key=key, extras=full, spec=spec, alternatives=((plain,) if full else ()) + tuple(args.also),
            hf="both" if full else "none"), 60)
        if full:
            suite.results["alone_vs_packed"] = suite.phase(
                "alone vs packed (4 layers)", lambda: alone_vs_packed(preset), 30)
            suite.results["block_divergence"] = suite.phase(
                "MoE block vs Hugging Face, step by step", lambda: block_divergence(preset), 20)
            suite.results["moe_experts"] = suite.phase(
                "MoE block: packscore vs Hugging Face grouped_mm and eager (4 layers)",
                lambda: moe_experts(None if args.dry_run_cpu else 4, 200 if args.dry_run_cpu else 16384, spec), 30)
    finally:
        H.set_device(device)
        if args.dry_run_cpu:
            PRESETS.pop("tiny-moe", None)
    table = markdown(suite.results, key)
    suite.texts["moe.md"] = table + "\n"
    suite.save()
    log(f"done in {time.perf_counter() - suite.started:.0f}s")
    print(table, flush=True)


if __name__ == "__main__":
    main()
