"""Shared prefixes on and off: the benchmark's GRPO workload scored both ways, timed and compared.

    python -m bench.prefix_sharing --out DIR                          # H200: 9B preset, bf16, < 4 min
    python -m bench.prefix_sharing --out DIR --preset tiny --device cpu   # a dry run in seconds

Two workloads: the benchmark's RL mix (256 sequences in groups of 8, ``bench.workload``) and a
16-sample one (groups of 16, 1,000-token prompts, 2,000-token responses). For each: one
``Scorer`` with prefix sharing and one without, on the same loaded model and row budget
(``--max-batch-tokens``, and the RL mix again in rows of ``--also-tokens``); after warm-up, one
timed pass of each. ``speedup`` is tokens per second counting every sequence's full length,
shared over unshared; ``logprob_mean_diff`` the mean |log-prob difference| to unshared scoring;
``row_token_bound`` the speedup if time were proportional to the tokens the rows run (prompt
tokens have no head cost, so the real ceiling is lower). Writes
``prefix-sharing.json`` and ``prefix-sharing.md`` to DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.workload import WorkloadSpec, describe, grpo_workload
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.prefix import pack_groups_first_fit, tokens_saved
from model_runtime.scoring.scorer import Scorer

MIN_TOKENS = 64


def workloads(vocab: int, tiny: bool) -> dict[str, list]:
    if tiny:
        mix = WorkloadSpec(
            num_sequences=16, prompt_median=90, prompt_clip=(64, 150), response_median=8, response_clip=(1, 30)
        )
        sixteen = WorkloadSpec(num_sequences=16, group_size=16, prompt_median=70, response_median=8, sigma=0.0)
    else:
        mix = WorkloadSpec()
        sixteen = WorkloadSpec(num_sequences=64, group_size=16, prompt_median=1000, response_median=2000, sigma=0.0)
    return {"rl_mix_groups_of_8": grpo_workload(vocab, mix), "groups_of_16_1k_prompt_2k_response": grpo_workload(vocab, sixteen)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(scorer: Scorer, sequences) -> tuple[list, float]:
    _sync(scorer.loaded.device)
    t0 = time.perf_counter()
    out = scorer.score(sequences)
    _sync(scorer.loaded.device)
    return out, time.perf_counter() - t0


def compare(shared, plain) -> dict:
    d_lp = np.concatenate([np.abs(a.logprobs - b.logprobs) for a, b in zip(shared, plain)])
    d_ent = np.concatenate([np.abs(a.entropy - b.entropy) for a, b in zip(shared, plain)])
    return {
        "logprob_mean_diff": float(d_lp.mean()) if d_lp.size else 0.0,
        "logprob_max_diff": float(d_lp.max()) if d_lp.size else 0.0,
        "entropy_mean_diff": float(d_ent.mean()) if d_ent.size else 0.0,
        "entropy_max_diff": float(d_ent.max()) if d_ent.size else 0.0,
    }


def row_token_bound(sequences, budget: int, min_tokens: int) -> float:
    """Tokens of the workload over the tokens its shared rows run: the speedup if time were
    proportional to tokens run (groups cut by the row budget share only within a row)."""
    rows = pack_groups_first_fit(sequences, budget, min_tokens)
    run = sum(sum(sequences[i].length for i in r) - tokens_saved([sequences[i] for i in r], min_tokens) for r in rows)
    return sum(s.length for s in sequences) / run


def run(preset: str, device: str, max_batch_tokens: int, min_tokens: int, also_tokens: int, budget_s: float) -> dict:
    started = time.perf_counter()
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    loaded = load_model(preset, device=dev, dtype=dtype)
    load_s = time.perf_counter() - started
    t0 = time.perf_counter()
    plain = Scorer(loaded, max_batch_tokens=max_batch_tokens)
    plain.warm_up()
    scorers = {}
    for budget in dict.fromkeys((max_batch_tokens, also_tokens or max_batch_tokens)):
        pair = (Scorer(loaded, max_batch_tokens=budget), Scorer(loaded, max_batch_tokens=budget, prefix_min_tokens=min_tokens))
        for scorer in pair:
            scorer.set_head_budget(plain.head_budget_bytes)
        scorers[budget] = pair
    loads = workloads(loaded.vocab_size, tiny=preset == "tiny")
    # The shared path's own kernel variants (initial and final states, gathered keys): a small row
    # of groups through each scorer before timing.
    first = loads["rl_mix_groups_of_8"][: 4 if preset == "tiny" else 16]
    for pair in scorers.values():
        for scorer in pair:
            scorer.score(first)
    _sync(dev)
    warm_s = time.perf_counter() - t0
    result = {
        "preset": preset,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": dtype,
        "kernels": loaded.backends.names,
        "max_batch_tokens": max_batch_tokens,
        "prefix_min_tokens": min_tokens,
        "load_s": load_s,
        "warm_up_s": warm_s,
        "workloads": {},
    }
    runs = [(name, name, max_batch_tokens) for name in loads]
    if also_tokens and also_tokens != max_batch_tokens:
        runs.append((f"rl_mix_groups_of_8_rows_of_{also_tokens}", "rl_mix_groups_of_8", also_tokens))
    for key, name, budget in runs:
        if result["workloads"] and time.perf_counter() - started > budget_s:
            print(f"{key}: skipped, past --budget-s {budget_s:.0f}", flush=True)
            continue
        sequences = loads[name]
        plain, shared = scorers[budget]
        work = describe(sequences)
        saved = tokens_saved(sequences, min_tokens)  # as if the whole workload were one row
        plain_out, plain_s = timed(plain, sequences)
        shared_out, shared_s = timed(shared, sequences)
        entry = {
            "workload": work,
            "max_batch_tokens": budget,
            "tokens_saved_in_one_row": saved,
            "unique_token_bound": work["tokens"] / (work["tokens"] - saved),
            "row_token_bound": row_token_bound(sequences, budget, min_tokens),
            "unshared_s": plain_s,
            "shared_s": shared_s,
            "unshared_tokens_per_s": work["tokens"] / plain_s,
            "shared_tokens_per_s": work["tokens"] / shared_s,
            "speedup": plain_s / shared_s,
            **compare(shared_out, plain_out),
        }
        result["workloads"][key] = entry
        print(f"{key}: speedup {entry['speedup']:.3f} (token bound {entry['row_token_bound']:.3f} in rows of {budget}), "
              f"mean |dlogp| {entry['logprob_mean_diff']:.2e}", flush=True)
    main_entry = result["workloads"]["rl_mix_groups_of_8"]
    result["speedup"] = main_entry["speedup"]
    result["logprob_mean_diff"] = main_entry["logprob_mean_diff"]
    result["total_s"] = time.perf_counter() - started
    return result


def table(result: dict) -> str:
    lines = [
        f"prefix sharing, {result['preset']} on {result['device']} ({result['dtype']}); token bound: workload tokens over "
        "tokens the shared rows run",
        "",
        "| workload | rows of | tokens | unshared tok/s | shared tok/s | speedup | token bound | mean abs dlogp | max abs dlogp |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, e in result["workloads"].items():
        lines.append(
            f"| {name} | {e['max_batch_tokens']} | {e['workload']['tokens']} | {e['unshared_tokens_per_s']:.0f} | "
            f"{e['shared_tokens_per_s']:.0f} | {e['speedup']:.3f} | {e['row_token_bound']:.3f} | "
            f"{e['logprob_mean_diff']:.2e} | {e['logprob_max_diff']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for prefix-sharing.json and prefix-sharing.md")
    parser.add_argument("--preset", default="qwen3.5-9b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batch-tokens", type=int, default=65536,
                        help="row budget of the main comparison (rows this large keep most groups of 8 whole)")
    parser.add_argument("--also-tokens", type=int, default=16384, help="also the RL mix in rows of this many tokens (0: no)")
    parser.add_argument("--min-tokens", type=int, default=MIN_TOKENS, help="shortest prefix shared")
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no further comparison after this many seconds")
    args = parser.parse_args(argv)
    result = run(args.preset, args.device, args.max_batch_tokens, args.min_tokens, args.also_tokens, args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix-sharing.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (out / "prefix-sharing.md").write_text(text)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
