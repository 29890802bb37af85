"""A real server process with the tiny model: answers equal the in-process scorer (tiny preset and a
saved checkpoint, JSON and msgpack; a MoE checkpoint sharing a group's prompt with
``gate_projection=tiles``) and Hugging Face's own forward (a checkpoint of each architecture;
concurrent requests of different parameters packed together), 32 concurrent clients, auth,
metrics, /v1/models."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from packscore_client import ScoreClient
from tests.e2e.helpers import (API_KEY, AUTH, TINY_VOCAB, HuggingFaceReference, ServerProcess, assert_matches, decode,
                               post, random_sequences)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_tiny_preset_answers_equal_the_in_process_scorer(tiny_server, tiny_scorer, encoding):
    rng = np.random.default_rng(7)
    seqs = random_sequences(rng, 6, TINY_VOCAB, lengths=(2, 80)) + [{"id": "one", "input_ids": [5], "score_from": 1}]
    body = {"sequences": seqs, "temperature": 0.7, "top_k": 5, "return_entropy": True}
    response = post(tiny_server.url, body, encoding=encoding)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == f"application/{encoding}"
    assert_matches(decode(response, 5), seqs, tiny_scorer, temperature=0.7, top_k=5)
    # The other encoding for the answer, chosen by Accept.
    other = "application/json" if encoding == "msgpack" else "application/msgpack"
    response = post(tiny_server.url, {**body, "top_k": 0, "return_entropy": False}, encoding=encoding, accept=other)
    assert response.headers["content-type"] == other
    assert_matches(decode(response, 0), seqs, tiny_scorer, temperature=0.7, return_entropy=False)
    # An Accept that refuses the request's encoding (q=0) gets the other one.
    response = post(tiny_server.url, {**body, "top_k": 0}, encoding=encoding, accept=f"application/{encoding};q=0")
    assert response.status_code == 200 and response.headers["content-type"] == other, response.headers


def test_saved_checkpoint_answers_equal_the_in_process_scorer(checkpoint_dir, tmp_path):
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    path = checkpoint_dir("qwen3_5")
    server = ServerProcess(tmp_path, "--model", str(path), "--served-model-name", "ckpt", "--max-batch-tokens", "256")
    try:
        server.wait_ready()
        scorer = Scorer(load_model(str(path)), max_batch_tokens=4096)
        seqs = random_sequences(np.random.default_rng(3), 5, 512, lengths=(2, 80))
        for encoding in ("json", "msgpack"):
            response = post(server.url, {"sequences": seqs, "top_k": 3, "model": "ckpt"}, encoding=encoding)
            assert response.status_code == 200, response.text
            assert_matches(decode(response, 3), seqs, scorer, top_k=3)
        models = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
        assert (models["id"], models["architecture"], models["vocab_size"]) == ("ckpt", "qwen3_5", 512)
    finally:
        assert server.stop() == 0, server.log()


def test_every_architecture_answers_as_hugging_faces_own_forward(checkpoint_dir, tmp_path):
    """API.md's semantics as an acceptance client checks them: one server holding a checkpoint of
    each architecture, each answer against transformers' float32 forward of that checkpoint (not
    packscore's own scorer) at temperature 0.7, top_k 5, score_from anywhere (L included), in JSON
    and msgpack; usage counts every token; a sequence sent alone gets the same bits."""
    paths = {kind: checkpoint_dir(kind) for kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next")}
    models = [arg for kind, path in paths.items() for arg in ("--model", f"{kind}={path}")]
    # a budget of 128 tokens: the longest sequences get rows of their own
    server = ServerProcess(tmp_path, *models, "--max-batch-tokens", "128")
    try:
        server.wait_ready()
        seqs = random_sequences(np.random.default_rng(21), 6, 512, lengths=(2, 150)) + [{"id": "one", "input_ids": [7]}]
        usage = {"input_tokens": sum(len(s["input_ids"]) for s in seqs),
                 "scored_tokens": sum(len(s["input_ids"]) - s.get("score_from", 1) for s in seqs)}
        body = {"sequences": seqs, "temperature": 0.7, "top_k": 5}
        for kind, path in paths.items():
            reference = HuggingFaceReference(path)
            for encoding in ("json", "msgpack"):
                response = post(server.url, {**body, "model": kind}, encoding=encoding)
                assert response.status_code == 200, response.text
                answer = msgpack.unpackb(response.content) if encoding == "msgpack" else response.json()
                assert (answer["model"], answer["usage"]) == (kind, usage), (answer["model"], answer["usage"])
                together = decode(response, 5)
                assert_matches(together, seqs, reference, temperature=0.7, top_k=5)
            alone = decode(post(server.url, {**body, "model": kind, "sequences": seqs[3:4]}), 5)[0]
            for field, value in alone.items():
                np.testing.assert_array_equal(value, together[3][field], err_msg=f"{kind} {field} alone")
    finally:
        assert server.stop() == 0, server.log()


def test_every_member_shares_with_tiles_and_answers_as_unshared(checkpoint_dir, tmp_path):
    """``--kernels gate_projection=tiles --prefix-sharing`` on a MoE checkpoint (the router and shared
    gate go through the kernel too): a GRPO group of varied lengths shares its prompt, counted in the
    metrics, and the answers are the in-process unshared scorer's with the default kernels."""
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    path = checkpoint_dir("qwen3_5_moe")
    server = ServerProcess(tmp_path, "--model", str(path), "--kernels", "gate_projection=tiles", "--prefix-sharing",
                           "--max-batch-tokens", "4096")
    try:
        server.wait_ready()
        rng = np.random.default_rng(11)
        prompt = rng.integers(0, 512, 150).tolist()
        seqs = [{"id": f"m{i}", "input_ids": prompt + rng.integers(0, 512, n).tolist(), "score_from": 140}
                for i, n in enumerate((1, 9, 40, 77, 200))]
        seqs.append({"id": "other", "input_ids": rng.integers(0, 512, 90).tolist()})
        response = post(server.url, {"sequences": seqs, "top_k": 2})
        assert response.status_code == 200, response.text
        assert_matches(decode(response, 2), seqs, Scorer(load_model(str(path)), max_batch_tokens=4096), top_k=2)
        kernels = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["kernels"]
        assert kernels["gate_projection"] == "tiles", kernels
        metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
        saved = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("packscore_prefix_tokens_saved_total{")]
        assert saved and saved[0] == 4 * 128, f"prompt tokens not run: {saved}, expected 4 members x 128"
    finally:
        assert server.stop() == 0, server.log()


