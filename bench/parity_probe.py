"""Where packscore's bf16 log-probs part from Hugging Face's: one kernel family swapped at a time.

    python -m bench.parity_probe --out DIR        (on a CUDA machine with fla installed)

For a tiny test checkpoint (tests/checkpoints.py, ``qwen3_5``) and a 4-layer slice of the
Qwen3.5-9B shape, sequences of the parity test's lengths (scored from position 1, T = 1) are
scored by:
- Hugging Face one sequence at a time (the reference of the parity test), and Hugging Face's
  padded batches: the difference between those two is Hugging Face's own bf16 noise;
- packscore with its default CUDA kernels, and with one family at a time replaced by the
  backend that rounds where Hugging Face's eager modules round (conv1d ``reference``: bf16
  conv, then SiLU in bf16; elementwise ``eager``; head ``torch``), with all of those together,
  and with fla's conv and its fused float32 SiLU (one rounding where Hugging Face has two);
- packscore on each sequence alone, against the packed row (isolation), and the first modules
  whose outputs differ between the two.
The attention, gate-projection and ``inductor_exact`` swaps are measured by tests/gpu
(test_parity_bf16.py, test_isolation.py) on the same lengths and weights, not again here.
Prints a table of mean / max |difference| of log-probs and entropy against Hugging Face one at a
time and writes ``parity_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.hf_reference import diff_stats
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput


LENGTHS = (1, 2, 3, 5, 63, 64, 65, 127, 128, 129, 300, 1000)
def conv1d_fla_fused_silu(x_TC, weight_CW, packed, splits=None):
    """fla's conv with SiLU inside the kernel (float32, one rounding), kept here to measure what
    the separate bf16 SiLU step changes."""
    from model_runtime.kernels.conv import _fla_conv, _split

    y = _fla_conv()(x=x_TC.unsqueeze(0), weight=weight_CW, bias=None, activation="silu",
                    cu_seqlens=packed.cu_seqlens_long, cu_seqlens_cpu=packed.cu_seqlens_host_long)
    return _split((y[0] if isinstance(y, tuple) else y)[0], splits)


def register_probe_kernels() -> None:
    from model_runtime.kernels.registry import REGISTRY

    REGISTRY["conv1d"]["fla_fused_silu"] = conv1d_fla_fused_silu


HF_LIKE = {"conv1d": "reference", "attention": "sdpa", "elementwise": "eager", "head": "torch"}
VARIANTS = {
    "default": {},
    "conv1d=reference": {"conv1d": "reference"},
    "conv1d=fla_fused_silu": {"conv1d": "fla_fused_silu"},
    "elementwise=eager": {"elementwise": "eager"},
    "head=torch": {"head": "torch"},
    "hf-like (all four)": HF_LIKE,
    "hf-like + gdn=reference": {**HF_LIKE, "linear_attention": "reference"},
}


def cuda_only(overrides: dict) -> bool:
    """Whether a variant needs CUDA: a backend the registry marks so, or this probe's own kernel."""
    from model_runtime.kernels.registry import CUDA_ONLY

    return bool((CUDA_ONLY | {"fla_fused_silu"}) & set(overrides.values()))


# The variants whose isolation (each sequence alone against the packed row) is measured too.
ISOLATION_VARIANTS = ("default", "hf-like (all four)")


def first_divergence(scorer, seqs, victim_index: int = -2, limit: int = 8) -> dict:
    """Which modules' outputs differ for one sequence scored alone and first in a packed row.

    Every module's output is captured in both runs (forward hooks) and the victim's tokens
    compared; the first ``limit`` modules, in call order, whose victim rows differ are listed
    with their max |difference|. An op whose arithmetic depends on the row's size shows up
    here first.
    """
    victim = seqs[victim_index]
    others = [s for i, s in enumerate(seqs) if i != victim_index % len(seqs)]
    n = victim.length
    model = scorer.loaded.model
    captured: dict[str, list] = {"alone": [], "packed": []}
    mode = ["alone"]

    def hook(name):
        def fn(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor) or out.dim() == 0:
                return
            # The token dimension: the first whose size is this run's padded row length.
            dim = next((d for d in range(out.dim()) if out.shape[d] >= n and out.shape[d] % 8 == 0), None)
            if dim is None:
                return
            captured[mode[0]].append((name, out.narrow(dim, 0, n).detach().float().clone()))
        return fn

    handles = [m.register_forward_hook(hook(name or "model")) for name, m in model.named_modules()]
    try:
        scorer.score_row([victim])
        mode[0] = "packed"
        scorer.score_row([victim] + others)
    finally:
        for h in handles:
            h.remove()
    found = []
    for (name, a), (name_b, b) in zip(captured["alone"], captured["packed"]):
        if name != name_b or a.shape != b.shape:
            found.append({"module": name, "note": f"call order or shape differs ({name_b}, {tuple(a.shape)} vs {tuple(b.shape)})"})
            break
        d = float((a - b).abs().max())
        if d > 0:
            found.append({"module": name, "max_abs_diff": d, "scale": float(a.abs().max())})
            if len(found) >= limit:
                break
    return {"victim_length": n, "modules_compared": min(len(captured["alone"]), len(captured["packed"])),
            "first_differing": found}


