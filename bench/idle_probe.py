"""Probe: where an idle 512-token request's extra time goes on the GPU (http-burst.json: the
server's forward 88 ms against 60 ms in process at 16k-token rows).

    python -m bench.idle_probe --out DIR

Times one 512-token sequence of the 9B (median of 20) in process with several idle gaps, on a
thread the way the scheduler runs it, and over HTTP (in-process uvicorn, client in a child
process), with nvidia-smi's SM clock beside each, and the device time of one forward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu_probes import GpuClocks
from bench.http_burst import IDLE_REPEATS, InProcessServer, _Warmed, idle_sequence

ROWS = 16384


def _ms(values) -> dict:
    return {"median_ms": float(np.median(values) * 1000), "p90_ms": float(np.percentile(values, 90) * 1000),
            "min_ms": float(np.min(values) * 1000)}


def timed_calls(call, gap_s: float) -> dict:
    out = []
    with GpuClocks() as clocks:
        for _ in range(IDLE_REPEATS):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    return {**_ms(out), "clocks": clocks.summary()}


def on_forward_thread(score, seq, gap_s: float) -> dict:
    """As the scheduler runs a row: an asyncio loop hands it to its forward thread and awaits it."""
    from service.scheduling.scheduler import _ForwardThread

    async def run() -> dict:
        thread = _ForwardThread("probe-forward")
        await thread.run(score, [seq])
        out = []
        with GpuClocks() as clocks:
            for _ in range(IDLE_REPEATS):
                await asyncio.sleep(gap_s)
                t0 = time.perf_counter()
                await thread.run(score, [seq])
                out.append(time.perf_counter() - t0)
        thread.stop()
        return {**_ms(out), "clocks": clocks.summary()}

    return asyncio.run(run())


def beside(work, interval: float, call, repeats: int = 2) -> dict:
    """``call`` timed while another thread runs ``work`` in a loop, at GIL switch ``interval``."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            work()

    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        out = []
        for _ in range(repeats):
            time.sleep(0.05)
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(before)
    return _ms(out)


def over_http(url: str, vocab: int, gap_s: float) -> dict:
    code = ("import asyncio, json, time\n"
            "import numpy as np\n"
            "from service.client import AsyncScoreClient\n"
            "from bench.http_burst import idle_sequence, _payload\n"
            f"seq = idle_sequence({vocab})\n"
            "async def main():\n"
            "    out = []\n"
            f"    async with AsyncScoreClient({url!r}, max_concurrency=1) as c:\n"
            "        await c.score(_payload([seq]))\n"
            f"        for _ in range({IDLE_REPEATS}):\n"
            f"            await asyncio.sleep({gap_s})\n"
            "            t0 = time.perf_counter()\n"
            "            await c.score(_payload([seq]))\n"
            "            out.append(time.perf_counter() - t0)\n"
            "    return out\n"
            "print(json.dumps(asyncio.run(main())))\n")
    with GpuClocks() as clocks:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return {**_ms(json.loads(done.stdout.strip().splitlines()[-1])), "clocks": clocks.summary()}


def device_time(score, seq) -> dict:
    """One forward's wall time against its kernels' device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    score([seq])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        score([seq])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    return {"wall_ms": wall * 1000, "kernel_ms": busy, "kernels": len(kernels)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3.5-9b")
    parser.add_argument("--gil-only", action="store_true", help="only the forward beside a thread holding the GIL")
    args = parser.parse_args(argv)
    from model_runtime.pool.ports import free_port
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer
    from service.settings import Settings

    loaded = load_model(args.model)
    settings = Settings(model=args.model, max_batch_tokens=ROWS, port=free_port(), log_level="warning")
    scorer = Scorer(loaded, max_batch_tokens=ROWS, prefix_min_tokens=settings.prefix_min_tokens_in_use)
    t0 = time.perf_counter()
    scorer.warm_up()
    out: dict = {"warm_up_s": time.perf_counter() - t0}
    seq = idle_sequence(loaded.vocab_size)
    results = out["results"] = {}

    def step(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # one probe's failure must not cost the others
            results[name] = f"failed: {type(exc).__name__}: {exc}"
        print(name, results[name], flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "idle-probe.json").write_text(json.dumps(out, indent=1))

    if not args.gil_only:
        idle_cases(step, scorer, seq, settings, loaded)
    gil_cases(step, scorer, seq)


def idle_cases(step, scorer, seq, settings, loaded) -> None:
    from model_runtime.scoring.backend import LocalBackend
    from service.http.app import create_app

    if torch.cuda.is_available():
        step("device_time", lambda: device_time(scorer.score, seq))
    for gap in (0.05, 0.2, 1.0):
        step(f"in_process_gap_{gap}", lambda: timed_calls(lambda: scorer.score([seq]), gap))
    step("in_process_score_row_gap_0.2", lambda: timed_calls(lambda: scorer.score_row([seq]), 0.2))
    step("forward_thread_gap_0.2", lambda: on_forward_thread(scorer.score_row, seq, 0.2))
    step("forward_thread_gap_0.05", lambda: on_forward_thread(scorer.score_row, seq, 0.05))
    backend = _Warmed(LocalBackend(scorer))
    with InProcessServer(create_app(settings, backend), settings) as server:
        step("http_gap_0.2", lambda: over_http(server.url, loaded.vocab_size, 0.2))
        step("http_gap_0.05", lambda: over_http(server.url, loaded.vocab_size, 0.05))


def gil_cases(step, scorer, seq) -> None:
    # Another thread holding the GIL beside a launch-bound forward: a pure-Python loop (handed the
    # GIL back every switch interval) and msgpack decoding 1 MiB bodies (C code holding it per call).
    import msgpack

    body = msgpack.packb({"sequences": [{"input_ids": list(range(4096))} for _ in range(64)]})

    def python_loop():
        sum(range(1000))

    def decode():
        msgpack.unpackb(body)

    for name, work in (("python_loop", python_loop), ("msgpack_decode", decode)):
        for interval in (0.005, 0.0005):
            step(f"beside_{name}_switch_{interval}", lambda: beside(work, interval, lambda: scorer.score([seq])))


if __name__ == "__main__":
    main()
