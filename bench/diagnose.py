"""Where bf16 differences against Hugging Face come from, and the measurements that needed a rerun.

- ``depth_noise``: packscore and Hugging Face's padded form, each against Hugging Face one
  sequence at a time, on the first sequences of the workload, for models cut to 4, 8, 16 and 32
  layers of the 9B shape. Two correct bf16 implementations drift apart as depth grows; if
  packscore's difference tracks Hugging Face's own padded-vs-single difference, it is that
  drift and not a packing error.
- ``moe_block``: one 35B-A3B sparse-MoE block on the same random input with the experts run as
  ``grouped_mm`` and as ``eager`` in bf16, each against the block in float32 (eager).
- ``head_memory``: the head alone at 65,536 scored positions.
- ``subset_timing``: packscore and both Hugging Face forms on the first 64 sequences.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from bench.hf_reference import diff_stats
from model_runtime.scoring.scorer import Scorer

GiB = 2**30


def depth_noise(num_sequences: int = 4, depths=(4, 8, 16, 32)) -> dict:
    from bench.hf_reference import build_twin, kernel_backend, score_padded, score_single, to_numpy
    from bench.workload import WorkloadSpec, grpo_workload

    out = {}
    for depth in depths:
        twin = build_twin("qwen3.5-9b", num_layers=depth)
        seqs = grpo_workload(twin.loaded.vocab_size, WorkloadSpec())[:num_sequences]
        ours = [(r.logprobs, r.entropy) for r in Scorer(twin.loaded, max_batch_tokens=65536).score(seqs)]
        with kernel_backend(twin.loaded.model, "elementwise", "eager"):
            ours_eager = [(r.logprobs, r.entropy) for r in Scorer(twin.loaded, max_batch_tokens=65536).score(seqs)]
        with twin.hf() as hf:
            single = to_numpy(score_single(hf, seqs, "cuda"))
            padded = to_numpy(score_padded(hf, seqs, "cuda", 32768))
        entry = {
            "packscore_vs_hf_single": diff_stats(ours, single),
            "packscore_unfused_vs_hf_single": diff_stats(ours_eager, single),
            "hf_padded_vs_hf_single": diff_stats(padded, single),
            "packscore_vs_hf_padded": diff_stats(ours, padded),
        }
        if depth == depths[-1]:
            w = twin.loaded.model
            entry["weight_std"] = {
                "lm_head": float(w.lm_head.weight.float().std()),
                "embed_tokens": float(w.embed_tokens.weight.float().std()),
                "layer0_mlp_up": float(w.layers[0].mlp.up_proj.weight.float().std()),
            }
            entry["mean_logprob"] = float(np.mean(np.concatenate([x[0] for x in single])))
            entry["mean_entropy"] = float(np.mean(np.concatenate([x[1] for x in single])))
        out[f"layers_{depth}"] = entry
        print(f"depth {depth}: {entry}", flush=True)
        del twin
        torch.cuda.empty_cache()
    return out


def moe_block(tokens: int = 8192) -> dict:
    from bench.hf_reference import build_twin, set_moe_implementation

    twin = build_twin("qwen3.5-35b-a3b", num_layers=1, moe_implementation="grouped_mm")
    model = twin.loaded.model
    block = next(b for _, attr, b in twin._originals if attr == "mlp")  # Hugging Face's block
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, tokens, model.config.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    outputs = {}
    with torch.inference_mode():
        for impl in ("grouped_mm", "eager"):
            set_moe_implementation(model, impl)
            y = block(x)
            outputs[impl] = (y[0] if isinstance(y, tuple) else y).float()
        set_moe_implementation(model, "eager")  # the copy below shares the config object
        block32 = copy.deepcopy(block).float()
        y = block32(x.float())
        ref = (y[0] if isinstance(y, tuple) else y).float()
    result = {
        impl: {"rel_vs_float32": float((o - ref).norm() / ref.norm()), "max_abs_vs_float32": float((o - ref).abs().max())}
        for impl, o in outputs.items()
    }
    result["grouped_vs_eager_rel"] = float((outputs["grouped_mm"] - outputs["eager"]).norm() / outputs["eager"].norm())
    print(f"moe block: {result}", flush=True)
    del twin, block32
    torch.cuda.empty_cache()
    return result


def head_memory(n: int = 65536) -> dict:
    from bench.hf_reference import build_twin
    from model_runtime.scoring.head import score_positions

    twin = build_twin("qwen3.5-9b", num_layers=1)
    scorer = Scorer(twin.loaded, max_batch_tokens=65536)
    weight = twin.loaded.model.lm_head.weight
    hidden = torch.randn(n + 1, weight.shape[1], device="cuda", dtype=weight.dtype)
    targets = torch.randint(0, weight.shape[0], (n,), device="cuda")
    temps = torch.ones(n, device="cuda")
    rows = torch.arange(n, device="cuda")
    with torch.inference_mode():
        score_positions(hidden, weight, targets[:256], temps[:256], chunk_tokens=scorer.head_chunk_tokens,
                        rows_N=rows[:256], logprob_fn=scorer.logprob_fn)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        score_positions(hidden, weight, targets, temps, chunk_tokens=scorer.head_chunk_tokens, rows_N=rows,
                        logprob_fn=scorer.logprob_fn)
        torch.cuda.synchronize()
    result = {"positions": n, "chunk_tokens": scorer.head_chunk_tokens, "seconds": time.perf_counter() - t0,
              "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / GiB}
    print(f"head alone: {result}", flush=True)
    del twin, hidden
    torch.cuda.empty_cache()
    return result


def subset_timing(num_sequences: int = 64) -> dict:
    """Each side untimed then timed on the same subset (tokens/s of the three forms side by side)."""
    from bench.hf_reference import build_twin, score_padded, score_single
    from bench.workload import WorkloadSpec, describe, grpo_workload

    twin = build_twin("qwen3.5-9b")
    seqs = grpo_workload(twin.loaded.vocab_size, WorkloadSpec())[:num_sequences]
    work = describe(seqs)
    scorer = Scorer(twin.loaded, max_batch_tokens=65536)
    result = {"workload": work}

    def timed(name, fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        result[name] = {"seconds": seconds, "tokens_per_s": work["tokens"] / seconds}
        print(f"subset {name}: {result[name]}", flush=True)

    timed("packscore", lambda: scorer.score(seqs))
    with twin.hf() as hf:
        timed("hf_padded", lambda: score_padded(hf, seqs, "cuda", 32768))
        timed("hf_single", lambda: score_single(hf, seqs, "cuda"))
    del twin, scorer
    torch.cuda.empty_cache()
    return result
