"""HTTP efficiency under a trainer's burst, and idle latency: in process against over HTTP.

    python -m bench.http_burst --mode gpu --out DIR          # one GPU, the 9B shape, 16k and 64k rows (~4 min)
    python -m bench.http_burst --mode simulated --out DIR    # CPU: simulated pools of 1, 2, 4, 8 H200s (~4 min)

Workload: bench/workload.py's RL mix (256 sequences, 810,801 tokens), sent as a trainer sends a
step's batch: 8 concurrent requests of 32 sequences through the bundled AsyncScoreClient
(msgpack), which honours Retry-After. The server runs with default flags except the row size.

- gpu: the qwen3.5-9b preset on one GPU. In process: ``Scorer.score`` of the whole workload
  (first-fit-decreasing rows of the budget). Over HTTP: ``create_app`` + uvicorn in this process,
  serving the same warm scorer (its warm-up already done), the client in a child process
  (``--model tiny --sequences 8`` runs this path on the CPU, as a dry run).
- simulated: a backend whose forwards sleep for as long as the 9B takes on an H200 for that
  row (the cost model below), ``concurrency`` = GPUs; the real scheduler, server, client and
  wire. In process: the better of the first-fit-decreasing rows run by GPUs-many threads and
  the server's scheduler driven directly with the burst's requests. Over HTTP:
  ``packscore serve`` with that backend in a child process. ``--before-tree DIR`` also runs the
  server from another source tree (the admission before docs/admission.md), for comparison.
  Each measurement runs ``--repeats`` times and the best counts (this machine may be shared).

Idle latency: one 512-token sequence, the server idle, after the burst: 20 calls of
``Scorer.score`` (or of one simulated forward) in process and 20 requests over HTTP from the
client process, alternating (in process, HTTP, in process, ...), each after 0.2 s idle, so both
sides meet the GPU in the same state; medians, their ratio, and the server's own forward time
(/metrics). A call in process waits for the HTTP answer before it, and in the gpu mode takes the
lock the server's forwards hold, so it never overlaps one.

Cost model of one forward of the 9B on one H200 (bench/results/h200-2026-11-30.json: 810,801
tokens in 21.9 s at 64k rows, 36.5k tokens/s at 16k rows, 61 ms for one 512-token sequence):

    seconds = max(0.060, 0.0075 + tokens / 37,900 + 1.12e-10 * sum(length**2))

37.9k tokens/s is the matmul rate (linear layers and head at the measured 584 TFLOP/s), the
quadratic term is causal attention (8 layers of width 4096 at that rate), 7.5 ms per forward
fits the 16k-row figure, and 60 ms is the floor of a small forward (kernel launches).

Writes DIR/http-burst.json (merged into an existing file: each mode updates its own part) and
DIR/http-burst.md, and prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script (bench/http_burst.py serve-sim ...): the tree on PYTHONPATH serves
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.workload import WorkloadSpec, describe, grpo_workload  # noqa: E402

VOCAB = 248_320
REQUESTS, PER_REQUEST = 8, 32
IDLE_LENGTH, IDLE_REPEATS = 512, 20
PREFIX_MIN_TOKENS = 64  # the served default
IDLE_GAP_S = 0.2  # between idle requests, on both sides: the same idle GPU and host before each
GPU_COUNTS = (1, 2, 4, 8)

# The cost model (see the module docstring).
FLOOR_S, FIXED_S, TOKENS_PER_S, ATTENTION_S_PER_L2 = 0.060, 0.0075, 37_900.0, 1.12e-10


def forward_seconds(sequences, prefix_min_tokens: int = 0) -> float:
    """The cost model's time for one row; with prefix sharing the body runs a shared prompt once
    (every member of a group sharing it), attention still over whole sequences."""
    from model_runtime.scoring.prefix import RowTokens

    lengths = np.asarray([s.length for s in sequences], dtype=np.float64)
    run = RowTokens(prefix_min_tokens)
    for s in sequences:
        run.add(s.input_ids)
    return max(FLOOR_S, FIXED_S + run.total / TOKENS_PER_S + ATTENTION_S_PER_L2 * float(np.square(lengths).sum()))


class SimulatedH200Backend:
    """A ScoringBackend whose forwards take as long as the 9B's on ``gpus`` H200s (sleeping)."""

    prefix_rounding = None  # every member of a group shares its prompt

    def __init__(self, gpus: int, row_tokens: int, time_scale: float = 1.0, prefix_min_tokens: int = 0):
        from model_runtime.scoring.backend import ModelInfo

        self.info = ModelInfo(
            name="qwen3.5-9b-simulated", architecture="qwen3_5", vocab_size=VOCAB, max_model_len=262_144,
            dtype="bfloat16", device="simulated-h200", weights_version="simulated#1",
            kernels={"linear_attention": "simulated", "conv1d": "simulated", "attention": "simulated"},
            parallel={"world_size": gpus, "dp": gpus, "sp": 1, "fsdp": False},
        )
        self.concurrency = gpus
        self.max_row_tokens = row_tokens
        self.time_scale = time_scale
        self.prefix_min_tokens = prefix_min_tokens

    def score_row(self, sequences):
        from service.testing import expected_scores

        started = time.perf_counter()
        out = [expected_scores(s, 0, self.info.weights_version) for s in sequences]  # named by the version served
        rest = forward_seconds(sequences, self.prefix_min_tokens) * self.time_scale - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        return out

    def warm_up(self) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


