"""The tables of bench/http_burst.py's results (``http-burst.json`` -> ``http-burst.md``)."""

from __future__ import annotations

from bench.http_burst import IDLE_LENGTH, PER_REQUEST, REQUESTS


def table(result: dict) -> str:
    lines = []
    gpu = result.get("gpu")
    if gpu:
        twice = " (each row size run twice)" if result.get("gpu_repeat") else ""
        lines += [f"One GPU ({gpu.get('device')}, {gpu.get('model')}), default flags, trainer burst of {REQUESTS} x {PER_REQUEST} "
                  f"sequences{twice}:", "",
                  "| rows | in process tokens/s | HTTP tokens/s | ratio | 429s | idle in process | idle HTTP | idle ratio |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for key in ("rows_16384", "rows_65536"):
            for run in (gpu, result.get("gpu_repeat") or {}):  # a run repeated on the GPU, where kept
                r = run.get(key)
                if r:
                    lines.append(f"| {key[5:]} | {r['in_process_tokens_per_s']:,.0f} | {r['http_tokens_per_s']:,.0f} | "
                                 f"**{r['ratio']:.3f}** | {r['http_429']} | {r['idle_in_process_ms']:.1f} ms | "
                                 f"{r['idle_http_ms']:.1f} ms | {r['idle_ratio']:.2f} |")
        lines.append("")
    for key, what in (("simulated_detail", "default flags"),
                      ("simulated_prefix_sharing_detail", "`--prefix-sharing` on both sides, rows costing the tokens they run")):
        sim = result.get(key)
        if not sim:
            continue
        before = any("ratio_before" in v for k, v in sim.items() if k.startswith("gpus_"))
        lines += ([""] if lines and lines[-1] else []) + [f"Simulated H200 pool (cost model {sim['cost_model']}, time scale {sim['time_scale']}), "
                  f"{sim['rows']}-token rows, {what}:", "",
                  "| GPUs | in process tokens/s | HTTP tokens/s | ratio | 429s |" + (" before: ratio | before: 429s |" if before else ""),
                  "| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if before else "")]
        for gpus, r in sim.items():
            if gpus.startswith("gpus_"):
                line = (f"| {gpus[5:]} | {r['in_process_tokens_per_s']:,.0f} | {r['http_tokens_per_s']:,.0f} | "
                        f"**{r['ratio']:.3f}** | {r['http_429']} |")
                if before:
                    line += (f" {r['ratio_before']:.3f} | {r['http_429_before']} |" if "ratio_before" in r else " - | - |")
                lines.append(line)
        one = sim.get("gpus_1", {})
        if "idle_in_process_ms" in one:
            lines += ["", f"Idle latency, one {IDLE_LENGTH}-token sequence (1 simulated GPU): in process "
                      f"{one['idle_in_process_ms']:.1f} ms, HTTP {one['idle_http_ms_after']:.1f} ms "
                      f"({one['idle_http_ms_after'] / one['idle_in_process_ms']:.2f}x)"
                      + (f"; before: HTTP {one['idle_http_ms_before']:.1f} ms" if "idle_http_ms_before" in one else "") + "."]
    # one sequence alone: either simulated run measures the same breakdown (--no-breakdown skips it)
    details = (result.get(k) or {} for k in ("simulated_detail", "simulated_prefix_sharing_detail"))
    cpu = next((d["idle_breakdown_cpu"] for d in details if d.get("idle_breakdown_cpu")), None)
    if cpu:
        lines += ["", f"Idle latency of one {IDLE_LENGTH}-token sequence on this CPU (medians):", "",
                  "| what | ms |", "| --- | ---: |",
                  f"| tiny model, in process (`Scorer.score`) | {cpu['tiny_in_process_ms']:.2f} |",
                  f"| tiny model, over HTTP (msgpack, `AsyncScoreClient`) | {cpu['tiny_http_ms']:.2f} |",
                  f"| ratio | **{cpu['tiny_http_ms'] / cpu['tiny_in_process_ms']:.2f}** |",
                  f"| a forward of no time, over HTTP: the whole HTTP + scheduler overhead | {cpu['zero_forward_http_ms']:.2f} |",
                  f"| of which the scheduler (submit to result, event loop and forward thread) | {cpu['zero_forward_scheduler_ms']:.2f} |",
                  f"| of which encoding and validation, both sides | {cpu['encoding_ms']:.2f} |"]
    return "\n".join(lines)
