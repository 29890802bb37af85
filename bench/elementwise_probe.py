"""The memory-bound steps of the 9B forward, one at a time, on the GPU: every implementation and
every Triton tile, each checked element for element against eager PyTorch and timed.

    python -m bench.elementwise_probe --out DIR [--tokens 65536]

Shapes are one 65,536-token row of the Qwen3.5-9B shape: the residual add + RMSNorm over 4096
(64 per forward), the GDN output's gated norm over rows of 128 (24), the q and k head norms over
256 (8 each, q read in place from the wider q projection) and the MLP's SiLU product over 12,288
(32), and the GDN's causal conv + SiLU over 8192 channels (24). Implementations: ``eager``
(Hugging Face's arithmetic, the reference; for the conv, fla's conv then ATen's SiLU),
``inductor``, ``inductor_exact``, ``triton_exact`` with its default tiles, and then every candidate
tile of the Triton kernels (same arithmetic, other cuts of the work). Each line gives the median time
(``triton.testing.do_bench``), the bandwidth it implies over the bytes the step must move once,
and how many elements differ from eager. Writes ``elementwise-probe.json`` and ``.md`` to --out;
the tile defaults in ``norm_triton`` and ``pointwise_triton`` are read off this table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _cases(T: int, g: torch.Generator):
    """name -> dict(bytes moved once, ref: the eager reference, impls: label -> fn,
    tile: fn(tile), tiles: the candidates)."""
    from model_runtime.kernels import conv as CONV
    from model_runtime.kernels import conv_triton as CT
    from model_runtime.kernels import elementwise as E
    from model_runtime.kernels import norm_triton as NT
    from model_runtime.kernels import pointwise_triton as PT
    from model_runtime.model.packing import PackedBatch

    dev, bf = "cuda", torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(bf)

    x, d, w = rnd(T, 4096, scale=3), rnd(T, 4096), rnd(4096, scale=0.1)
    o, z, w128 = rnd(T * 32, 128, scale=3), rnd(T * 32, 128), rnd(128, scale=0.1)
    q = rnd(T, 16, 512, scale=3)[..., :256]
    k, w256 = rnd(T, 4, 256, scale=3), rnd(256, scale=0.1)
    gate, up = rnd(T, 12288, scale=3), rnd(T, 12288)
    qkv, w_conv = rnd(T, 8192), rnd(8192, 4, scale=0.5)
    lengths = [T // 13] * 12
    packed = PackedBatch.from_lengths(lengths + [T - sum(lengths)], device=dev)
    splits = (2048, 2048, 4096)
    hidden, elem = T * 4096 * 2, 2
    implementations = (E.inductor(), E.inductor_exact(), E.triton_exact())

    def by_backend(run):
        return {ew.name: (lambda ew=ew: run(ew)) for ew in implementations}

    def norm_case(nbytes, run, tile, D):
        plan = NT.plan_for(D)
        return dict(bytes=nbytes, ref=lambda: run(E.EAGER), impls=by_backend(run),
                    tile=lambda t: tile(plan, t), tiles=NT.tile_candidates(D, plan) if plan else [])

    return {
        "add_rms_norm D=4096": norm_case(4 * hidden, lambda ew: ew.add_rms_norm(x, d, w, 1e-6),
                                         lambda p, t: NT.rms_norm(x, w, 1e-6, d, plan=p, tile=t), 4096),
        "gated_rms_norm D=128": norm_case(3 * o.numel() * elem, lambda ew: ew.gated_rms_norm(o, z, w128, 1e-6),
                                          lambda p, t: NT.gated_rms_norm(o, z, w128, 1e-6, plan=p, tile=t), 128),
        "q_norm D=256 (strided)": norm_case(2 * q.numel() * elem, lambda ew: ew.rms_norm(q, w256, 1e-6),
                                            lambda p, t: NT.rms_norm(q, w256, 1e-6, plan=p, tile=t), 256),
        "k_norm D=256": norm_case(2 * k.numel() * elem, lambda ew: ew.rms_norm(k, w256, 1e-6),
                                  lambda p, t: NT.rms_norm(k, w256, 1e-6, plan=p, tile=t), 256),
        "silu_mul I=12288": dict(
            bytes=3 * gate.numel() * elem, ref=lambda: E.EAGER.silu_mul(gate, up),
            impls=by_backend(lambda ew: ew.silu_mul(gate, up)),
            tile=lambda t: PT.silu_mul(gate, up, tile=t), tiles=PT.tile_candidates()),
        "conv1d + SiLU C=8192": dict(  # the reference is what Hugging Face runs without causal-conv1d
            bytes=2 * qkv.numel() * elem, ref=lambda: CONV.causal_conv1d_fla(qkv, w_conv, packed, splits),
            impls={"triton default": lambda: CT.causal_conv1d_silu_triton(qkv, w_conv, packed, splits)},
            tile=lambda t: CT.conv_splits(qkv, w_conv, packed, splits, silu=True, tile=t),
            tiles=CT.tile_candidates()),
    }


def _measure(fn, want, nbytes: int, do_bench) -> dict:
    """Median time of ``fn``, the bandwidth over ``nbytes`` and its count of values unequal to
    ``want``; a tile that does not build gives its error instead of costing the table."""
    try:
        differ = _unequal(fn(), want)
        ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return {"ms": ms, "gb_per_s": nbytes / ms / 1e6, "unequal": differ}


def _unequal(got, want) -> int:
    if isinstance(want, tuple):
        return sum(_unequal(a, b) for a, b in zip(got, want))
    return int((got != want).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens in the row (default: %(default)s)")
    parser.add_argument("--only", default="", help="only the steps whose name contains this (e.g. conv)")
    args = parser.parse_args(argv)
    from triton.testing import do_bench

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    results = {"tokens": args.tokens, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    lines = ["| step | implementation | median ms | GB/s | unequal to eager |", "| --- | --- | ---: | ---: | ---: |"]
    with torch.inference_mode():
        for name, case in _cases(args.tokens, g).items():
            if args.only not in name:
                continue
            want = case["ref"]()
            rows = {}
            for label, fn in (("eager", case["ref"]), *case["impls"].items(),
                              *((f"tile {t}", lambda t=t: case["tile"](t)) for t in case["tiles"])):
                rows[label] = _measure(fn, want, case["bytes"], do_bench)
                r = rows[label]
                print(f"{name:24s} {label:28s} " + (r["error"] if "error" in r else
                      f"{r['ms']:8.3f} ms {r['gb_per_s']:8.0f} GB/s  unequal {r['unequal']}"), flush=True)
            del want
            timed = {k: v for k, v in rows.items() if "ms" in v}
            exact_tiles = {k: v for k, v in timed.items() if k.startswith("tile") and v["unequal"] == 0}
            best = min(exact_tiles, key=lambda k: exact_tiles[k]["ms"]) if exact_tiles else None
            results["cases"][name] = {"bytes": case["bytes"], "rows": rows, "best_exact_tile": best}
            for label, r in rows.items():
                if "ms" in r and (not label.startswith("tile") or label == best):
                    lines.append(f"| {name} | {label}{' (fastest tile)' if label == best else ''} | {r['ms']:.3f} | "
                                 f"{r['gb_per_s']:.0f} | {r['unequal']} |")
            torch.cuda.empty_cache()
    results["seconds"] = time.perf_counter() - started
    (out / "elementwise-probe.json").write_text(json.dumps(results, indent=1))
    (out / "elementwise-probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