# ---- the client side -----------------------------------------------------------------------

def _payload(sequences) -> list[dict]:
    return [{"input_ids": np.asarray(s.input_ids), "score_from": s.score_from} for s in sequences]


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of the /metrics samples called ``name`` that carry ``labels`` (whatever others they have)."""
    import httpx

    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        if metric == name and all(w in label_text for w in wanted):
            total += float(value)
    return total


async def trainer_burst(url: str, sequences) -> dict:
    """8 concurrent requests of 32 sequences; tokens/s from the first send to the last answer."""
    from packscore_client import AsyncScoreClient

    payload = _payload(sequences)
    parts = [payload[i : i + PER_REQUEST] for i in range(0, len(payload), PER_REQUEST)]
    refused = _metric(url, "packscore_rejections_total", reason="queue_full")
    async with AsyncScoreClient(url, max_concurrency=1, timeout_s=3600, retry_timeout_s=3600) as client:
        await client.score(payload[:1], return_entropy=True)  # limits learnt, a connection open
        started = time.perf_counter()
        answers = await asyncio.gather(*(client.score(p, return_entropy=True) for p in parts))
        elapsed = time.perf_counter() - started
    assert sum(len(a) for a in answers) == len(payload)
    tokens = sum(s.length for s in sequences)
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed,
            "http_429": int(_metric(url, "packscore_rejections_total", reason="queue_full") - refused)}


async def idle_requests(client, url: str, seq, count: int) -> dict:
    """``count`` requests of one sequence to an idle server, each after IDLE_GAP_S: their seconds
    and wall-clock starts, and what the server spent of them in forwards and queue waits (sums,
    from /metrics)."""
    before = {name: _metric(url, name) for name in _SERVER_TIMES}
    seconds, starts = [], []
    for _ in range(count):
        await asyncio.sleep(IDLE_GAP_S)  # the server goes idle between requests
        starts.append(time.time())
        t0 = time.perf_counter()
        await client.score(_payload([seq]))
        seconds.append(time.perf_counter() - t0)
    after = {name: _metric(url, name) for name in _SERVER_TIMES}
    return {"seconds": seconds, "starts": starts, **{key: after[name] - before[name] for name, key in _SERVER_TIMES.items()}}


_SERVER_TIMES = {"packscore_forward_seconds_sum": "forward_s", "packscore_queue_wait_seconds_sum": "queue_wait_s"}


def idle_sequence(vocab: int = VOCAB):
    from model_runtime.types import SequenceInput

    rng = np.random.default_rng(1)
    return SequenceInput(rng.integers(0, vocab, IDLE_LENGTH), score_from=IDLE_LENGTH // 4)


def workload(num_sequences: int = 256, vocab: int = VOCAB):
    """bench/workload.py's RL mix (``num_sequences`` < 256 only for dry runs)."""
    return grpo_workload(vocab, WorkloadSpec(num_sequences=num_sequences))