def test_concurrent_requests_with_their_own_parameters_share_forwards_and_answer_as_alone(checkpoint_dir, tmp_path):
    """Requests sent together, each with its own temperature, top_k, return_entropy, encoding and
    rollout_logprobs, are packed into shared forwards; each answer is Hugging Face's float32
    forward with that request's parameters, the same bits as the sequence sent alone, and its
    mismatch figures are API.md's formulas of its own log-probs."""
    path = checkpoint_dir("qwen3_5_moe")
    # one runner: while the first request's forward runs, the others gather in the next row
    server = ServerProcess(tmp_path, "--model", str(path), "--max-wait-ms", "200", "--max-batch-tokens", "4096")
    try:
        server.wait_ready()
        rng = np.random.default_rng(17)
        params = [(0.25, 20, True), (1.0, 0, False), (4.0, 1, True), (0.6, 5, False), (1.0, 3, True), (1.7, 0, True)]
        bodies = []
        for j, (temperature, top_k, entropy) in enumerate(params):
            seqs = random_sequences(rng, 2, 512, lengths=(1, 60))
            for s in seqs[: j % 2 + 1]:
                s["rollout_logprobs"] = rng.normal(-6, 1, len(s["input_ids"]) - s["score_from"]).tolist()
            bodies.append({"sequences": seqs, "temperature": temperature, "top_k": top_k, "return_entropy": entropy})
        encodings = ["msgpack" if j % 2 else "json" for j in range(len(bodies))]
        before = _forwards(server.url)
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b, e: post(server.url, b, encoding=e), bodies, encodings))
        forwards = _forwards(server.url) - before
        assert forwards < len(bodies), f"{forwards} forwards for {len(bodies)} requests: nothing was packed together"
        reference = HuggingFaceReference(path)
        for j, (body, encoding, answer) in enumerate(zip(bodies, encodings, answers)):
            assert answer.status_code == 200, answer.text
            temperature, top_k, entropy = body["temperature"], body["top_k"], body["return_entropy"]
            together = decode(answer, top_k)
            assert_matches(together, body["sequences"], reference, temperature=temperature, top_k=top_k,
                           return_entropy=entropy)
            raw = msgpack.unpackb(answer.content) if encoding == "msgpack" else answer.json()
            for i, (s, got, result) in enumerate(zip(body["sequences"], together, raw["results"])):
                if i == j % 2:  # one sequence a request: each sent alone waits out --max-wait-ms
                    alone = decode(post(server.url, {**body, "sequences": [s]}), top_k)[0]
                    assert alone.keys() == got.keys(), (alone.keys(), got.keys())
                    for field in got.keys() - {"id"}:
                        np.testing.assert_array_equal(got[field], alone[field],
                                                      err_msg=f"{s['id']} {field}: packed vs alone")
                assert ("mismatch" in result) == ("rollout_logprobs" in s), result.keys()
                if "rollout_logprobs" in s:
                    d = got["logprobs"].astype(np.float64) - np.asarray(s["rollout_logprobs"], np.float32)
                    want = {"mean_abs_diff": np.abs(d).mean() if d.size else 0.0,
                            "max_abs_diff": np.abs(d).max(initial=0.0),
                            "k3_kl": np.mean(np.expm1(d) - d) if d.size else 0.0}
                    assert result["mismatch"].keys() == want.keys(), result["mismatch"]
                    for key, value in want.items():
                        assert abs(result["mismatch"][key] - value) <= 1e-6 * max(1.0, abs(value)), \
                            f"{s['id']} {key}: {result['mismatch'][key]} vs {value} (rel tol 1e-6)"
    finally:
        assert server.stop() == 0, server.log()


