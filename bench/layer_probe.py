"""Each layer kind of a preset, kernel by kernel, on one packed row; and the head's product by chunk size.

    python -m bench.layer_probe --out DIR [--preset qwen3.5-35b-a3b] [--tokens 65518]

Builds the preset's first four layers (three Gated DeltaNet, one attention, four MoE or MLP
blocks) with random weights, runs one row of the RL mix's lengths through them (warm-up, so
fla's autotuning is done), then times each layer kind alone on its own captured input (median of
CUDA events) and lists every kernel of one call. The head part times the vocabulary product
``[C, D] x [V, D]^T`` for several chunk sizes ``C`` and checks that a position's logits do not
depend on ``C`` (bit for bit). Writes ``layer-probe.json`` and ``.md`` to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import suite_harness as H
from bench.moe import _median_ms, _row_lengths, top_kernels

HEAD_CHUNKS = (1024, 1600, 2048, 2560, 3200, 4096, 6400)


def layer_kinds(preset: str, tokens: int) -> dict:
    from bench.hf_reference import build_twin
    from model_runtime.model.packing import PackedBatch

    dev = H.DEVICE
    twin = build_twin(preset, num_layers=4, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    model = twin.loaded.model
    lengths = _row_lengths(tokens, twin.loaded.vocab_size)
    packed = PackedBatch.from_lengths(lengths, device=dev)
    ids = torch.randint(0, twin.loaded.vocab_size, (tokens,), device=dev)
    captured: dict[str, tuple] = {}

    def keep(name):
        def hook(module, args, kwargs):
            captured.setdefault(name, (module, args, kwargs))
        return hook

    handles = []
    for layer, kind in zip(model.layers, model.layer_types):
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        handles.append(mixer.register_forward_pre_hook(keep(type(mixer).__name__), with_kwargs=True))
        handles.append(layer.mlp.register_forward_pre_hook(keep(type(layer.mlp).__name__), with_kwargs=True))
    with torch.inference_mode():
        for _ in range(2):
            model(ids, packed)
        for h in handles:
            h.remove()
        out = {"preset": preset, "tokens": tokens, "sequences": len(lengths), "kinds": {}}
        for name, (module, args, kwargs) in captured.items():
            def run(module=module, args=args, kwargs=kwargs):
                return module(*args, **kwargs)
            entry = {"ms": _median_ms(run, warm=2, repeats=7), "kernels": top_kernels(run, top=60)}
            if name == "PackedAttention" and dev == "cuda":
                entry["backends"] = attention_backends(module, run)
            out["kinds"][name] = entry
            H.log(f"{name}: {entry['ms']:.3f} ms {entry.get('backends', '')}")
    del twin, model, captured
    H.free_memory()
    return out


def attention_backends(module, run, names=("sdpa", "sdpa_fused")) -> dict:
    """The attention layer with each backend: median ms, and whether its output equals the first's bit for bit."""
    from model_runtime.kernels.registry import REGISTRY

    kept, out, first = module.attention_fn, {}, None
    try:
        for name in names:
            module.attention_fn = REGISTRY["attention"][name]
            y = run()
            first = y if first is None else first
            out[name] = {"ms": _median_ms(run, warm=2, repeats=9),
                         "unequal_to_" + names[0]: int((y.view(torch.int16) != first.view(torch.int16)).sum())}
    finally:
        module.attention_fn = kept
    return out


def head_chunks(vocab: int = 248320, hidden: int = 2048, chunks=HEAD_CHUNKS) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    h = torch.randn(max(chunks), hidden, device="cuda", generator=g).to(torch.bfloat16)
    ref = torch.nn.functional.linear(h[: min(chunks)], w)
    rows = []
    with torch.inference_mode():
        for c in chunks:
            x = h[:c].contiguous()
            ms = _median_ms(lambda: torch.nn.functional.linear(x, w), warm=3, repeats=9)
            z = torch.nn.functional.linear(x, w)
            differing = int((z[: ref.shape[0]].view(torch.int16) != ref.view(torch.int16)).sum())
            del z
            zt_ms = _median_ms(lambda: torch.nn.functional.linear(w, x), warm=3, repeats=9)
            zt = torch.nn.functional.linear(w, x)
            differing_t = int((zt[:, : ref.shape[0]].t().view(torch.int16) != ref.view(torch.int16)).sum())
            del zt
            flop = 2.0 * c * vocab * hidden
            rows.append({"chunk": c, "ms": ms, "tflops": flop / ms / 1e9, "differing_from_smallest": differing,
                         "transposed_ms": zt_ms, "transposed_tflops": flop / zt_ms / 1e9,
                         "transposed_differing": differing_t})
            H.log(f"head chunk {c}: {rows[-1]}")
    return {"vocab": vocab, "hidden": hidden, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Layer probe: {result['layers']['preset']}, one row of {result['layers']['tokens']:,} tokens "
             f"({result['layers']['sequences']} sequences)", ""]
    for name, entry in result["layers"]["kinds"].items():
        lines += ["", f"## {name}: {entry['ms']:.3f} ms (median)", "", "| kernel | calls | ms | share |",
                  "| --- | ---: | ---: | ---: |"]
        lines += [f"| {k['name'][:110]} | {k['calls']} | {k['total_ms']:.3f} | {k['share']:.3f} |" for k in entry["kernels"]]
        for backend, b in entry.get("backends", {}).items():
            lines.append(f"\nattention={backend}: {b['ms']:.3f} ms; " + ", ".join(f"{k} {v}" for k, v in b.items() if k != "ms"))
    lines += ["", "## Head product by chunk size", "", "| chunk | ms | TFLOP/s | values differing | transposed ms | "
              "transposed TFLOP/s | transposed differing |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['chunk']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['differing_from_smallest']} | {r['transposed_ms']:.3f} | "
              f"{r['transposed_tflops']:.0f} | {r['transposed_differing']} |" for r in result["head"]["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="qwen3.5-35b-a3b")
    parser.add_argument("--tokens", type=int, default=65518)
    parser.add_argument("--dry-run-cpu", action="store_true", help="the layer part on the CPU (no head part): checks the script")
    parser.add_argument("--no-head", action="store_true", help="skip the head's chunk sizes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run_cpu:
        H.set_device("cpu")
    result = {"head": {"rows": []} if args.dry_run_cpu or args.no_head else head_chunks(),
              "layers": layer_kinds(args.preset, args.tokens)}
    (args.out / "layer-probe.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "layer-probe.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
