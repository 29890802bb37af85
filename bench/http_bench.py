"""End-to-end tokens/s through HTTP at saturation versus the in-process scorer, and the cost of
JSON versus msgpack for 100k scored tokens.

    .venv/bin/python bench/http_bench.py                       # tiny model, CPU, a few minutes
    .venv/bin/python bench/http_bench.py --model qwen3.5-9b --max-batch-tokens 32768  # on a GPU

Throughput: the same GRPO-style workload (bench/workload.py, shortened for the CPU by default)
is scored (a) in this process by ``Scorer.score`` and (b) through a real ``packscore serve``
process by ``AsyncScoreClient`` (msgpack) with enough concurrent requests to keep the admission
queue non-empty. Each mode runs ``--repeats`` times, alternating, and the best run of each
counts (the machine may be shared). The ratio (b) / (a) is the HTTP efficiency; the target,
measured on a GPU under a trainer's burst by bench/http_burst.py, is at least 0.95.

Encodings: a response holding 100k scored positions (logprobs + entropy) and the matching
request are encoded and decoded by the server's and the client's own code paths.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.workload import WorkloadSpec, describe, grpo_workload  # noqa: E402


def in_process_tokens_per_s(scorer, sequences) -> float:
    started = time.perf_counter()
    scorer.score(sequences)
    return sum(s.length for s in sequences) / (time.perf_counter() - started)


def forward_totals(url: str) -> dict[str, float]:
    """The server's running totals of its forwards, from /metrics: ``seconds``, ``count`` (rows)
    and ``tokens``, summed over served models. The difference of two readings describes the forwards
    in between."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"packscore_forward_seconds_sum": "seconds", "packscore_forward_seconds_count": "count",
             "packscore_batch_tokens_sum": "tokens"}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in names:
                found[names[sample.name]] = found.get(names[sample.name], 0.0) + sample.value
    missing = set(names.values()) - set(found)
    if missing:
        raise RuntimeError(f"/metrics lacks {sorted(missing)}")
    return found


async def _http_run(url: str, sequences, per_request: int, concurrency: int) -> tuple[float, float]:
    """(tokens/s, fraction of the wall time the server spent in forwards)."""
    from packscore_client import AsyncScoreClient

    payload = [{"input_ids": s.input_ids, "score_from": s.score_from} for s in sequences]
    parts = [payload[i : i + per_request] for i in range(0, len(payload), per_request)]
    next_part = iter(range(len(parts)))
    async with AsyncScoreClient(url, max_concurrency=1, timeout_s=3600) as client:
        await client.score(payload[:1])  # limits discovered, connection open

        async def worker():
            for i in next_part:
                await client.score(parts[i], return_entropy=True)

        busy = forward_totals(url)["seconds"]
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        busy = forward_totals(url)["seconds"] - busy
    return sum(s.length for s in sequences) / elapsed, busy / elapsed


def start_server(model: str, max_batch_tokens: int, max_wait_ms: float = 5.0, extra: tuple[str, ...] = ()):
    """``packscore serve`` for ``model`` with the benchmark's batching options."""
    from service.local_server import LocalServer

    return LocalServer(["--model", model, "--max-batch-tokens", str(max_batch_tokens),
                        "--max-wait-ms", str(max_wait_ms), "--log-level", "warning", *extra])


