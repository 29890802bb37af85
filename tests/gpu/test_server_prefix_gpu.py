"""The served default on a GPU: a real ``packscore serve`` on 127.0.0.1 shares a group's prompt
(prefix sharing is on by default there, cut by the measured kinds of row count) and answers
exactly what the same server with ``--no-prefix-sharing`` answers."""

import httpx
import numpy as np
import pytest
import torch

from tests.e2e.helpers import AUTH, ServerProcess, decode, post

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the served default differs on a GPU"),
]


def _saved(url: str) -> float:
    lines = [line for line in httpx.get(url + "/metrics", headers=AUTH, timeout=30).text.splitlines()
             if line.startswith("packscore_prefix_tokens_saved_total")]
    assert lines, "packscore_prefix_tokens_saved_total missing from /metrics"
    return sum(float(line.split()[-1]) for line in lines)


@pytest.mark.parametrize("kernels", [(), ("--kernels", "gate_projection=segment")], ids=["default", "segment"])
def test_the_default_server_shares_a_group_prompt_bit_for_bit(tmp_path, gpu_record, kernels):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4096, 700).tolist()
    seqs = [{"id": f"m{i}", "input_ids": prompt + rng.integers(0, 4096, n).tolist(), "score_from": 700}
            for i, n in enumerate((1, 40, 300, 700, 701, 1500))]
    seqs += [{"id": "other", "input_ids": rng.integers(0, 4096, 900).tolist(), "score_from": 1}]
    body = {"sequences": seqs, "return_entropy": True}
    servers = []
    for name, flags in (("default", ()), ("unshared", ("--no-prefix-sharing",))):
        (tmp_path / name).mkdir()
        servers.append(ServerProcess(tmp_path / name, "--model", "tiny", "--device", "cuda", "--max-wait-ms", "2",
                                     *kernels, *flags))
    try:
        default, unshared = (s.wait_ready(timeout=300) for s in servers)
        got = [post(s.url, body) for s in (default, unshared)]
        assert all(r.status_code == 200 for r in got), [r.text[:300] for r in got]
        shared, plain = (decode(r, 0) for r in got)
        d = max(float(np.abs(a["logprobs"] - b["logprobs"]).max()) for a, b in zip(shared, plain))
        e = max(float(np.abs(a["entropy"] - b["entropy"]).max()) for a, b in zip(shared, plain))
        saved = (_saved(default.url), _saved(unshared.url))
        gpu_record("served default shares a prompt", kernels=" ".join(kernels) or "default", logprob_max=d, entropy_max=e, tokens_saved=saved[0],
                   tokens_saved_unshared=saved[1])
        assert saved[0] > 0 and saved[1] == 0, f"tokens saved: default {saved[0]}, --no-prefix-sharing {saved[1]}"
        assert d == 0.0 and e == 0.0, f"shared vs unshared: max |dlogp| {d:.3e}, max |dentropy| {e:.3e}; expected 0"
    finally:
        for s in servers:
            s.stop()
