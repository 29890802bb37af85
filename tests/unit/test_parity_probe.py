"""bench/parity_probe.py on the CPU (its dry run): every variant loads, scores and is compared.

The probe itself is a GPU diagnostic; this keeps it from rotting between device sessions and
checks what must hold on any device: a sequence scores the same alone and packed.
"""

import json

from bench import parity_probe


def test_probe_dry_run_compares_every_variant(tmp_path, capsys):
    assert parity_probe.main(["--dry-run-cpu", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "parity_probe.json").read_text())["checkpoint qwen3_5"]
    cpu_variants = [name for name, o in parity_probe.VARIANTS.items() if not parity_probe.cuda_only(o)]
    for name in cpu_variants:
        row = results[f"packscore {name}"]
        assert row["logprob_mean"] < 1e-2, f"{name}: mean |logprob diff| {row['logprob_mean']:.3e} against HF bf16"
    isolation = results["packscore alone vs packed"]
    assert isolation["logprob_max"] == 0.0 and isolation["entropy_max"] == 0.0, f"alone vs packed on CPU: {isolation}"
    assert "| checkpoint qwen3_5 |" in capsys.readouterr().out

