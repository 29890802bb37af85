"""Tables and a chart from the suite's results JSON.

    python -m bench.report bench/results/h200-2026-11-30.json   # prints the markdown table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SIDE_NAMES = {
    "packscore": "packscore (in-process, packed rows)",
    "hf_padded": "HF transformers, padded length-sorted batches",
    "hf_single": "HF transformers, one sequence at a time",
    "packscore_attention_sdpa": "packscore, attention per segment through SDPA",
    "packscore_attention_varlen": "packscore, attention through the varlen kernel",
    "packscore_gate_projection_row": "packscore, GDN gate projections as one product per row",
    "packscore_elementwise_inductor_exact": "packscore, norms' sums by ATen (as HF), the rest fused",
    "packscore_elementwise_eager": "packscore, elementwise steps unfused (as HF)",
    "packscore_elementwise_triton_exact": "packscore, norms in one Triton pass summing in ATen's order",
    "packscore_conv1d_triton": "packscore, conv and SiLU in one Triton kernel",
    "packscore_elementwise_triton_exact_conv1d_triton": "packscore, both Triton kernels above",
}


def benchmarks(results: dict) -> dict:
    return {k: v for k, v in results.items() if isinstance(v, dict) and "sides" in v}


def markdown(results: dict) -> str:
    lines = []
    ceiling = results.get("ceiling", {}).get("tflops_mean")
    for preset, bench in benchmarks(results).items():
        w = bench["workload"]
        lines.append(
            f"**{preset}**, random bf16 weights; workload: {w['sequences']} sequences, {w['tokens']:,} tokens "
            f"({w['scored_tokens']:,} scored), mean length {w['mean_length']:.0f}, longest {w['max_length']:,}; "
            f"{bench['model_tflop']:.0f} TFLOP of model work; measured bf16 matmul peak {bench['ceiling_tflops']:.0f} TFLOP/s."
        )
        lines.append("")
        lines.append("| side | tokens/s | model TFLOP/s | of measured peak | peak memory | max / mean abs diff of log-probs vs HF padded | max / mean abs diff of entropy vs HF padded |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, side in bench["sides"].items():
            if name == "packscore":
                d = bench.get("diff_packscore_vs_hf_padded", {})
            elif name == "hf_single":
                d = bench.get("diff_hf_padded_vs_hf_single", {})
            elif name.startswith("packscore_"):
                d = bench.get(f"diff_{name}_vs_hf_padded", {})
            else:
                d = {}
            diff_lp = f"{d['logprob_max']:.2e} / {d['logprob_mean']:.2e}" if d else "(reference)"
            diff_ent = f"{d['entropy_max']:.2e} / {d['entropy_mean']:.2e}" if d else "(reference)"
            lines.append(
                f"| {SIDE_NAMES.get(name, name)} | {side['tokens_per_s']:,.0f} | {side['model_tflops']:.0f} | "
                f"{100 * side['mfu_of_measured_peak']:.1f}% | {side['peak_memory_gib']:.1f} GiB | {diff_lp} | {diff_ent} |"
            )
        lines.append("")
        if "speedup_vs_hf" in bench:
            lines.append(f"`speedup_vs_hf` = {bench['speedup_vs_hf']:.2f} (against the faster HF form); "
                         f"`mfu_of_measured_peak` = {bench['mfu_of_measured_peak']:.3f}.")
        extra = []
        if "warm_up_s" in bench:
            cached = bench.get("kernel_cache_files_at_start")
            if cached is None:  # not counted (older results, or no cache directory set)
                caches = "with the kernel caches as the run found them"
            elif cached == 0:
                caches = "with empty kernel caches"
            else:
                caches = f"with {cached:,} files in the kernel caches"
            extra.append(f"start-up warm-up {bench['warm_up_s']:.0f} s {caches}")
        if "head_64k" in bench:
            h = bench["head_64k"]["fused"]
            extra.append(f"head alone at {h.get('positions', 65536):,} scored positions: +{h['extra_peak_gib']:.2f} GiB "
                         f"over its input, {h['seconds'] * 1e3:.0f} ms")
        if "idle_latency_512_ms" in bench:
            extra.append(f"idle latency of one 512-token sequence {bench['idle_latency_512_ms']['median']:.0f} ms")
        if extra:
            lines.append("; ".join(extra) + ".")
        lines.append("")
    if ceiling and not benchmarks(results):
        lines.append(f"measured bf16 matmul peak {ceiling:.0f} TFLOP/s")
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = benchmarks(results)
    if not benches:
        return
    profiles = [(p, b["profile"]) for p, b in benches.items() if "profile" in b]
    fig, axes = plt.subplots(1, 1 + len(profiles), figsize=(6 + 6 * len(profiles), 4.5), squeeze=False)
    ax = axes[0][0]
    labels, values, colors = [], [], []
    for preset, bench in benches.items():
        for name, side in bench["sides"].items():
            labels.append(f"{preset}\n{name}")
            values.append(side["tokens_per_s"])
            colors.append("tab:green" if name.startswith("packscore") else "tab:gray")
    bars = ax.bar(range(len(values)), values, color=colors)
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("tokens/s (one H200)")
    ax.set_title("Scoring throughput: log-probs + entropy")
    for k, (preset, prof) in enumerate(profiles, start=1):
        ax = axes[0][k]
        cats = prof["categories_ms"]
        ax.barh(list(cats), list(cats.values()), color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("ms in one packed row")
        ax.set_title(f"{preset}: where a {prof['row_tokens']:,}-token row's {prof['wall_ms']:.0f} ms go", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict, out: Path, stem: str) -> None:
    print(markdown(results), flush=True)  # first: the table survives a chart that cannot be drawn
    chart(results, out / f"{stem}.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.report",
                                     description="Print the markdown table of a suite's results JSON.")
    parser.add_argument("results", type=Path, help="a suite's results JSON, such as bench/results/h200-2026-11-30.json")
    args = parser.parse_args(argv)
    print(markdown(json.loads(args.results.read_text())))


if __name__ == "__main__":
    main()
