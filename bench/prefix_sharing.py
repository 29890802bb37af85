"""Shared prefixes on and off: the benchmark's GRPO workload scored both ways, timed and compared.

    python -m bench.prefix_sharing --out DIR                          # H200: 9B preset, bf16, < 6 min
    python -m bench.prefix_sharing --out DIR --flops-only             # the token and FLOP bounds (CPU, seconds)
    python -m bench.prefix_sharing --out DIR --preset tiny --device cpu   # a dry run in seconds
    python -m bench.prefix_sharing --out DIR --profile-row            # where one shared row's time goes
    python -m bench.prefix_sharing --out DIR --kernels gate_projection=tiles --hf-sequences 24
                                     # every member shares bit for bit; each side's distance to Hugging Face
    python -m bench.prefix_sharing --out DIR --kernels gate_projection=tiles --passes 1 --also-tokens 0 \
        --workloads rl_mix_groups_of_8 --seeds 1,2,3   # the RL mix drawn with other seeds too (rl_mix_over_seeds)

Three workloads: the benchmark's RL mix (256 sequences in groups of 8, ``bench.workload``), a
16-sample one (groups of 16, 1,000-token prompts, 2,000-token responses) and a prompt-heavy one
(64 sequences in groups of 8, prompts of about 8,000 tokens, responses of about 1,000). For each: one
``Scorer`` with prefix sharing and one without, on the same loaded model and row budget
(``--max-batch-tokens``, and the RL mix again in rows of ``--also-tokens``); after warm-up, the
passes unshared, shared, unshared, shared, timing the second of each (a first pass over new row
shapes is slower; its times stay in the JSON as ``first_pass_*``). ``speedup`` is tokens per
second counting every sequence's full length, shared over unshared; ``logprob_mean_diff`` the
mean |log-prob difference| to unshared scoring; ``row_token_bound`` the speedup if time were
proportional to the tokens the rows run; ``flop_bound`` the same with bench/flops.py's model
FLOPs (the head and attention's quadratic term are not saved by sharing, so it is the lower
ceiling). ``--flops-only`` prints the bounds from the preset's shape without running it. Writes
``prefix-sharing.json`` and ``prefix-sharing.md`` to DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.flops import FlopModel, flop_model
from bench.workload import WorkloadSpec, describe, grpo_workload
from model_runtime.kernels.overrides import parse_kernel_overrides
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.prefix import find_groups, pack_groups_first_fit, tokens_saved
from model_runtime.scoring.rounding import RowRounding
from model_runtime.scoring.scorer import Scorer

MIN_TOKENS = 64


def workloads(vocab: int, tiny: bool, seeds: tuple[int, ...] = ()) -> dict[str, list]:
    """The three workloads, then the RL mix drawn again with each of ``seeds``
    (``rl_mix_groups_of_8_seed_K``): its 32 prompt lengths are a small sample, so the share of
    repeated prompt tokens moves from draw to draw (seed 0, the benchmark's, is a low one)."""
    if tiny:
        mix = WorkloadSpec(
            num_sequences=16, prompt_median=90, prompt_clip=(64, 150), response_median=8, response_clip=(1, 30)
        )
        sixteen = WorkloadSpec(num_sequences=16, group_size=16, prompt_median=70, response_median=8, sigma=0.0)
        long_prompts = WorkloadSpec(num_sequences=8, prompt_median=256, prompt_clip=(64, 512), response_median=30, sigma=0.25)
    else:
        mix = WorkloadSpec()
        sixteen = WorkloadSpec(num_sequences=64, group_size=16, prompt_median=1000, response_median=2000, sigma=0.0)
        # docs/prefix-sharing.md's prompt-heavy case: 8k-token prompts, 8 responses of about 1k each
        long_prompts = WorkloadSpec(num_sequences=64, prompt_median=8000, prompt_clip=(64, 16384), response_median=1000,
                                    sigma=0.25)
    loads = {"rl_mix_groups_of_8": grpo_workload(vocab, mix), "groups_of_16_1k_prompt_2k_response": grpo_workload(vocab, sixteen),
             "groups_of_8_8k_prompt_1k_response": grpo_workload(vocab, long_prompts)}
    for seed in seeds:
        if seed != mix.seed:
            loads[f"rl_mix_groups_of_8_seed_{seed}"] = grpo_workload(vocab, replace(mix, seed=seed))
    return loads


def seed_of(name: str) -> int | None:
    """The RL mix's seed behind a workload's name (0 for the benchmark's own), else None."""
    if name == "rl_mix_groups_of_8":
        return WorkloadSpec().seed
    prefix = "rl_mix_groups_of_8_seed_"
    return int(name.removeprefix(prefix)) if name.startswith(prefix) else None


def is_other_draw(name: str) -> bool:
    """One of the RL mix's draws asked for by ``--seeds`` (not the benchmark's own)."""
    return seed_of(name) not in (None, WorkloadSpec().seed)


def over_seeds(result_workloads: dict) -> dict | None:
    """The RL mix's draws side by side, every member sharing (``speedup``) and as served, with their means."""
    rows = {seed_of(k): e for k, e in result_workloads.items() if seed_of(k) is not None}
    if len(rows) < 2:
        return None
    seeds = sorted(rows)
    pick = {"repeated_prompt_fraction": lambda e: e["workload"]["repeated_prompt_fraction"],
            "speedup": lambda e: e["by_prompt"]["speedup"], "flop_bound": lambda e: e["by_prompt"]["flop_bound"],
            "as_served_speedup": lambda e: e["speedup"], "as_served_flop_bound": lambda e: e["flop_bound"],
            "row_token_bound": lambda e: e["by_prompt"]["row_token_bound"],
            "logprob_mean_diff": lambda e: e["by_prompt"]["logprob_mean_diff"]}
    out = {"seeds": seeds, **{key: [f(rows[s]) for s in seeds] for key, f in pick.items()}}
    for key in ("repeated_prompt_fraction", "speedup", "flop_bound", "as_served_speedup"):
        out[f"mean_{key}"] = float(np.mean(out[key]))
        out[f"median_{key}"] = float(np.median(out[key]))
    out["mean_of_flop_bound"] = float(np.mean(np.array(out["speedup"]) / np.array(out["flop_bound"])))
    return out


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


def row_token_bound(sequences, budget: int, min_tokens: int, rounding=None) -> float:
    """Tokens of the workload over the tokens its shared rows run: the speedup if time were
    proportional to tokens run (groups cut by the row budget share only within a row)."""
    rows = pack_groups_first_fit(sequences, budget, min_tokens, rounding)
    run = sum(sum(sequences[i].length for i in r) - tokens_saved([sequences[i] for i in r], min_tokens, rounding)
              for r in rows)
    return sum(s.length for s in sequences) / run


def shared_flops(sequences, saved_tokens: int, flops: FlopModel, saved_query_pairs: float = 0.0) -> float:
    """Model FLOPs of scoring ``sequences`` with ``saved_tokens`` of their prompts run once:
    sharing saves the body's matmuls on the tokens not run; attention's quadratic term is the
    same (a continuation attends over its whole prefix) but for ``saved_query_pairs``, the
    causal (query, key) pairs of prompt queries not run again (an attention backend that runs each
    query once, ``varlen``), and so, counted as unshared, is the head (prompt positions are rarely
    scored)."""
    attention = flops.attention_layers * 4.0 * flops.attention_width * saved_query_pairs
    return flops.workload_flops(sequences) - 2.0 * flops.matmul_params_per_token * saved_tokens - attention


def flop_bound(sequences, budget: int, min_tokens: int, flops: FlopModel, rounding=None,
               prompt_queries_once: bool = False) -> float:
    """Model FLOPs of the workload unshared over shared (``shared_flops``), in rows of ``budget``;
    ``prompt_queries_once``: attention does not run a shared prompt's queries again."""
    rows = pack_groups_first_fit(sequences, budget, min_tokens, rounding)
    saved = pairs = 0
    for r in rows:
        for group in find_groups([sequences[i] for i in r], min_tokens, rounding):
            saved += group.tokens_saved
            # sequence_flops counts L (L + 1) / 2 causal pairs per sequence, as here per prompt
            pairs += (len(group.members) - 1) * group.shared * (group.shared + 1) / 2 if prompt_queries_once else 0
    return flops.workload_flops(sequences) / shared_flops(sequences, saved, flops, pairs)


def preset_flop_model(preset: str) -> FlopModel:
    """bench/flops.py's model of ``preset``, built on the meta device (no weights)."""
    from transformers import AutoModelForCausalLM

    from model_runtime.scoring.loading import _hf_kwargs
    from model_runtime.scoring.presets import PRESETS, build_config

    spec = PRESETS[preset]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(spec), **_hf_kwargs(spec.model_type, None))
    return flop_model(model.model.layers, model.config)


