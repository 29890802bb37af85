"""bench/parity_probe.py on the CPU (its dry run): every variant loads, scores and is compared.

The probe itself is a GPU diagnostic; this keeps it from rotting between device sessions and
checks what must hold on any device: a sequence scores the same alone and packed.
"""

import json

from bench import parity_probe
from model_runtime.scoring.head import CPU_PACKED_TOLERANCE


def test_probe_dry_run_compares_every_variant(tmp_path, capsys):
    assert parity_probe.main(["--dry-run-cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "parity_probe.json").read_text())["checkpoint qwen3_5"]
    cpu_variants = [name for name, o in parity_probe.VARIANTS.items() if not parity_probe.cuda_only(o)]
    for name in cpu_variants:
        row = results[f"packscore {name}"]
        assert row["logprob_mean"] < 1e-2, f"{name}: mean |logprob diff| {row['logprob_mean']:.3e} against HF bf16"
    isolation = results["packscore alone vs packed"]
    # Not 0: CPU GEMM kernels are chosen by shape (CPU_PACKED_TOLERANCE says why).
    worst = max(isolation["logprob_max"], isolation["entropy_max"])
    assert worst <= CPU_PACKED_TOLERANCE, f"alone vs packed on CPU: max diff {worst:.3e} > tol {CPU_PACKED_TOLERANCE:.0e}: {isolation}"
    assert "| checkpoint qwen3_5 |" in capsys.readouterr().out


def test_hf_divergence_dry_run_lists_every_module(tmp_path, capsys):
    """bench/hf_divergence.py on the CPU (tiny preset, float32): the module table is complete and
    packscore's first module outputs equal Hugging Face's (the same weights, the same inputs)."""
    from bench import hf_divergence

    assert hf_divergence.main(["--dry-run-cpu", "--out", str(tmp_path), "--lengths", "40"]) == 0
    rows = json.loads((tmp_path / "hf_divergence.json").read_text())["length 40"]["modules"]
    by_name = {r["module"]: r for r in rows}
    assert by_name["model.embed_tokens"]["output_max_diff"] == 0.0
    assert by_name["model.layers.0.linear_attn.in_proj_qkv"]["output_max_diff"] == 0.0
    compared = [r for r in rows if "output_max_diff" in r]
    assert len(compared) > 40 and all(r["output_max_diff"] < 1e-4 for r in compared), "float32 CPU forwards drifted apart"
    assert "| model.norm |" in capsys.readouterr().out


def test_runner_probe_dry_run_times_every_runner(tmp_path):
    """bench/runner_probe.py on the CPU (tiny preset, a world of one gloo rank)."""
    from bench import runner_probe

    assert runner_probe.main(["--dry-run-cpu", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "runner_probe.json").read_text())["runs"]
    assert len(runs) == 5 and all(r["tokens_per_s"] > 0 for r in runs)
