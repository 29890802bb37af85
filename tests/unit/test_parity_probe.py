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