def make_batch(vocab: int, seed: int) -> list[SequenceInput]:
    rng = np.random.default_rng(seed)
    return [SequenceInput(rng.integers(0, vocab, size=n), score_from=1) for n in LENGTHS]


def scores(results) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(r.logprobs, r.entropy) for r in results]


class CheckpointModel:
    """A saved tiny checkpoint: packscore loads it per variant, Hugging Face once."""

    def __init__(self, kind: str, directory: Path, device: str):
        from tests.checkpoints import save_checkpoint

        self.path = save_checkpoint(kind, directory / kind)
        self.name = f"checkpoint {kind}"
        self.device = device

    def hf(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.bfloat16).to(self.device).eval()

    def ours(self, overrides):
        from model_runtime.scoring.loading import load_model

        return load_model(str(self.path), device=self.device, dtype="bfloat16", allow_slow_kernels=True,
                          kernel_overrides=overrides)


class SliceModel:
    """The first layers of a preset; the seeded draw gives every variant the same weights."""

    def __init__(self, preset: str, num_layers: int):
        self.preset, self.num_layers = preset, num_layers
        self.device = "cuda"
        self.name = f"{preset}[:{num_layers}]"
        self._twin = None

    def hf(self):
        from bench.hf_reference import build_twin

        self._twin = build_twin(self.preset, num_layers=self.num_layers)
        self._hf_ctx = self._twin.hf()
        return self._hf_ctx.__enter__()

    def drop_hf(self):
        self._hf_ctx.__exit__(None, None, None)
        self._twin = None

    def ours(self, overrides):
        from bench.hf_reference import build_twin

        return build_twin(self.preset, num_layers=self.num_layers, kernel_overrides=overrides).loaded


def probe(model, seed: int) -> dict:
    from bench.hf_reference import score_padded, score_single, to_numpy

    hf = model.hf()
    vocab = hf.config.get_text_config().vocab_size
    seqs = make_batch(vocab, seed)
    device = model.device
    single = to_numpy(score_single(hf, seqs, device))
    padded = to_numpy(score_padded(hf, seqs, device, 4096))
    lm_sum = float(hf.lm_head.weight.float().sum())
    result = {"hf padded vs hf single": diff_stats(padded, single)}
    if isinstance(model, SliceModel):
        model.drop_hf()
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    variants = {n: o for n, o in VARIANTS.items() if device == "cuda" or not cuda_only(o)}
    for name, overrides in variants.items():
        loaded = model.ours(overrides)
        assert abs(float(loaded.model.lm_head.weight.float().sum()) - lm_sum) < 1e-3, "variant drew other weights"
        scorer = Scorer(loaded, max_batch_tokens=4096)
        packed = scores(scorer.score_row(seqs))
        result[f"packscore {name}"] = diff_stats(packed, single)
        result[f"packscore {name}"]["kernels"] = str(loaded.backends.names)
        if name in ISOLATION_VARIANTS:
            alone = scores([scorer.score_row([s])[0] for s in seqs])
            label = "" if name == "default" else f" ({name})"
            result[f"packscore alone vs packed{label}"] = diff_stats(alone, packed)
            if device == "cuda":
                result[f"first divergence alone vs packed{label}"] = first_divergence(scorer, seqs)
        del scorer, loaded
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


def table(results: dict) -> str:
    lines = ["| model | comparison (against HF one at a time unless named) | log-prob mean | log-prob max | entropy mean | entropy max |",
             "| --- | --- | --- | --- | --- | --- |"]
    for model, rows in results.items():
        for name, d in rows.items():
            if name.startswith("first divergence"):
                first = d["first_differing"][:3]
                lines.append(f"| {model} | {name} | {first or 'none: every module equal'} | | | |")
                continue
            lines.append(f"| {model} | {name} | {d['logprob_mean']:.2e} | {d['logprob_max']:.2e} | "
                         f"{d['entropy_mean']:.2e} | {d['entropy_max']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--dry-run-cpu", action="store_true", help="the checkpoint model only, on the CPU")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run_cpu else "cuda"
    if device == "cuda":
        register_probe_kernels()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = [(CheckpointModel("qwen3_5", Path(tmp), device), 11)]
        if device == "cuda":
            models.append((SliceModel("qwen3.5-9b", 4), 12))
        for model, seed in models:
            results[model.name] = probe(model, seed)
            print(table({model.name: results[model.name]}), flush=True)
            (out / "parity_probe.json").write_text(json.dumps(results, indent=1))
    print(f"\n{table(results)}\nparity probe took {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