def flops_only(preset: str, budgets, min_tokens: int, seeds: tuple[int, ...] = ()) -> dict:
    """The token and FLOP bounds of every workload, from the preset's shape alone (CPU, seconds)."""
    from model_runtime.scoring.presets import PRESETS, build_config

    flops = preset_flop_model(preset)
    loads = workloads(build_config(PRESETS[preset]).vocab_size, tiny=preset == "tiny", seeds=seeds)
    out = {}
    for name, sequences in loads.items():
        for budget in budgets if name == "rl_mix_groups_of_8" else budgets[:1]:
            out[f"{name} rows of {budget}"] = {
                "repeated_prompt_fraction": describe(sequences)["repeated_prompt_fraction"],
                "row_token_bound": row_token_bound(sequences, budget, min_tokens),
                "flop_bound": flop_bound(sequences, budget, min_tokens, flops),
                "flop_bound_prompt_queries_once": flop_bound(sequences, budget, min_tokens, flops, prompt_queries_once=True),
            }
    return out


def run(preset: str, device: str, max_batch_tokens: int, min_tokens: int, also_tokens: int, budget_s: float,
        profile: bool = False, only: tuple[str, ...] = (), passes: int = 2, kernels: dict[str, str] | None = None,
        hf_sequences: int = 0, seeds: tuple[int, ...] = ()) -> dict:
    started = time.perf_counter()
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    twin = None
    if hf_sequences:  # a Hugging Face model on the same weights, for the distance to its forward
        from bench.hf_reference import build_twin

        twin = build_twin(preset, device=dev, dtype=getattr(torch, dtype), kernel_overrides=kernels)
        loaded = twin.loaded
    else:
        loaded = load_model(preset, device=dev, dtype=dtype, kernel_overrides=kernels)
    flops = flop_model(loaded.model.layers, loaded.model.config)
    load_s = time.perf_counter() - started
    t0 = time.perf_counter()
    plain = Scorer(loaded, max_batch_tokens=max_batch_tokens)
    plain.warm_up()
    scorers = {}
    for budget in dict.fromkeys((max_batch_tokens, also_tokens or max_batch_tokens)):
        # unshared; shared as served (only among members whose lengths round the prompt alike);
        # shared among every member of a group (the rounding not followed)
        trio = (Scorer(loaded, max_batch_tokens=budget), Scorer(loaded, max_batch_tokens=budget, prefix_min_tokens=min_tokens),
                Scorer(loaded, max_batch_tokens=budget, prefix_min_tokens=min_tokens))
        for scorer in trio:
            scorer.set_head_budget(plain.head_budget_bytes)
        t_round = time.perf_counter()
        trio[1].measure_prefix_rounding()
        result_rounding_s = time.perf_counter() - t_round
        trio[2].prefix_rounding = RowRounding.exact(budget)  # every member of a group alike
        scorers[budget] = trio
    loads = workloads(loaded.vocab_size, tiny=preset == "tiny", seeds=seeds)
    queries_once = loaded.backends.names["attention"] == "varlen"  # a shared prompt's queries run once (LinkedLayout.on_own_queries)
    unknown = sorted(set(only) - set(loads))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known: {', '.join(loads)}")
    timed_loads = [name for name in loads if not only or name in only or is_other_draw(name)]  # --seeds: timed too
    # The shared path's own kernel variants (initial and final states, gathered keys): a small row
    # of groups through each scorer before timing.
    first = loads["rl_mix_groups_of_8"][: 4 if preset == "tiny" else 16]
    for trio in scorers.values():
        for scorer in trio:
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
        "rounding_measure_s": result_rounding_s,
        "timed_pass": "second" if passes == 2 else "only",
        # the narrow products' kinds of row count (model_runtime/scoring/rounding.py) the rows follow
        "rounding_kinds": {budget: {"kinds": trio[1].prefix_rounding.kind_count, "ranges": len(trio[1].prefix_rounding.runs),
                                    "max_rows": trio[1].prefix_rounding.max_rows}
                           for budget, trio in scorers.items() if trio[1].prefix_rounding is not None},
        "workloads": {},
    }
    if profile:
        result["row_profile"] = profile_row_three_ways(loaded, scorers[max_batch_tokens], loads["rl_mix_groups_of_8"],
                                                       max_batch_tokens, min_tokens, flops)
        result["total_s"] = time.perf_counter() - started
        return result
    # The RL mix in the main rows and the 16-sample workload always run; the RL mix in smaller rows
    # only if its passes (no longer than the main rows' ones) still fit in --budget-s.
    runs = [(name, name, max_batch_tokens) for name in timed_loads]
    if also_tokens and also_tokens != max_batch_tokens and "rl_mix_groups_of_8" in timed_loads:
        runs.append((f"rl_mix_groups_of_8_rows_of_{also_tokens}", "rl_mix_groups_of_8", also_tokens))
    for i, (key, name, budget) in enumerate(runs):
        elapsed, main_passes = time.perf_counter() - started, result.get("rl_mix_passes_s", 0.0)
        # the optional runs (smaller rows, the RL mix's other draws) only while one more fits --budget-s
        optional = i >= len(timed_loads) or (i > 0 and is_other_draw(key))
        if optional and elapsed + main_passes > budget_s:
            print(f"{key}: skipped, {elapsed:.0f} s + {main_passes:.0f} s past --budget-s {budget_s:.0f}", flush=True)
            continue
        pass_started = time.perf_counter()
        sequences = loads[name]
        plain, shared, by_prompt = scorers[budget]
        rounding = shared.prefix_rounding
        # As served shares among every member where the narrow products round alike at every length
        # (one kind, e.g. --kernels gate_projection=tiles): the same rows, so timed once.
        one_kind = rounding is not None and rounding.kind_count == 1 and max(s.length for s in sequences) <= rounding.max_rows
        work = describe(sequences)
        saved = tokens_saved(sequences, min_tokens, rounding)  # as if the whole workload were one row
        if passes == 2:
            first_plain_out, first_plain_s = timed(plain, sequences)
            first_shared_out, first_shared_s = timed(shared, sequences)
            if not one_kind:
                timed(by_prompt, sequences)
        plain_out, plain_s = timed(plain, sequences)
        shared_out, shared_s = timed(shared, sequences)
        prompt_out, prompt_s = (shared_out, shared_s) if one_kind else timed(by_prompt, sequences)
        entry = {
            "workload": work,
            "max_batch_tokens": budget,
            "tokens_saved_in_one_row": saved,
            "unique_token_bound": work["tokens"] / (work["tokens"] - saved),
            "row_token_bound": row_token_bound(sequences, budget, min_tokens, rounding),
            "flop_bound": flop_bound(sequences, budget, min_tokens, flops, rounding, queries_once),
            "unshared_s": plain_s,
            "shared_s": shared_s,
            "unshared_tokens_per_s": work["tokens"] / plain_s,
            "shared_tokens_per_s": work["tokens"] / shared_s,
            "speedup": plain_s / shared_s,
            **compare(shared_out, plain_out),
            # every member of a group sharing its prompt, whatever its length's rounding
            "by_prompt": {
                "row_token_bound": row_token_bound(sequences, budget, min_tokens),
                "flop_bound": flop_bound(sequences, budget, min_tokens, flops, prompt_queries_once=queries_once),
                "shared_s": prompt_s,
                "speedup": plain_s / prompt_s,
                **compare(prompt_out, plain_out),
                "same_rows_as_served": one_kind,
            },
        }
        if passes == 2:
            entry.update({
                "first_pass_unshared_s": first_plain_s,
                "first_pass_shared_s": first_shared_s,
                "first_pass_speedup": first_plain_s / first_shared_s,
                # Each side's passes agree with each other (deterministic kernels), first to second.
                "first_pass_logprob_max_diff": compare(first_shared_out, first_plain_out)["logprob_max_diff"],
            })
        result["workloads"][key] = entry
        if seed_of(key) is not None:  # the longest of the RL mix's draws so far
            result["rl_mix_passes_s"] = max(result.get("rl_mix_passes_s", 0.0), time.perf_counter() - pass_started)
        first = f"first pass {entry['first_pass_speedup']:.3f}; " if passes == 2 else ""
        print(f"{key}: speedup {entry['speedup']:.3f} ({first}token bound {entry['row_token_bound']:.3f}, FLOP bound {entry['flop_bound']:.3f} in rows of {budget}), "
              f"mean |dlogp| {entry['logprob_mean_diff']:.2e}; every member: speedup {entry['by_prompt']['speedup']:.3f}, "
              f"mean |dlogp| {entry['by_prompt']['logprob_mean_diff']:.2e}", flush=True)
    if twin is not None:
        result["hugging_face"] = hf_distances(twin, scorers[max_batch_tokens], loads["rl_mix_groups_of_8"][:hf_sequences])
        print("Hugging Face: " + json.dumps(result["hugging_face"]), flush=True)
    seeds_summary = over_seeds(result["workloads"])
    if seeds_summary:
        result["rl_mix_over_seeds"] = seeds_summary
    main_entry = result["workloads"].get("rl_mix_groups_of_8") or result["workloads"][timed_loads[0]]
    result["speedup"] = main_entry["speedup"]
    result["logprob_mean_diff"] = main_entry["logprob_mean_diff"]
    result["total_s"] = time.perf_counter() - started
    return result


