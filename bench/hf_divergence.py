"""Where packscore's forward first parts from Hugging Face's, module by module, one sequence alone.

    python -m bench.hf_divergence --preset qwen3.5-35b-a3b --layers 8 --lengths 2000,5000 --out DIR

The same random-weight model runs as Hugging Face's (one sequence, its own modules) and as
packscore's packed model (the sequence alone in a row); forward hooks record every decoder
layer's sub-module outputs (norms, token mixer, MLP / sparse-MoE block), the layer's output, and
what the token mixer and the MLP receive (packscore's residual add and norm are fused inside its
layer, so their output is seen as the next module's input).
The first module whose output differs, in execution order, is where the two part; the table
gives every module's mean and max |difference| and the fraction of differing elements, and the
log-probs at the end. Writes ``hf-divergence.json`` to DIR and prints the table last.
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
        logits = hf(input_ids=torch.from_numpy(ids)[None].to(device)).logits[0].float()
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
    del twin, scorer
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"preset": f"{preset}[:{num_layers}]", "length": length, "first_differing": first or "none",
            "modules": rows, "logprob_mean_diff": float(dl.mean()), "logprob_max_diff": float(dl.max())}


def table(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"\n**{r['preset']}, one sequence of {r['length']} tokens**: first differing module "
                     f"`{r['first_differing']}`; log-probs mean / max |diff| {r['logprob_mean_diff']:.2e} / "
                     f"{r['logprob_max_diff']:.2e}\n")
        lines.append("| module | max | mean | differing fraction |\n| --- | ---: | ---: | ---: |")
        lines += [f"| {m['module']} | {m['max']:.3g} | {m['mean']:.3g} | {m['differing']:.3g} |" for m in r["modules"]]
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
