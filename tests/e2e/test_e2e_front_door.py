"""What users of vLLM, TGI and SGLang expect at the door, on a real server: a hub id served from an
offline Hugging Face cache with the numbers of its directory, /health without the key, a request
target in absolute form."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import orjson

from tests.checkpoints import as_hub_cache
from tests.e2e.helpers import (AUTH, ServerProcess, assert_matches, decode, fake_server, post, random_sequences,
                               read_until_closed)

REPO = "acme/tiny-qwen3.5"


def test_a_hub_id_is_served_from_the_offline_cache_with_the_numbers_of_its_directory(checkpoint_dir, tmp_path,
                                                                                    monkeypatch):
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    path = checkpoint_dir("qwen3_5")
    cache = tmp_path / "hf-home" / "hub"
    as_hub_cache(path, cache, REPO)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)  # it would win over HF_HOME
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}  # HF_HOME/hub is the cache searched
    server = ServerProcess(tmp_path, "--model", REPO, "--max-batch-tokens", "256", env=env)
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
        model = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
        assert (model["id"], model["vocab_size"]) == (REPO, 512), model
        seqs = random_sequences(np.random.default_rng(5), 5, 512, lengths=(2, 80))
        response = post(server.url, {"sequences": seqs, "model": REPO, "top_k": 2}, encoding="msgpack")
        assert response.status_code == 200, response.text
        assert_matches(decode(response, 2), seqs, Scorer(load_model(str(path)), max_batch_tokens=4096), top_k=2)
        assert f"resolving {REPO} (revision main) through the Hugging Face cache {cache}" in server.log()
    finally:
        assert server.stop() == 0, server.log()



def test_a_request_target_in_absolute_form_is_served_as_its_path(tmp_path):
    # RFC 9112 3.2.2: a server must accept `POST http://host/score`, as a client that believes it talks to a proxy sends it
    server = fake_server(tmp_path).wait_ready()
    body = b'{"sequences": [{"id": "a", "input_ids": [1, 2, 3], "score_from": 1}]}'
    answers = {}
    try:
        for target in (b"/score", f"http://127.0.0.1:{server.port}/score".encode(), b"HTTP://elsewhere/v1/score?x=1"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                raw, _ = read_until_closed(sock, 30)
            head, _, answer = raw.partition(b"\r\n\r\n")
            answers[target] = (head.split(b" ", 2)[1], orjson.loads(answer))
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    origin = answers.pop(b"/score")
    assert origin[0] == b"200", origin
    for target, answer in answers.items():
        assert answer == origin, (target, answer)
    # every route's 500 series is there at 0 from the start: none of route="other" may have counted
    counted = [line for line in metrics.splitlines()  # samples only: a HELP line may name the label too
               if not line.startswith("#") and 'route="other"' in line and float(line.rsplit(" ", 1)[1]) != 0]
    assert not counted, counted