def hf_distances(twin, trio, sequences) -> dict:
    """Mean and max |difference| of log-probs and entropies to Hugging Face one sequence at a time
    (the issue's yardstick): packscore unshared, shared as served and every member, and Hugging
    Face's own padded batches, on ``sequences`` (whole groups of the RL mix)."""
    from bench.hf_reference import diff_stats, score_padded_fitting, score_single, to_numpy

    dev = twin.loaded.device
    with torch.inference_mode(), twin.hf() as hf_model:
        single = to_numpy(score_single(hf_model, sequences, dev))
        padded, padded_budget = score_padded_fitting(hf_model, sequences, dev)
        padded = to_numpy(padded)
    out = {"sequences": len(sequences), "tokens": sum(s.length for s in sequences), "padded_budget": padded_budget,
           "diff_hf_padded_vs_hf_single": diff_stats(padded, single)}
    for name, scorer in zip(("unshared", "as_served", "every_member"), trio):
        ours = [(r.logprobs, r.entropy) for r in scorer.score(sequences)]
        out[f"diff_{name}_vs_hf_single"] = diff_stats(ours, single)
    return out


def one_row_of_groups(sequences, budget: int, group_size: int = 8) -> list:
    """Whole groups of the workload, in order, each taken if it still fits one unshared row of
    ``budget`` tokens (first fit, so one long group does not end the row)."""
    taken, tokens = [], 0
    for start in range(0, len(sequences), group_size):
        group = sequences[start:start + group_size]
        length = sum(s.length for s in group)
        if tokens + length <= budget:
            taken += group
            tokens += length
    return taken


