"""Which of fla's autotuned forward configurations change the Gated DeltaNet's bits, and which is
fastest on packed rows: the figures behind ``linear_attention.FLA_FORWARD_PINS``.

    python -m bench.fla_configs --out DIR          # H200, about two minutes

For each kernel of ``FLA_FORWARD_KERNELS``, every configuration fla offers runs the whole varlen
forward (packscore's own call, ``_fla_chunk``) while the other kernels hold their pins: the
median time of the forward and whether its output equals, bit for bit, the output with every pin.
The 9B's shape on a 64k-token row of the RL mix is timed; the tiny model's shape is checked for
bits only. Then fla's own autotuning runs on the same row, as a fresh process would, and the
output it gives is compared with the pinned one. Writes ``fla-configs.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

os.environ["PACKSCORE_FLA_AUTOTUNE"] = "1"  # this script sets the configurations itself

from model_runtime.kernels.linear_attention import (  # noqa: E402
    FLA_FORWARD_KERNELS,
    FLA_FORWARD_PINS,
    _fla_chunk,
    fla_tuner,
    pinned_config,
)
from model_runtime.model.packing import PackedBatch  # noqa: E402
from model_runtime.scoring.presets import PRESETS, build_config  # noqa: E402


def describe(config) -> str:
    meta = ",".join(f"{k}={v}" for k, v in sorted(config.kwargs.items()))
    return f"{meta + ' ' if meta else ''}w{config.num_warps} s{config.num_stages}"


def row_lengths(tokens: int, seed: int = 0) -> list[int]:
    """RL-mix-like lengths (log-normal around 2,100) filling ``tokens``."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(np.clip(rng.lognormal(np.log(2100), 0.6), 16, 12000)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def inputs(preset: str, tokens: int, seed: int = 0):
    c = build_config(PRESETS[preset])
    Hk, Hv, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    q, k, v = rand(tokens, Hk, K), rand(tokens, Hk, K), rand(tokens, Hv, V)
    decay = -torch.nn.functional.softplus(rand(tokens, Hv, dtype=torch.float32))
    beta = torch.sigmoid(rand(tokens, Hv))
    packed = PackedBatch.from_lengths(row_lengths(tokens, seed), device="cuda")
    return (q, k, v, decay, beta, packed), {"Hk": Hk, "Hv": Hv, "K": K, "V": V, "tokens": tokens,
                                           "segments": packed.num_segments}


def forward(args) -> torch.Tensor:
    return _fla_chunk(*args, None, keep_final=False)[0]


def timed_ms(args, repeats: int) -> float:
    for _ in range(3):
        forward(args)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        forward(args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def set_configs(tuners: dict, offered: dict, choice: dict) -> None:
    """Every tuner to the one configuration ``choice[name]`` (None: all it offers, autotuned)."""
    for name, tuner in tuners.items():
        tuner.configs = offered[name] if choice.get(name) is None else [choice[name]]
        tuner.cache.clear()


def sweep(preset: str, tokens: int, repeats: int, tuners: dict, offered: dict, pinned: dict, deadline: float) -> dict:
    args, shape = inputs(preset, tokens)
    set_configs(tuners, offered, pinned)
    base = forward(args).clone()
    base_ms = timed_ms(args, repeats) if repeats else None
    entry = {"shape": shape, "pinned_ms": base_ms, "kernels": {}}
    for name in tuners:
        rows = []
        for config in offered[name]:
            if time.perf_counter() > deadline:
                entry["stopped"] = "out of time"
                break
            set_configs(tuners, offered, {**pinned, name: config})
            t0 = time.perf_counter()
            try:
                out = forward(args)
            except Exception as err:  # a configuration that does not compile for this shape
                rows.append({"config": describe(config), "error": f"{type(err).__name__}: {err}"[:200]})
                continue
            compile_s = time.perf_counter() - t0
            diff = float((out.float() - base.float()).abs().max())
            row = {"config": describe(config), "pinned": config is pinned[name], "equal_bits": bool(torch.equal(out, base)),
                   "max_diff": diff, "compile_s": round(compile_s, 2)}
            if repeats:
                row["ms"] = timed_ms(args, repeats)
            rows.append(row)
            print(preset, name, row, flush=True)
        entry["kernels"][name] = rows
    # What a fresh process gets: fla's own tuning over everything it offers.
    set_configs(tuners, offered, {})
    out = forward(args)
    picks = {name: [describe(c) for c in t.cache.values()] for name, t in tuners.items()}
    entry["autotuned"] = {"picks": picks, "equal_bits": bool(torch.equal(out, base)),
                          "max_diff": float((out.float() - base.float()).abs().max()),
                          "ms": timed_ms(args, repeats) if repeats else None}
    print(preset, "autotuned", entry["autotuned"], flush=True)
    set_configs(tuners, offered, pinned)
    return entry


def table(result: dict) -> str:
    lines = ["| shape | kernel | configuration | forward ms | bits as pinned | max diff |", "| --- | --- | --- | ---: | --- | ---: |"]
    for preset, entry in result["shapes"].items():
        for name, rows in entry["kernels"].items():
            for r in rows:
                ms = f"{r['ms']:.3f}" if r.get("ms") is not None else ""
                mark = " (pin)" if r.get("pinned") else ""
                lines.append(f"| {preset} | {name} | {r['config']}{mark} | {ms} | {r.get('equal_bits', r.get('error'))} | "
                             f"{r.get('max_diff', float('nan')):.2e} |")
        a = entry["autotuned"]
        ms = f"{a['ms']:.3f}" if a.get("ms") is not None else ""
        lines.append(f"| {preset} | fla autotuned | {a['picks']} | {ms} | {a['equal_bits']} | {a['max_diff']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=400)
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    tuners = {name: fla_tuner(name) for name in FLA_FORWARD_KERNELS}
    missing = [n for n, t in tuners.items() if t is None]
    tuners = {n: t for n, t in tuners.items() if t is not None}
    offered = {name: list(t.configs) for name, t in tuners.items()}
    pinned = {name: pinned_config(cs, FLA_FORWARD_PINS[name]) or cs[0] for name, cs in offered.items()}
    result = {"device": torch.cuda.get_device_name(), "missing_kernels": missing,
              "offered": {n: [describe(c) for c in cs] for n, cs in offered.items()},
              "pins": {n: describe(c) for n, c in pinned.items()}, "shapes": {}}
    result["shapes"]["qwen3.5-9b"] = sweep("qwen3.5-9b", args.tokens, args.repeats, tuners, offered, pinned, deadline)
    result["shapes"]["tiny"] = sweep("tiny", 4096, 0, tuners, offered, pinned, deadline)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fla-configs.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
