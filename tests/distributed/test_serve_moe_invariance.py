"""MoE checkpoints served with ``--world-size 2 --sp 2 --fsdp`` on 127.0.0.1: a sequence sent alone
gets the numbers it gets packed with others in one request (API.md: results do not depend on
packing), for qwen3_5_moe and qwen3_next. Float32 on CPU, where both kinds give the same numbers to the bit.
"""

import httpx
import numpy as np
import pytest

from model_runtime.scoring.head import CPU_PACKED_TOLERANCE
from service.local_server import LocalServer
from tests.e2e.helpers import packscore_command

TOL = CPU_PACKED_TOLERANCE  # README.md: within 1e-6 in float32 on the CPU, every architecture
LENGTHS = (3, 41, 120, 7, 1, 300, 64, 5, 200)  # one row of 741 tokens, cut by sp=2 inside sequences


@pytest.mark.parametrize("moe_kind", ["qwen3_5_moe", "qwen3_next"])
def test_a_sequence_alone_equals_it_packed(moe_kind, checkpoint_dir, tmp_path):
    server = LocalServer(
        ["--model", str(checkpoint_dir(moe_kind)), "--device", "cpu", "--world-size", "2", "--sp", "2", "--fsdp",
         "--max-batch-tokens", "1024", "--max-wait-ms", "2"],
        env={"PYTHONUNBUFFERED": "1"}, log_dir=tmp_path, program=packscore_command(),
    )
    try:
        server.wait_ready(timeout=300)
        rng = np.random.default_rng(0)
        seqs = [{"id": f"s{i}", "input_ids": rng.integers(0, 200, n).tolist(), "score_from": 1} for i, n in enumerate(LENGTHS)]
        with httpx.Client(base_url=server.url, timeout=120.0) as client:
            response = client.post("/score", json={"sequences": seqs})
            assert response.status_code == 200, response.text
            packed = response.json()["results"]
            worst = {"logprobs": 0.0, "entropy": 0.0}
            for seq, in_row in zip(seqs, packed):
                response = client.post("/score", json={"sequences": [seq]})
                assert response.status_code == 200, response.text
                alone = response.json()["results"][0]
                for name in worst:
                    diff = np.abs(np.array(alone[name], dtype=np.float64) - np.array(in_row[name], dtype=np.float64))
                    worst[name] = max(worst[name], float(diff.max(initial=0.0)))
    finally:
        server.stop(timeout=30)
    print(f"\n{moe_kind} alone vs packed, sp=2 + fsdp: {worst}")
    assert max(worst.values()) <= TOL, f"{moe_kind} alone vs packed: max |diff| {worst} > tol {TOL:.0e}"
