"""Where packscore's forward of one sequence parts from Hugging Face's, module by module.

    python -m bench.hf_divergence --out DIR      (on a CUDA machine with fla installed)

tests/gpu/test_isolation.py shows packscore scores a sequence identically alone and packed; the
parity test still finds the 4-layer 9B slice 5e-3 (mean |logprob|) from Hugging Face run on the
sequence alone. This probe runs one sequence through both (the same weights, elementwise
``eager`` so that every norm and MLP is called as its module) with forward hooks on every module
of the Hugging Face model, which packscore's layers share, and lists in Hugging Face's call order
each module's max |difference| of input and of output. A module whose inputs agree and outputs
differ computes differently; inputs that differ after equal outputs upstream point at the code
between modules (the conv, the gates, the delta rule, attention).

Then, on layer 0's own tensors from the Hugging Face run, the steps between modules side by side:
Hugging Face's conv against packscore's, its gates against packscore's, and fla's delta rule as
Hugging Face calls it (one sequence, no ``cu_seqlens``) against packscore's call (``cu_seqlens``,
with and without the row's padding segment). Writes ``hf_divergence.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1, t.shape[-1]).float() if t.dim() >= 2 else t.detach().reshape(-1, 1).float()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    n = min(a.shape[0], b.shape[0])
    if a.shape[1:] != b.shape[1:] or n == 0:
        return None
    return float((a[:n] - b[:n]).abs().max())


def module_divergence(twin, ids: np.ndarray, device: str = "cuda") -> list[dict]:
    """Per module of the Hugging Face model, in its call order: max |diff| of input 0 and output."""
    from model_runtime.scoring.scorer import Scorer
    from model_runtime.types import SequenceInput

    captured: dict[str, dict[str, list]] = {"hf": {}, "ours": {}}
    order: list[str] = []
    side = ["hf"]

    def hook(name):
        def fn(module, args, output):
            store = captured[side[0]]
            if name in store:
                return  # first call only
            inp = args[0] if args and isinstance(args[0], torch.Tensor) else None
            out = output[0] if isinstance(output, tuple) else output
            store[name] = [None if inp is None else _flat(inp), _flat(out) if isinstance(out, torch.Tensor) else None]
            if side[0] == "hf":
                order.append(name)
        return fn

    handles = []
    try:
        with twin.hf() as hf_model:
            # Hooks on Hugging Face's modules: packscore's layers call the same projection,
            # norm and MLP modules, so the second run fills the same names.
            handles = [m.register_forward_hook(hook(n)) for n, m in hf_model.named_modules() if n]
            with torch.inference_mode():
                hf_model(input_ids=torch.as_tensor(ids, device=device)[None], use_cache=False)
        side[0] = "ours"
        Scorer(twin.loaded, max_batch_tokens=1 << 16).score_row([SequenceInput(ids, score_from=1)])
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name in order:
        hf_in, hf_out = captured["hf"][name]
        mine = captured["ours"].get(name)
        row = {"module": name}
        if mine is None:
            row["note"] = "not called by packscore (its work is done between modules)"
        else:
            if hf_in is not None and mine[0] is not None:
                row["input_max_diff"] = _diff(hf_in, mine[0])
            if hf_out is not None and mine[1] is not None:
                row["output_max_diff"] = _diff(hf_out, mine[1])
                row["output_scale"] = float(hf_out.abs().max())
        rows.append(row)
    return rows


def layer0_steps(twin, ids: np.ndarray) -> dict:
    """Layer 0's conv, gates and delta rule, Hugging Face's calls against packscore's, on the same tensors."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_mod

    from bench.hf_reference import hf_uses_fla
    from model_runtime.kernels.linear_attention import gated_delta_rule_fla
    from model_runtime.model.packing import PackedBatch

    captured = {}
    with twin.hf() as hf_model:
        gdn = hf_model.model.layers[0].linear_attn
        def keep(name):
            def fn(module, args, output):  # returns None: the output is left as it is
                captured.setdefault(name, output.detach()[0])
            return fn

        hooks = [getattr(gdn, n).register_forward_hook(keep(n)) for n in ("in_proj_qkv", "in_proj_a", "in_proj_b")]
        with torch.inference_mode():
            hf_model(input_ids=torch.as_tensor(ids, device="cuda")[None], use_cache=False)
        for h in hooks:
            h.remove()
    ours = twin.loaded.model.layers[0].linear_attn
    T = len(ids)
    out = {}
    with torch.inference_mode():
        x_TC, a, b = captured["in_proj_qkv"], captured["in_proj_a"], captured["in_proj_b"]
        w_CW = gdn.conv1d.weight[:, 0, :]
        hf_conv = hf_mod.causal_conv1d_fn(x_TC.t()[None], w_CW, None, activation="silu")[0].t()
        alone = PackedBatch.from_lengths([T], device="cuda")
        padded, pad = PackedBatch.from_lengths_padded([T], 16, device="cuda")
        x_pad = torch.cat([x_TC, torch.zeros(pad, x_TC.shape[1], dtype=x_TC.dtype, device="cuda")])
        our_conv = ours.conv_fn(x_TC, w_CW, alone)
        out["conv: packscore vs HF (max |diff|)"] = float((our_conv.float() - hf_conv.float()).abs().max())
        out["conv: packscore padded row vs HF"] = float((ours.conv_fn(x_pad, w_CW, padded)[:T].float() - hf_conv.float()).abs().max())
        hf_beta = b.sigmoid()
        hf_g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
        g, beta = ours.ops.ew.gdn_gates(a, b, gdn.A_log, gdn.dt_bias)
        out["gates: g packscore vs HF"] = float((g.float() - hf_g).abs().max())
        out["gates: beta packscore vs HF"] = float((beta.float() - hf_beta.float()).abs().max())
        kd, vd = gdn.key_dim, gdn.value_dim
        q, k, v = torch.split(hf_conv, [kd, kd, vd], dim=-1)
        q = q.reshape(T, -1, gdn.head_k_dim)
        k = k.reshape(T, -1, gdn.head_k_dim)
        v = v.reshape(T, -1, gdn.head_v_dim)
        hf_o, _ = hf_mod.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=hf_g[None], beta=hf_beta[None],
                                                       initial_state=None, output_final_state=False,
                                                       use_qk_l2norm_in_kernel=True)
        hf_o = hf_o[0]
        mine = gated_delta_rule_fla(q.contiguous(), k.contiguous(), v.contiguous(), hf_g, hf_beta, alone)
        out["delta rule: packscore call (cu_seqlens) vs HF call"] = float((mine.float() - hf_o.float()).abs().max())

        def padded_rows(t):
            return torch.cat([t, torch.zeros(pad, *t.shape[1:], dtype=t.dtype, device="cuda")])

        mine_pad = gated_delta_rule_fla(*(padded_rows(t).contiguous() for t in (q, k, v, hf_g, hf_beta)), padded)[:T]
        out["delta rule: packscore call, padded row vs HF call"] = float((mine_pad.float() - hf_o.float()).abs().max())
        out["delta rule output scale"] = float(hf_o.float().abs().max())
        out["hf delta rule goes to"] = hf_uses_fla()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--preset", default="qwen3.5-9b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", default="1000,300", help="comma-separated sequence lengths")
    parser.add_argument("--dry-run-cpu", action="store_true", help="the tiny preset on the CPU, module table only")
    args = parser.parse_args(argv)
    from bench.hf_reference import build_twin

    device = "cpu" if args.dry_run_cpu else "cuda"
    if args.dry_run_cpu:
        args.preset, args.layers = "tiny", None
    twin = build_twin(args.preset, num_layers=args.layers, device=device,
                      dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                      kernel_overrides={"elementwise": "eager"})
    rng = np.random.default_rng(12)
    results = {}
    for n in (int(x) for x in args.lengths.split(",")):
        ids = rng.integers(0, twin.loaded.vocab_size, n)
        rows = module_divergence(twin, ids, device)
        results[f"length {n}"] = {"modules": rows}
        print(f"\n## length {n}\n\n| module | input max diff | output max diff | output scale |\n| --- | --- | --- | --- |")
        for r in rows:
            if "note" in r:
                print(f"| {r['module']} | {r['note']} | | |")
            else:
                fmt = lambda x: "n/a" if x is None else f"{x:.2e}"  # noqa: E731
                print(f"| {r['module']} | {fmt(r.get('input_max_diff'))} | {fmt(r.get('output_max_diff'))} | "
                      f"{fmt(r.get('output_scale'))} |", flush=True)
        if device == "cuda":
            steps = layer0_steps(twin, ids)
            results[f"length {n}"]["layer0_steps"] = steps
            print()
            for k, v in steps.items():
                print(f"- {k}: {v:.3e}" if isinstance(v, float) else f"- {k}: {v}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_divergence.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