async def client_session(url: str, sequences: int, vocab: int) -> None:
    """The burst (none with ``sequences`` 0), then one JSON line once the server is idle; then
    for each line N on stdin, N idle requests' figures as one JSON line, until stdin ends."""
    from packscore_client import AsyncScoreClient

    burst = await trainer_burst(url, workload(sequences, vocab)) if sequences else None
    seq = idle_sequence(vocab)
    async with AsyncScoreClient(url, max_concurrency=1) as client:
        await client.score(_payload([seq]))  # a connection open; answered, so the server is idle
        print(json.dumps({"burst": burst}), flush=True)
        while (line := await asyncio.to_thread(sys.stdin.readline)).strip():
            print(json.dumps(await idle_requests(client, url, seq, int(line))), flush=True)


def client_main(args) -> None:
    """``client --url U``: the burst and idle requests against a server (``client_session``)."""
    asyncio.run(client_session(args.url, args.sequences, args.vocab))


# ---- the server side -----------------------------------------------------------------------

def serve_sim_main(args, server_flags: list[str]) -> int:
    """``serve-sim --gpus N [serve flags]``: ``packscore serve`` with the simulated backend."""
    from service.cli import parse_settings
    from service.http.app import create_app
    from service.http.server import run_server

    _, settings = parse_settings(server_flags)  # "serve" and its options, as LocalServer passes them
    backend = SimulatedH200Backend(args.gpus, settings.max_batch_tokens, args.time_scale,
                                   settings.prefix_min_tokens_in_use)  # --prefix-sharing: rows cost what they run
    return run_server(create_app(settings, backend), settings)