def profile_row_three_ways(loaded, trio, sequences, budget: int, min_tokens: int, flops: FlopModel) -> dict:
    """One row of whole groups scored unshared, shared as served and shared among every member:
    device time per module kind (``bench.breakdown.module_times``) and, on a GPU, the row's
    kernels by category (``profile_row``), beside the tokens and model FLOPs each side runs, so that a
    shared row's shortfall from its FLOP bound can be placed."""
    from bench.breakdown import module_times, profile_row

    row = one_row_of_groups(sequences, budget)
    total = sum(s.length for s in row)
    out = {"sequences": len(row), "tokens": total, "sides": {}}
    for name, scorer in zip(("unshared", "as served", "every member"), trio):
        saved = 0 if name == "unshared" else tokens_saved(row, min_tokens, scorer.prefix_rounding)
        scorer.score(row)  # this row's shapes once before measuring
        modules = module_times(loaded.model.layers, lambda: scorer.score(row))
        # kernel categories only where there are device kernels (the CPU profiler takes minutes here)
        kernels = profile_row(lambda: scorer.score(row), top=30) if loaded.device.type == "cuda" else None
        out["sides"][name] = {
            "tokens_run": total - saved,
            "flops": shared_flops(row, saved, flops),
            "modules": modules,
            "kernels": kernels,
        }
    return out


