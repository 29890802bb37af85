"""bench/http_burst.py's simulated H200 server: it answers as a served model does, and its rows
cost what they run."""

from pathlib import Path

import numpy as np

from bench.http_burst import forward_seconds, simulated_server
from model_runtime.types import SequenceInput
from packscore_client import ScoreClient

REPO = Path(__file__).resolve().parents[2]


def test_the_simulated_server_scores_by_the_version_it_serves():
    # a result named by another version than the one served would be scored again, then refused
    server = simulated_server(REPO, 1, 16384, 0.01, ("--prefix-sharing",))
    try:
        with ScoreClient(server.url, retry_timeout_s=5) as client:
            (result,) = client.score([list(range(1, 300))])
    finally:
        server.stop(timeout=30)
    assert result.weights_version == "simulated#1" and result.logprobs.shape == (298,)


def test_a_simulated_row_with_a_shared_prompt_costs_the_tokens_it_runs():
    prompt = np.arange(1, 1001)
    group = [SequenceInput(np.concatenate([prompt, np.full(2000, k + 1)])) for k in range(8)]
    shared, whole = forward_seconds(group, 64), forward_seconds(group, 0)
    assert shared < 0.8 * whole, (shared, whole)  # 7 of the 8 prompts (7 x 960 tokens) not run