class InProcessServer:
    """The service app under uvicorn in a thread of this process (the GPU mode shares its model)."""

    def __init__(self, app, settings):
        import uvicorn

        from service.http.server import uvicorn_config

        self.url = f"http://127.0.0.1:{settings.port}"
        self.server = uvicorn.Server(uvicorn_config(app, settings))
        self.thread = threading.Thread(target=self.server.run, name="bench-server", daemon=True)

    def __enter__(self) -> "InProcessServer":
        import httpx

        self.thread.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=30).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the in-process server did not get ready")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ClientProcess:
    """``client`` in a child process (in the server's process it would compete with the server
    for the GIL): ``ready`` is the burst's figures, ``idle(n)`` runs n idle requests."""

    def __init__(self, url: str, sequences: int, vocab: int):
        self.command = [sys.executable, "-m", "bench.http_burst", "client", "--url", url,
                        "--sequences", str(sequences), "--vocab", str(vocab)]

    def __enter__(self) -> "ClientProcess":
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, cwd=Path(__file__).resolve().parents[1])
        self.ready = self._read()
        return self

    def idle(self, count: int) -> dict:
        try:
            self.proc.stdin.write(f"{count}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the client ended: _read says why
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise RuntimeError(f"client failed ({self.proc.wait()}):\n{self.stderr.read()[-3000:]}")
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()  # a no-op once it exited
            self.stderr.close()


def idle_side_by_side(score, seq, client: ClientProcess, alone: threading.Lock | None = None,
                      pairs: int = IDLE_REPEATS) -> dict:
    """Idle requests of one sequence in pairs: ``score([seq])`` in this process, then one over HTTP
    from ``client``, each after IDLE_GAP_S, so that both sides meet the GPU in the same state (one
    side's 20 and then the other's, minutes apart, measured the GPU's drift as much as HTTP).
    ``alone``: a lock the server's forwards hold, taken around each call in process so that none
    overlaps a forward (the HTTP answer is in by then; ``server_busy`` counts the waits)."""
    local, http, busy, server = [], [], 0, dict.fromkeys(_SERVER_TIMES.values(), 0.0)
    for _ in range(pairs):
        time.sleep(IDLE_GAP_S)
        if alone is not None and not alone.acquire(blocking=False):
            busy += 1
            alone.acquire()
        try:
            start, t0 = time.time(), time.perf_counter()
            score([seq])
            local.append((start, time.perf_counter() - t0))
        finally:
            if alone is not None:
                alone.release()
        answer = client.idle(1)
        http += zip(answer["starts"], answer["seconds"])
        server = {key: server[key] + answer[key] for key in server}
    return {"in_process": local, "http": http, "server_busy": busy, **server}


def idle_figures(side: dict) -> dict:
    """The results' idle keys from ``idle_side_by_side``: medians (ms), their ratio, the median of
    each pair's ratio, 10th and 90th percentiles, the server's forward and queue wait (means)."""
    local, http = (np.asarray([s for _, s in side[k]]) for k in ("in_process", "http"))
    starts = [t for k in ("in_process", "http") for t, _ in side[k]]
    return {"idle_in_process_ms": _ms(local), "idle_http_ms": _ms(http), "idle_ratio": _ms(http) / _ms(local),
            "idle_ratio_paired": float(np.median(http / local)),
            "idle_in_process_p10_p90_ms": [float(v) * 1000 for v in np.percentile(local, (10, 90))],
            "idle_http_p10_p90_ms": [float(v) * 1000 for v in np.percentile(http, (10, 90))],
            "idle_server_forward_ms": side["forward_s"] / len(http) * 1000,
            "idle_server_queue_wait_ms": side["queue_wait_s"] / len(http) * 1000,
            "idle_pairs": len(http), "idle_window_s": max(starts) - min(starts), "idle_server_busy": side["server_busy"],
            "idle_samples_ms": {"in_process": [round(float(v) * 1000, 2) for v in local],
                                "http": [round(float(v) * 1000, 2) for v in http]}}


def _ms(values) -> float:
    return float(np.median(values) * 1000)


# ---- the modes -----------------------------------------------------------------------------

def gpu_mode(args) -> dict:
    import torch

    from model_runtime.scoring.backend import LocalBackend, favour_forward_threads
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer
    from model_runtime.pool.ports import free_port
    from service.http.app import create_app
    from service.settings import Settings

    favour_forward_threads()  # as packscore serve does, for both sides
    loaded = load_model(args.model)
    sequences = workload(args.sequences, loaded.vocab_size)
    tokens = sum(s.length for s in sequences)
    out = {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "workload": describe(sequences)}
    for rows in (65536, 16384):  # the larger first: its warm-up compiles and autotunes the most
        t0 = time.perf_counter()
        settings = Settings(model=args.model, max_batch_tokens=rows, port=free_port(), log_level="warning")
        # In process as the server scores: with its default prefix sharing.
        scorer = Scorer(loaded, max_batch_tokens=rows, prefix_min_tokens=settings.prefix_min_tokens_in_use)
        scorer.warm_up()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        scorer.score(sequences)
        local = tokens / (time.perf_counter() - t0)
        backend = _Warmed(LocalBackend(scorer))
        with InProcessServer(create_app(settings, backend), settings) as server, \
                ClientProcess(server.url, args.sequences, loaded.vocab_size) as client:
            burst = client.ready["burst"]
            idle = idle_side_by_side(scorer.score, idle_sequence(loaded.vocab_size), client, backend.forward_lock)
        out[f"rows_{rows}"] = {
            "ratio": burst["tokens_per_s"] / local,
            "in_process_tokens_per_s": local,
            "http_tokens_per_s": burst["tokens_per_s"],
            "http_429": burst["http_429"],
            **idle_figures(idle),
            "warm_up_s": warm,
        }
        print(f"rows {rows}: {out[f'rows_{rows}']}", flush=True)
    return out


class _Warmed:
    """A backend already warmed up in this process: the server's warm-up only builds what is kept
    per thread (SDPA's plans), on the server's forward thread."""

    def __init__(self, backend):
        self._backend = backend
        self.info, self.concurrency, self.max_row_tokens = backend.info, backend.concurrency, backend.max_row_tokens
        self.forward_lock = threading.Lock()  # held by each forward: the idle calls in process wait for it

    def score_row(self, sequences):
        with self.forward_lock:
            return self._backend.score_row(sequences)

    def warm_up(self) -> None:
        self._backend.scorer.warm_attention_plans()

    def is_alive(self) -> bool:
        return self._backend.is_alive()

    def close(self) -> None:
        self._backend.close()


def in_process_pool(sequences, gpus: int, rows: int, time_scale: float, prefix_min_tokens: int = 0) -> float:
    """Tokens/s of the first-fit-decreasing rows (``Scorer.score``'s) run by ``gpus`` simulated
    GPUs, each taking the next row."""
    from model_runtime.scoring.prefix import pack_groups_first_fit

    backend = SimulatedH200Backend(gpus, rows, time_scale, prefix_min_tokens)
    plan = pack_groups_first_fit(sequences, rows, prefix_min_tokens)  # plain first-fit decreasing without sharing
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=gpus) as pool:
        list(pool.map(lambda row: backend.score_row([sequences[i] for i in row]), plan))
    return sum(s.length for s in sequences) / (time.perf_counter() - t0)


