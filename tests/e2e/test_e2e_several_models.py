"""Several models in one real server, as API.md's trainer meets them: each architecture and a hub id
named on the command line, ``model`` required among several (422) and checked (404), /v1/models and
/metrics per model, and every model's log-probs, entropy and top-k equal to transformers' own float32
forward through the HTTP path."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from tests.checkpoints import as_hub_cache
from tests.e2e.helpers import AUTH, ServerProcess, decode, post

REPO = "acme/tiny-reference"
ARCHITECTURES = {"policy": "qwen3_5", "moe": "qwen3_5_moe", "next": "qwen3_next", "reference": "qwen3_5"}


@pytest.fixture(scope="module")
def several(checkpoint_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("several")
    as_hub_cache(checkpoint_dir("qwen3_5"), tmp / "hf-home" / "hub", REPO)
    models = [f"policy={checkpoint_dir('qwen3_5')}", f"moe={checkpoint_dir('qwen3_5_moe')}",
              f"next={checkpoint_dir('qwen3_next')}", f"reference={REPO}"]
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf-home"), "HF_HUB_CACHE": str(tmp / "hf-home" / "hub")}
    server = ServerProcess(tmp, *[a for m in models for a in ("--model", m)], "--max-batch-tokens", "512", env=env)
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0, server.log()


def _error(response: httpx.Response, status: int, kind: str, param: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"type", "message", "param"}, body
    assert (body["error"]["type"], body["error"]["param"]) == (kind, param), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_model_is_required_among_several_and_an_unknown_one_is_404_in_either_encoding(several):
    sequences = [{"input_ids": [1, 2, 3]}]
    for encoding in ("json", "msgpack"):
        _error(post(several.url, {"sequences": sequences}, encoding=encoding), 422, "model_required", "model")
        _error(post(several.url, {"model": None, "sequences": sequences}, encoding=encoding), 422, "model_required",
               "model")
        _error(post(several.url, {"model": "Policy", "sequences": sequences}, encoding=encoding), 404,
               "model_not_found", "model")
    listed = httpx.get(several.url + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["architecture"]) for m in listed] == list(ARCHITECTURES.items()), listed


def test_every_model_scores_as_transformers_forward_and_is_counted_under_its_name(several, checkpoint_dir):
    import transformers

    rng = np.random.default_rng(11)
    sequences = []
    for i in range(4):
        length = int(rng.integers(2, 60))
        sequences.append({"id": f"s{i}", "input_ids": rng.integers(0, 512, length).tolist(),
                          "score_from": int(rng.integers(1, length + 1))})
    sequences.append({"id": "empty", "input_ids": [5], "score_from": 1})  # score_from == L: empty arrays
    temperature, k = 0.7, 3
    for name, kind in ARCHITECTURES.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir(kind), dtype=torch.float32).eval()
        for encoding in ("json", "msgpack"):
            body = {"model": name, "sequences": sequences, "temperature": temperature, "top_k": k}
            response = post(several.url, body, encoding=encoding)
            assert response.status_code == 200, response.text
            for sent, got in zip(sequences, decode(response, k), strict=True):
                ids, start = torch.tensor([sent["input_ids"]]), sent["score_from"]
                with torch.no_grad():
                    logp = torch.log_softmax(hf(ids).logits[0].float() / temperature, -1)[start - 1:-1]
                want = logp.gather(1, ids[0, start:, None])[:, 0]
                entropy = -(logp.exp() * logp).sum(-1)
                top = logp.topk(k, -1).values
                assert got["id"] == sent["id"]
                for field, expected in (("logprobs", want), ("entropy", entropy), ("top_k_logprobs", top)):
                    assert got[field].shape == tuple(expected.shape), (name, field)
                    np.testing.assert_allclose(got[field], expected.numpy(), atol=1e-5, rtol=0, err_msg=f"{name} {field}")
                chosen = logp.gather(1, torch.from_numpy(got["top_k_ids"].astype(np.int64))) if len(want) else top
                np.testing.assert_allclose(chosen.numpy(), top.numpy(), atol=1e-5, rtol=0)  # the ids of those values
    scored = 2 * sum(len(s["input_ids"]) - s["score_from"] for s in sequences)
    metrics = httpx.get(several.url + "/metrics", headers=AUTH).text
    for name in ARCHITECTURES:
        assert f'packscore_tokens_scored_total{{model="{name}"}} {float(scored)}' in metrics, name
