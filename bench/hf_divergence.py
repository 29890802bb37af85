"""Where packscore's forward first parts from Hugging Face's, module by module, one sequence alone.

    python -m bench.hf_divergence --preset qwen3.5-35b-a3b --layers 8 --lengths 2000,5000 --out DIR

The same random-weight model runs as Hugging Face's (one sequence, its own modules) and as
packscore's packed model (the sequence alone in a row); forward hooks record every decoder
layer's sub-module outputs (norms, token mixer, MLP / sparse-MoE block), the layer's output, and
what the token mixer and the MLP receive (packscore's residual add and norm are fused inside its
layer, so their output is seen as the next module's input).
The first module whose output differs, in execution order, is where the two part; the table
gives every module's mean and max |difference| and the fraction of differing elements, and the
log-probs at the end. Where a sparse-MoE block's output is the first to differ, the block is
taken apart on Hugging Face's own input to it (``moe_block_steps``): router logits, top-k ids and
weights (with the order of the top-k renormalisation sum), routed experts on one routing, shared
expert, shared gate and output. Writes ``hf-divergence.json`` to DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

PARTS = ("input_layernorm", "linear_attn", "self_attn", "post_attention_layernorm", "mlp")


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next(t for t in out if isinstance(t, torch.Tensor))
    raise TypeError(f"no tensor in {type(out).__name__}")


def _record(layers, length: int, store: dict) -> list:
    handles = []
    for i, layer in enumerate(layers):
        targets = [(f"{i}.{p}", getattr(layer, p)) for p in PARTS if hasattr(layer, p)] + [(f"{i}.out", layer)]
        for name, module in targets:
            def hook(mod, args, out, name=name):
                t = _first_tensor(out)
                store[name] = t.reshape(-1, t.shape[-1])[:length].float().cpu()
            handles.append(module.register_forward_hook(hook))
        # What the token mixer and the MLP receive: the (fused, unhooked) residual add and norm's output.
        for part in ("linear_attn", "self_attn", "mlp"):
            if hasattr(layer, part):
                def pre(mod, args, kwargs, name=f"{i}.{part}.input"):
                    t = args[0] if args else kwargs.get("hidden_states")
                    store[name] = t.reshape(-1, t.shape[-1])[:length].float().cpu()
                handles.append(getattr(layer, part).register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def renorm_sum_orders(top_TK: torch.Tensor) -> dict:
    """How ``top_TK.sum(-1)`` (Hugging Face's renormalisation, a reduction kernel) adds K float32
    values: the fraction of rows on which each fixed order gives the same bits."""
    from model_runtime.model.moe import lane_tree_sum

    v = [top_TK[:, k] for k in range(top_TK.shape[1])]
    K = len(v)
    orders = {"sequential": lambda: _fold(v)}
    if K == 8:
        orders.update({
            "pairwise": lambda: ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])),
            "halves_then_sequential": lambda: _fold([v[j] + v[j + 4] for j in range(4)]),
            "halves_then_pairwise": lambda: ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])),
            "shuffle_tree": lambda: lane_tree_sum(v),  # what top_k_total adds on CUDA
        })
    reference = top_TK.sum(-1)
    out = {name: float((fn() == reference).float().mean()) for name, fn in orders.items()}
    out["rows"] = top_TK.shape[0]
    return out


def _fold(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def moe_block_steps(hf_block, ours, x_TD: torch.Tensor) -> dict:
    """Hugging Face's sparse-MoE block and packscore's on the same rows (one sequence), step by step
    (``bench.moe.block_steps``), with the orders of the router's renormalisation sum."""
    from bench.moe import block_steps
    from model_runtime.model.packing import PackedBatch

    with torch.inference_mode():
        steps, _ = block_steps(hf_block, ours, x_TD, PackedBatch.from_lengths([x_TD.shape[0]], device=x_TD.device))
        logits, _, _ = hf_block.gate(x_TD)
        top, _ = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), ours.top_k, dim=-1)
        random = torch.rand(65536, ours.top_k, device=x_TD.device).sort(dim=-1, descending=True).values
        return {"tokens": x_TD.shape[0], **steps, "renorm_sum_orders_vs_torch_sum": renorm_sum_orders(top),
                "renorm_sum_orders_vs_torch_sum_random_65536": renorm_sum_orders(random)}


def divergence(preset: str, num_layers: int, length: int, seed: int = 0, device: str = "cuda") -> dict:
    from bench.hf_reference import build_twin
    from model_runtime.scoring.scorer import Scorer
    from model_runtime.types import SequenceInput

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    twin = build_twin(preset, num_layers=num_layers, device=device, dtype=dtype)
    layers = twin.hf_model.model.layers
    ids = np.random.default_rng(seed).integers(0, twin.loaded.vocab_size, length)
    ours: dict = {}
    handles = _record(layers, length, ours)
    scorer = Scorer(twin.loaded)
    mine = scorer.score_row([SequenceInput(ids, score_from=1)])[0]
    for h in handles:
        h.remove()
    theirs: dict = {}
    with twin.hf() as hf, torch.inference_mode():
        handles = _record(layers, length, theirs)
        logits = hf(input_ids=torch.from_numpy(ids)[None].to(device), use_cache=False).logits[0].float()
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.from_numpy(ids[1:]).to(device)[:, None])[:, 0].cpu().numpy()
    rows, first = [], None
    for name in theirs:  # execution order
        if name not in ours:
            continue
        d = (ours[name] - theirs[name]).abs()
        row = {"module": name, "max": float(d.max()), "mean": float(d.mean()), "differing": float((d > 0).float().mean())}
        rows.append(row)
        if first is None and row["max"] > 0:
            first = name
    dl = np.abs(mine.logprobs - logp)
    steps = None
    if first is not None and first.endswith(".mlp"):
        index = int(first.split(".")[0])
        hf_block = next(m for layer, attr, m in twin._originals if attr == "mlp" and layer is layers[index])
        if type(hf_block).__name__.endswith("SparseMoeBlock"):
            x_TD = theirs[f"{index}.mlp.input"].to(device=device, dtype=dtype)
            steps = {"layer": index, **moe_block_steps(hf_block, layers[index].mlp, x_TD)}
    del twin, scorer
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"preset": f"{preset}[:{num_layers}]", "length": length, "first_differing": first or "none",
            "modules": rows, "logprob_mean_diff": float(dl.mean()), "logprob_max_diff": float(dl.max()),
            "moe_block_steps": steps}


def table(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"\n**{r['preset']}, one sequence of {r['length']} tokens**: first differing module "
                     f"`{r['first_differing']}`; log-probs mean / max |diff| {r['logprob_mean_diff']:.2e} / "
                     f"{r['logprob_max_diff']:.2e}\n")
        lines.append("| module | max | mean | differing fraction |\n| --- | ---: | ---: | ---: |")
        lines += [f"| {m['module']} | {m['max']:.3g} | {m['mean']:.3g} | {m['differing']:.3g} |" for m in r["modules"]]
        if r.get("moe_block_steps"):
            lines.append(f"\nlayer {r['moe_block_steps']['layer']}'s MoE block on Hugging Face's input, step by step:\n")
            lines += [f"- {k}: {v}" for k, v in r["moe_block_steps"].items() if k != "layer"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", default="2000")
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (float32, a dry run)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = [divergence(args.preset, args.layers, int(n), device=args.device) for n in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf-divergence.json").write_text(json.dumps(results, indent=1))
    print(table(results), flush=True)
    print(f"done in {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