def in_process_scheduler(sequences, gpus: int, rows: int, time_scale: float, prefix_min_tokens: int = 0) -> float:
    """Tokens/s of the server's own scheduler in this process, given the burst's 8 requests at once (no HTTP)."""
    from service.scheduling.scheduler import Scheduler
    from service.settings import Settings

    async def run() -> float:
        backend = SimulatedH200Backend(gpus, rows, time_scale, prefix_min_tokens)
        settings = Settings(max_batch_tokens=rows, prefix_sharing=bool(prefix_min_tokens),
                            prefix_min_tokens=prefix_min_tokens or Settings().prefix_min_tokens)
        scheduler = Scheduler.from_settings(backend, settings)
        await scheduler.start()
        parts = [sequences[i : i + PER_REQUEST] for i in range(0, len(sequences), PER_REQUEST)]
        t0 = time.perf_counter()

        async def one(part):
            ticket = await scheduler.submit_when_room(part)
            return await ticket.future

        await asyncio.gather(*(one(p) for p in parts))
        elapsed = time.perf_counter() - t0
        await scheduler.close()
        return sum(s.length for s in sequences) / elapsed

    return asyncio.run(run())


def simulated_server(tree: Path, gpus: int, rows: int, time_scale: float, flags: tuple[str, ...] = ()):
    from service.local_server import LocalServer

    script = Path(__file__).resolve()
    program = [sys.executable, str(script), "serve-sim", "--gpus", str(gpus), "--time-scale", str(time_scale)]
    env = {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    return LocalServer(["--max-batch-tokens", str(rows), "--log-level", "warning", *flags], env=env,
                       program=program).wait_ready(timeout=120)


def simulated_mode(args) -> dict:
    sequences = grpo_workload(VOCAB)
    rows = args.rows
    here = Path(__file__).resolve().parents[1]
    trees = {"after": here}
    if args.before_tree:
        trees["before"] = Path(args.before_tree).resolve()
    seq = idle_sequence()
    out: dict = {"cost_model": f"max({FLOOR_S}, {FIXED_S} + tokens / {TOKENS_PER_S:.0f} + {ATTENTION_S_PER_L2} * sum(L^2)) s",
                 "time_scale": args.time_scale, "rows": rows}
    sharing = PREFIX_MIN_TOKENS if args.prefix_sharing else 0
    flags = ("--prefix-sharing", "--prefix-min-tokens", str(PREFIX_MIN_TOKENS)) if sharing else ()
    out["prefix_sharing"] = bool(sharing)
    for gpus in args.gpus:
        # In process, the better of two: first-fit-decreasing rows handed to the GPUs in turn,
        # and the server's scheduler without HTTP (it balances the tail across GPUs better).
        ffd = max(in_process_pool(sequences, gpus, rows, args.time_scale, sharing) for _ in range(args.repeats))
        scheduled = max(in_process_scheduler(sequences, gpus, rows, args.time_scale, sharing) for _ in range(args.repeats))
        local = max(ffd, scheduled)
        entry = {"in_process_tokens_per_s": local, "in_process_ffd_tokens_per_s": ffd,
                 "in_process_scheduler_tokens_per_s": scheduled}
        for name, tree in trees.items():
            server = simulated_server(tree, gpus, rows, args.time_scale, flags)
            try:
                runs = [asyncio.run(trainer_burst(server.url, sequences)) for _ in range(args.repeats)]
                burst = max(runs, key=lambda r: r["tokens_per_s"])
                if gpus == 1:  # keys suffixed by the tree; idle_in_process_ms: the one beside "after"
                    backend = SimulatedH200Backend(1, rows, args.time_scale, sharing)
                    with ClientProcess(server.url, 0, VOCAB) as client:
                        idle = idle_figures(idle_side_by_side(backend.score_row, seq, client))
                    entry.update({f"{key}_{name}": value for key, value in idle.items()})
                    entry.setdefault("idle_in_process_ms", idle["idle_in_process_ms"])
            finally:
                server.stop(timeout=30)
            suffix = "" if name == "after" else "_before"
            entry[f"ratio{suffix}"] = burst["tokens_per_s"] / local
            entry[f"http_tokens_per_s{suffix}"] = burst["tokens_per_s"]
            entry[f"http_429{suffix}"] = burst["http_429"]
        out[f"gpus_{gpus}"] = entry
        print(f"{gpus} GPU(s): {entry}", flush=True)
    if not args.no_breakdown:
        from bench.http_burst_breakdown import latency_breakdown

        out["idle_breakdown_cpu"] = latency_breakdown(args.repeats)
        print(f"idle latency on this CPU: {out['idle_breakdown_cpu']}", flush=True)
    return out


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve-sim"]:
        parser = argparse.ArgumentParser(prog="http_burst serve-sim")
        parser.add_argument("--gpus", type=int, required=True)
        parser.add_argument("--time-scale", type=float, default=1.0)
        args, rest = parser.parse_known_args(argv[1:])
        sys.exit(serve_sim_main(args, rest))
    if argv[:1] == ["client"]:
        parser = argparse.ArgumentParser(prog="http_burst client")
        parser.add_argument("--url", required=True)
        parser.add_argument("--sequences", type=int, default=256, help="the burst's workload; 0: no burst")
        parser.add_argument("--vocab", type=int, default=VOCAB)
        client_main(parser.parse_args(argv[1:]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("gpu", "simulated"), required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--model", default="qwen3.5-9b", help="gpu mode: the model (preset or checkpoint)")
    parser.add_argument("--sequences", type=int, default=256, help="gpu mode: workload size (fewer only for a dry run)")
    parser.add_argument("--gpus", type=int, nargs="+", default=list(GPU_COUNTS), help="simulated mode: pool sizes")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated mode: multiplies every forward's time")
    parser.add_argument("--rows", type=int, default=16384, help="simulated mode: --max-batch-tokens of the server")
    parser.add_argument("--no-breakdown", action="store_true", help="simulated mode: skip the CPU idle-latency breakdown")
    parser.add_argument("--repeats", type=int, default=2, help="simulated mode: runs of each measurement; the best counts")
    parser.add_argument("--before-tree", default=None, help="simulated mode: also serve from this source tree")
    parser.add_argument("--prefix-sharing", action="store_true",
                        help="simulated mode: both sides share a group's prompt and rows cost the tokens they run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "http-burst.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    if args.mode == "gpu":
        gpu = gpu_mode(args)
        result["gpu"] = gpu
        result.pop("gpu_repeat", None)  # the repeat was of the run this one replaces
    else:
        sim = simulated_mode(args)
        key = "simulated_prefix_sharing" if args.prefix_sharing else "simulated"
        result[key] = {k: v["ratio"] for k, v in sim.items() if k.startswith("gpus_")}
        result[f"{key}_detail"] = sim
    path.write_text(json.dumps(result, indent=2) + "\n")
    from bench.http_burst_report import table

    text = table(result)
    (args.out / "http-burst.md").write_text(text + "\n")
    print(f"\nwrote {path}\n")
    print(text)


if __name__ == "__main__":
    main()