def profile_table(profile: dict) -> str:
    """The three sides of ``profile_row_three_ways`` as ratios to the unshared row."""
    base = profile["sides"]["unshared"]
    kinds = [k for k in ("linear_attn", "self_attn", "mlp") if k in base["modules"]]
    lines = [
        f"one row of {profile['sequences']} sequences ({profile['tokens']:,} tokens): ms by module kind (CUDA events; "
        "other: what no module's hooks timed, the norms, the head and an MLP whose forward is fused into its layer), "
        "and each side's tokens, model FLOPs and time as a fraction of the unshared row's",
        "",
        "| side | tokens run | FLOPs | " + " | ".join(f"{k} ms" for k in kinds) + " | other ms | wall ms | GPU idle ms "
        "| tokens / unshared | FLOPs / unshared | wall / unshared |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, side in profile["sides"].items():
        m, k = side["modules"], side["kernels"]
        idle_text = f"{k['categories_ms']['gpu_idle (launch, python, packing, host)']:.1f}" if k else "n/a"
        lines.append(
            f"| {name} | {side['tokens_run']:,} | {side['flops'] / 1e12:.2f} T | "
            + " | ".join(f"{m[kd]['ms']:.1f}" for kd in kinds)
            + f" | {m['other_ms']:.1f} | {m['wall_ms']:.1f} | {idle_text} | {side['tokens_run'] / base['tokens_run']:.3f} "
            f"| {side['flops'] / base['flops']:.3f} | {m['wall_ms'] / base['modules']['wall_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def table(result: dict) -> str:
    if "row_profile" in result:
        return profile_table(result["row_profile"])
    lines = [
        f"prefix sharing, {result['preset']} on {result['device']} ({result['dtype']}); token bound: workload tokens over "
        "tokens the shared rows run; FLOP bound: model FLOPs unshared over shared (bench/flops.py); "
        f"timed: the {result.get('timed_pass', 'second')} pass of each side",
        "",
        "| workload | sharing | rows of | tokens | unshared tok/s | shared tok/s | speedup | token bound "
        "| FLOP bound | mean abs dlogp | max abs dlogp |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, e in result["workloads"].items():
        p = e["by_prompt"]
        for kind, speedup, shared_s, row in (("as served", e["speedup"], e["shared_s"], e), ("every member", p["speedup"], p["shared_s"], p)):
            lines.append(
                f"| {name} | {kind} | {e['max_batch_tokens']} | {e['workload']['tokens']} | {e['unshared_tokens_per_s']:.0f} | "
                f"{e['workload']['tokens'] / shared_s:.0f} | {speedup:.3f} | {row['row_token_bound']:.3f} | {row['flop_bound']:.3f} | "
                f"{row['logprob_mean_diff']:.2e} | {row['logprob_max_diff']:.2e} |"
            )
    draws = result.get("rl_mix_over_seeds")
    if draws:
        lines += ["", "the RL mix drawn with other seeds:", "",
                  "| seed | repeated prompt tokens | as served | every member | FLOP bound (every member) | of the bound "
                  "| mean abs dlogp (every member) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for i, seed in enumerate(draws["seeds"]):
            lines.append(f"| {seed} | {draws['repeated_prompt_fraction'][i]:.1%} | {draws['as_served_speedup'][i]:.3f} | "
                         f"{draws['speedup'][i]:.3f} | {draws['flop_bound'][i]:.3f} | "
                         f"{draws['speedup'][i] / draws['flop_bound'][i]:.3f} | {draws['logprob_mean_diff'][i]:.2e} |")
        lines.append(f"| mean | {draws['mean_repeated_prompt_fraction']:.1%} | {draws['mean_as_served_speedup']:.3f} | "
                     f"{draws['mean_speedup']:.3f} | {draws['mean_flop_bound']:.3f} | {draws['mean_of_flop_bound']:.3f} | |")
    hf = result.get("hugging_face")
    if hf:
        lines += ["", f"distance to Hugging Face one sequence at a time, the RL mix's first {hf['sequences']} sequences "
                      f"({hf['tokens']:,} tokens): mean / max abs dlogp", ""]
        for key, label in (("diff_unshared_vs_hf_single", "packscore unshared"), ("diff_as_served_vs_hf_single", "packscore shared as served"),
                           ("diff_every_member_vs_hf_single", "packscore shared, every member"),
                           ("diff_hf_padded_vs_hf_single", "Hugging Face padded batches")):
            lines.append(f"- {label}: {hf[key]['logprob_mean']:.2e} / {hf[key]['logprob_max']:.2e}")
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
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="run the optional comparison (--also-tokens) only if it ends within this many seconds of the start")
    parser.add_argument("--flops-only", action="store_true", help="print the token and FLOP bounds only (no model run)")
    parser.add_argument("--profile-row", action="store_true",
                        help="instead of timing the workloads, profile one row of whole groups unshared, as served and "
                             "every member (ms by module kind and kernel category)")
    parser.add_argument("--workloads", default="",
                        help="comma-separated workloads to time (default all: rl_mix_groups_of_8, "
                             "groups_of_16_1k_prompt_2k_response, groups_of_8_8k_prompt_1k_response)")
    parser.add_argument("--passes", type=int, choices=(1, 2), default=2,
                        help="timed passes a side: 2 times the second (the first kept as first_pass_*); 1 for a "
                             "large preset whose passes would not fit the device call")
    parser.add_argument("--kernels", default="", metavar="FAMILY=BACKEND[,...]",
                        help="kernel backends for every side, as `packscore serve --kernels` (e.g. gate_projection=tiles: "
                             "every member of a group shares its prompt, bit for bit)")
    parser.add_argument("--hf-sequences", type=int, default=0, metavar="N",
                        help="also the distance of each side, and of Hugging Face's padded batches, to Hugging Face one "
                             "sequence at a time on the RL mix's first N sequences (0: no)")
    parser.add_argument("--seeds", default="", metavar="K[,K...]",
                        help="also the RL mix drawn with these seeds (workloads rl_mix_groups_of_8_seed_K, timed whatever "
                             "--workloads says; seed 0 is the benchmark's own), while --budget-s lasts, with their mean in "
                             "rl_mix_over_seeds")
    args = parser.parse_args(argv)
    only = tuple(name for name in args.workloads.split(",") if name)
    seeds = tuple(int(k) for k in args.seeds.split(",") if k)
    if args.flops_only:
        budgets = (args.max_batch_tokens, *([args.also_tokens] if args.also_tokens else []))
        bounds = flops_only(args.preset, budgets, args.min_tokens, seeds)
        for name, b in bounds.items():
            print(f"{name}: {b['repeated_prompt_fraction']:.1%} repeated prompt tokens, token bound {b['row_token_bound']:.3f}, FLOP bound {b['flop_bound']:.3f} "
                  f"({b['flop_bound_prompt_queries_once']:.3f} where attention runs a prompt's queries once)")
        return bounds
    result = run(args.preset, args.device, args.max_batch_tokens, args.min_tokens,
                 0 if args.profile_row else args.also_tokens, args.budget_s, profile=args.profile_row,
                 only=only, passes=args.passes, kernels=parse_kernel_overrides(args.kernels),
                 hf_sequences=args.hf_sequences, seeds=seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix-sharing.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (out / "prefix-sharing.md").write_text(text)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
