"""The served default on a GPU: a real ``packscore serve`` on 127.0.0.1 shares a group's prompt
(prefix sharing is on by default there, cut by the measured kinds of row count) and answers
exactly what the same server with ``--no-prefix-sharing`` answers."""

import json

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


def _per_sequence(a_results, b_results, field):
    return {a["id"]: float(np.abs(a[field] - b[field]).max()) for a, b in zip(a_results, b_results)}


@pytest.mark.parametrize("caches", ["shared", "fresh"])
@pytest.mark.parametrize("kernels", [(), ("--kernels", "gate_projection=segment")], ids=["default", "segment"])
def test_the_default_server_shares_a_group_prompt_bit_for_bit(tmp_path, gpu_record, kernels, caches):
    """Two sharing servers and one ``--no-prefix-sharing`` server answer one request alike. With
    ``fresh`` caches each compiles into its own empty kernel cache, as on separate machines; with
    ``shared`` they use the run's cache, warm from earlier tests, as after a restart."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4096, 700).tolist()
    seqs = [{"id": f"m{i}", "input_ids": prompt + rng.integers(0, 4096, n).tolist(), "score_from": 700}
            for i, n in enumerate((1, 40, 300, 700, 701, 1500))]
    seqs += [{"id": "other", "input_ids": rng.integers(0, 4096, 900).tolist(), "score_from": 1}]
    body = {"sequences": seqs, "return_entropy": True}
    servers = []
    for name, flags in (("sharing", ()), ("sharing_again", ()), ("unshared", ("--no-prefix-sharing",))):
        (tmp_path / name).mkdir()
        cache = ("--triton-cache-dir", str(tmp_path / name / "kernels")) if caches == "fresh" else ()
        servers.append(ServerProcess(tmp_path / name, "--model", "tiny", "--device", "cuda", "--max-wait-ms", "2",
                                     *cache, *kernels, *flags))
    try:
        ready = [s.wait_ready(timeout=300) for s in servers]
        got = [post(s.url, body) for s in ready]
        assert all(r.status_code == 200 for r in got), [r.text[:300] for r in got]
        shared, again, plain = (decode(r, 0) for r in got)
        d, e = _per_sequence(shared, plain, "logprobs"), _per_sequence(shared, plain, "entropy")
        between = _per_sequence(shared, again, "logprobs")
        saved = [_saved(s.url) for s in ready]
        gpu_record("served default shares a prompt", kernels=" ".join(kernels) or "default", caches=caches,
                   logprob_max=max(d.values()), entropy_max=max(e.values()), logprob_max_between_sharing_servers=max(between.values()),
                   per_sequence=json.dumps(d), tokens_saved=saved[0], tokens_saved_unshared=saved[2])
        assert saved[0] > 0 and saved[2] == 0, f"tokens saved: default {saved[0]}, --no-prefix-sharing {saved[2]}"
        assert max(between.values()) == 0.0, f"two sharing servers differ: max |dlogp| per sequence {between}"
        assert max(d.values()) == 0.0 and max(e.values()) == 0.0, (
            f"shared vs unshared: max |dlogp| per sequence {d}, max |dentropy| {max(e.values()):.3e}; expected 0")
    finally:
        for s in servers:
            s.stop()