def _forwards(url: str) -> float:
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith("packscore_forward_seconds_count{"):
            return float(line.split()[1])
    raise AssertionError("no packscore_forward_seconds_count")


def test_32_concurrent_clients_all_get_their_own_correct_answers(tiny_server, tiny_scorer):
    def one(i: int):
        rng = np.random.default_rng(100 + i)
        seqs = random_sequences(rng, 2, TINY_VOCAB, lengths=(2, 40))
        encoding = "msgpack" if i % 2 else "json"
        with ScoreClient(tiny_server.url, api_key=API_KEY, encoding=encoding, retry_timeout_s=60) as client:
            results = client.score(seqs, top_k=2)
        return seqs, [{"id": r.id, "logprobs": r.logprobs, "entropy": r.entropy, "top_k_ids": r.top_k_ids,
                       "top_k_logprobs": r.top_k_logprobs} for r in results]

    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(one, range(32)))
    for seqs, got in outcomes:
        assert_matches(got, seqs, tiny_scorer, top_k=2)


def test_auth_is_required_except_on_the_probes(tiny_server):
    body = {"sequences": [{"input_ids": [1, 2, 3]}]}
    assert post(tiny_server.url, body, headers={}).status_code == 401
    refused = post(tiny_server.url, body, headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
    assert post(tiny_server.url, body).status_code == 200
    assert httpx.get(tiny_server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(tiny_server.url + "/readyz").json()["status"] == "ready"
    for probe in ("/healthz", "/health", "/readyz"):  # load balancers that probe with HEAD
        head = httpx.head(tiny_server.url + probe)
        assert head.status_code == 200 and head.content == b"", (probe, head.status_code, head.content)
    for path in ("/metrics", "/v1/models"):
        assert httpx.get(tiny_server.url + path).status_code == 401
        assert httpx.head(tiny_server.url + path).status_code == 401
        head = httpx.head(tiny_server.url + path, headers=AUTH)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code, head.content)


def test_metrics_parse_with_the_prometheus_parser(tiny_server):
    post(tiny_server.url, {"sequences": [{"input_ids": [1, 2, 3]}]})
    text = httpx.get(tiny_server.url + "/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("packscore_") for name in families)
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert samples["packscore_ready"].value == 1
    assert samples["packscore_tokens_scored_total"].value >= 2
    info = samples["packscore_model_info"].labels
    assert (info["model"], info["architecture"], info["device"]) == ("tiny", "qwen3_5", "cpu")


def test_models_route(tiny_server):
    body = httpx.get(tiny_server.url + "/v1/models", headers=AUTH).json()
    (card,) = body["data"]
    assert card["id"] == "tiny" and card["vocab_size"] == TINY_VOCAB and card["dtype"] == "float32"
    assert card["parallel"] == {"world_size": 1, "dp": 1, "sp": 1, "fsdp": False}
    assert set(card["kernels"]) >= {"linear_attention", "conv1d", "attention"}
