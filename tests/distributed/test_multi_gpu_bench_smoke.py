"""The multi-GPU run script works end to end (CPU processes, tiny model), so the GPU call does not
discover a broken script: it is the one command the multi-GPU issue's runs use."""

import json

from bench.multi_gpu import main


def test_multi_gpu_script_runs_every_phase_on_cpu(tmp_path):
    assert main(["--gpus", "2", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("multi_gpu-*-quick.json")
    data = json.loads(result.read_text())
    assert [row["sp"] for row in data["sp_scaling"]] == [1, 2]
    assert {row["run"] for row in data["fsdp"]} == {"tiny fsdp x2", "tiny replicas x2"}
    assert data["http"]["http_tokens_per_s"] > 0 and not data["errors"]
    # Where the time went: the server's forwards, read from its /metrics, beside the in-process pass's.
    assert data["http"]["server_rows"] > 0 and 0 < data["http"]["server_busy_fraction"] <= 1.0
    assert data["http"]["in_process_rows"] > 0 and 0 < data["http"]["in_process_busy_fraction"] <= 1.0


def test_pool_phase_with_pinned_kernels(tmp_path):
    """The A/B form of the script: the in-process pool alone, attention pinned."""
    assert main(["--gpus", "2", "--device", "cpu", "--quick", "--phases", "pool", "--kernels", "attention=sdpa",
                 "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("multi_gpu-*-quick-attention-sdpa.json")
    data = json.loads(result.read_text())
    assert data["pool"]["kernels"]["attention"] == "sdpa" and data["pool"]["tokens_per_s"] > 0
