"""bench/http_burst.py's simulated H200 server: it answers as a served model does, and its rows
cost what they run; the idle latency in process and over HTTP is measured side by side."""

import threading
import time
from pathlib import Path

import numpy as np

from bench.http_burst import (VOCAB, ClientProcess, SimulatedH200Backend, _Warmed, forward_seconds, idle_figures,
                              idle_sequence, idle_side_by_side, simulated_server)
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


def _timed(backend, calls):
    def score(sequences):
        start = time.time()
        out = backend.score_row(sequences)
        calls.append((start, time.time()))
        return out

    return score


def test_idle_requests_in_process_and_over_http_alternate_without_overlapping():
    # one side's requests and then the other's, minutes apart, compared the GPU's drift as much as HTTP
    server = simulated_server(REPO, 1, 16384, 0.1)  # a forward of 6 ms
    calls = []
    try:
        with ClientProcess(server.url, 0, VOCAB) as client:
            assert client.ready == {"burst": None}
            side = idle_side_by_side(_timed(SimulatedH200Backend(1, 16384, 0.1), calls), idle_sequence(), client, pairs=4)
    finally:
        server.stop(timeout=30)
    spans = sorted([(a, b, "in process") for a, b in calls] + [(t, t + s, "http") for t, s in side["http"]])
    assert [where for _, _, where in spans] == ["in process", "http"] * 4
    assert all(end <= start for (_, end, _), (start, _, _) in zip(spans, spans[1:])), spans
    figures = idle_figures(side)
    assert figures["idle_pairs"] == 4 and len(figures["idle_samples_ms"]["http"]) == 4
    assert 5.9 <= figures["idle_server_forward_ms"] < figures["idle_http_ms"], figures
    assert figures["idle_ratio"] == figures["idle_http_ms"] / figures["idle_in_process_ms"]
    assert figures["idle_window_s"] < 10 and figures["idle_server_busy"] == 0


def test_a_call_in_process_waits_for_the_forward_the_server_is_running():
    backend = _Warmed(type("Local", (), {"info": None, "concurrency": 1, "max_row_tokens": 16,
                                         "score_row": lambda self, s: time.sleep(0.5)})())
    server = simulated_server(REPO, 1, 16384, 0.1)
    calls = []
    try:
        with ClientProcess(server.url, 0, VOCAB) as client:
            forward = threading.Thread(target=backend.score_row, args=([],))
            forward.start()  # a forward of the in-process server, 0.5 s, under way when the pairs start
            started = time.time()
            side = idle_side_by_side(_timed(SimulatedH200Backend(1, 16384, 0.1), calls), idle_sequence(), client,
                                     backend.forward_lock, pairs=1)
            forward.join()
    finally:
        server.stop(timeout=30)
    assert side["server_busy"] == 1 and calls[0][0] >= started + 0.45, (calls, started)