def encoding_costs(scored_tokens: int = 100_000, sequence_length: int = 1000, repeats: int = 5) -> dict:
    """Milliseconds per step for JSON and msgpack (best of ``repeats``), and bytes on the wire."""
    import httpx

    from model_runtime.types import SequenceInput
    from packscore_client.protocol import Protocol, as_seq
    from service.http.encoding import decode_body, encode_score_response
    from service.http.validation import Limits, parse_score_request

    rng = np.random.default_rng(0)
    n = scored_tokens // sequence_length
    results = [
        {"id": f"s{i}", "logprobs": -rng.random(sequence_length, dtype=np.float32) * 10,
         "entropy": rng.random(sequence_length, dtype=np.float32) * 5}
        for i in range(n)
    ]
    body = {"model": "m", "weights_version": "v", "results": results,
            "usage": {"input_tokens": n * (sequence_length + 1), "scored_tokens": scored_tokens}}
    sequences = [SequenceInput(rng.integers(0, 248_320, sequence_length + 1)) for _ in range(n)]
    limits = Limits(248_320, 1 << 20, 1 << 20, 1 << 30, 1 << 30)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1000

    out = {}
    for encoding, media in (("json", "application/json"), ("msgpack", "application/msgpack")):
        protocol = Protocol("http://x", None, encoding, 1.0, None, None, None)
        seqs = [as_seq({"input_ids": s.input_ids}) for s in sequences]
        request = protocol.body(seqs, {"temperature": 1.0, "return_entropy": True, "top_k": 0})
        response_bytes = encode_score_response(body, encoding)
        response = httpx.Response(200, content=response_bytes, headers={"content-type": media})
        out[encoding] = {
            "request encode (client)": best(lambda: protocol.body(seqs, {"temperature": 1.0})),
            "request decode + validate (server)": best(
                lambda: parse_score_request(decode_body(request, encoding), limits, "m")),
            "response encode (server)": best(lambda: encode_score_response(body, encoding)),
            "response decode (client)": best(lambda: protocol.parse(response, 0, seqs)),
            "request bytes": len(request),
            "response bytes": len(response_bytes),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--sequences", type=int, default=48, help="workload size (a multiple of 8)")
    parser.add_argument("--prompt-median", type=float, default=150.0)
    parser.add_argument("--response-median", type=float, default=350.0)
    parser.add_argument("--per-request", type=int, default=8, help="sequences per HTTP request")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each mode; the best counts")
    args = parser.parse_args()

    import torch

    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    loaded = load_model(args.model)
    spec = WorkloadSpec(num_sequences=args.sequences, prompt_median=args.prompt_median,
                        response_median=args.response_median, prompt_clip=(16, 2048), response_clip=(16, 4096))
    sequences = grpo_workload(loaded.vocab_size, spec)
    info = describe(sequences)
    scorer = Scorer(loaded, max_batch_tokens=args.max_batch_tokens)
    scorer.warm_up()
    scorer.score(sequences[:8])

    server = start_server(args.model, args.max_batch_tokens, args.max_wait_ms)
    try:
        server.wait_ready()
        local, http, busy = [], [], []
        for _ in range(args.repeats):
            local.append(in_process_tokens_per_s(scorer, sequences))
            rate, fraction = asyncio.run(_http_run(server.url, sequences, args.per_request, args.concurrency))
            http.append(rate)
            busy.append(fraction)
    finally:
        server.stop(timeout=120)
    costs = encoding_costs()

    print(f"\nmodel {args.model} on {loaded.device} ({loaded.dtype_name}), torch threads {torch.get_num_threads()}, "
          f"max_batch_tokens {args.max_batch_tokens}")
    print(f"workload: {info['sequences']} sequences, {info['tokens']} tokens (median {info['median_length']:.0f}, "
          f"max {info['max_length']}), {info['scored_tokens']} scored; HTTP: {args.per_request} sequences per "
          f"request, {args.concurrency} in flight, msgpack\n")
    print(f"| path | tokens/s, best of {args.repeats} | median | runs |")
    print("| --- | --- | --- | --- |")
    for name, runs in (("in-process `Scorer.score`", local), ("HTTP, `AsyncScoreClient`", http)):
        print(f"| {name} | {max(runs):,.0f} | {np.median(runs):,.0f} | {', '.join(f'{v:,.0f}' for v in runs)} |")
    print(f"| **ratio HTTP / in-process** | **{max(http) / max(local):.3f}** | "
          f"**{np.median(http) / np.median(local):.3f}** | |\n")
    print(f"Server time spent in forwards during the HTTP runs: {', '.join(f'{b:.1%}' for b in busy)} of the wall time.\n")
    print("| 100k scored tokens (1k per sequence, entropy on) | JSON | msgpack |")
    print("| --- | --- | --- |")
    for key in costs["json"]:
        j, m = costs["json"][key], costs["msgpack"][key]
        if key.endswith("bytes"):
            print(f"| {key} | {j / 1e6:.2f} MB | {m / 1e6:.2f} MB |")
        else:
            print(f"| {key} | {j:.1f} ms | {m:.1f} ms |")
    total = {e: sum(v for k, v in costs[e].items() if not k.endswith("bytes")) for e in costs}
    print(f"| **total** | **{total['json']:.1f} ms** | **{total['msgpack']:.1f} ms** |")


if __name__ == "__main__":
    main()
