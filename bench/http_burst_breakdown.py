"""Where an idle request's time goes on this CPU (bench/http_burst.py's simulated mode, unless
``--no-breakdown``): the tiny model in process and over HTTP side by side, a forward of no time
over HTTP, the scheduler's round trip, and the encodings."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.http_burst import (IDLE_GAP_S, IDLE_LENGTH, IDLE_REPEATS, VOCAB, ClientProcess, SimulatedH200Backend, _ms, _payload,
                              idle_figures, idle_sequence, idle_side_by_side, simulated_server)


def latency_breakdown(repeats: int) -> dict:
    """Where an idle request's time goes on this CPU: the tiny model in process and over HTTP,
    side by side (``idle_side_by_side``), and the parts of the difference (milliseconds, medians)."""
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer
    from packscore_client.protocol import Protocol, as_seq
    from service.http.encoding import decode_body, encode_score_response, result_record
    from service.http.validation import Limits, parse_score_request
    from service.local_server import LocalServer

    import torch

    torch.set_num_threads(1)  # as the server's OMP_NUM_THREADS=1: one core each on a small machine
    scorer = Scorer(load_model("tiny"))
    scorer.warm_up()
    tiny_seq = idle_sequence(scorer.loaded.vocab_size)
    server = LocalServer(["--model", "tiny", "--log-level", "warning"], env={"OMP_NUM_THREADS": "1"}).wait_ready()
    try:
        with ClientProcess(server.url, 0, scorer.loaded.vocab_size) as client:
            side = idle_figures(idle_side_by_side(scorer.score, tiny_seq, client))
    finally:
        server.stop(timeout=30)
    out = {"tiny_in_process_ms": side["idle_in_process_ms"], "tiny_http_ms": side["idle_http_ms"]}
    # The same request with a forward that takes no time: HTTP, server and scheduler overhead alone.
    server = simulated_server(Path(__file__).resolve().parents[1], 1, 16384, 0.0)
    try:
        with ClientProcess(server.url, 0, VOCAB) as client:
            out["zero_forward_http_ms"] = _ms(client.idle(IDLE_REPEATS)["seconds"])
    finally:
        server.stop(timeout=30)
    out["zero_forward_scheduler_ms"] = _scheduler_round_trip_ms(idle_sequence())
    # Encoding and validation of this request and its answer, both sides.
    protocol = Protocol("http://x", None, "msgpack", 1.0, None, None, None)
    options = {"temperature": 1.0, "return_entropy": True, "top_k": 0}
    sent = [as_seq(p) for p in _payload([tiny_seq])]
    body = protocol.body(sent, options)
    limits = Limits(4096, 1 << 20, 4096, 1 << 20, 1 << 26)
    scores = scorer.score([tiny_seq])
    answer = {"model": "m", "weights_version": "v", "results": [result_record(None, scores[0], return_entropy=True, top_k=0)],
              "usage": {"input_tokens": IDLE_LENGTH, "scored_tokens": 1}}
    encoded = encode_score_response(answer, "msgpack")
    import httpx

    response = httpx.Response(200, content=encoded, headers={"content-type": "application/msgpack"})

    def timed(fn) -> float:
        times = []
        for _ in range(repeats * 50):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return _ms(times)

    out["encoding_ms"] = (timed(lambda: protocol.body([as_seq(p) for p in _payload([tiny_seq])], options))
                          + timed(lambda: parse_score_request(decode_body(body, "msgpack"), limits, "m"))
                          + timed(lambda: encode_score_response(answer, "msgpack"))
                          + timed(lambda: protocol.parse(response, 0, sent)))
    return out


def _scheduler_round_trip_ms(seq) -> float:
    from service.scheduling.scheduler import Scheduler
    from service.settings import Settings

    async def run() -> list[float]:
        scheduler = Scheduler.from_settings(SimulatedH200Backend(1, 16384, 0.0), Settings())
        await scheduler.start()
        times = []
        for _ in range(IDLE_REPEATS):
            await asyncio.sleep(IDLE_GAP_S)
            t0 = time.perf_counter()
            await (await scheduler.submit_when_room([seq])).future
            times.append(time.perf_counter() - t0)
        await scheduler.close()
        return times

    return _ms(asyncio.run(run()))
