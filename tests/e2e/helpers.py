"""Helpers of the end-to-end tests: a real server process on 127.0.0.1, requests, comparisons."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import msgpack
import numpy as np
import orjson

from model_runtime.types import SequenceInput, SequenceScores
from service.local_server import LocalServer
from tests import warm_start

API_KEY = "e2e-secret"
TINY_VOCAB = 4096
TOL = 1e-4  # packed vs alone, float32 CPU: README.md's bound is 1e-6 (dense), 1e-5 (MoE)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAKE = [sys.executable, "-m", "tests.e2e.fake_server"]  # the real app and protocol over FakeBackend


def packscore_command() -> list[str]:
    """The installed ``packscore`` console script beside this interpreter, else ``python -m service.cli``."""
    script = Path(sys.executable).with_name("packscore")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


def fake_server(tmp_path, *args: str, env: dict | None = None, program: list[str] | None = None) -> LocalServer:
    """``packscore serve`` over FakeBackend (tests/e2e/fake_server.py), no API key; not started until ``wait_ready``."""
    return LocalServer(["--log-level", "warning", *args], env={"OMP_NUM_THREADS": "1", **(env or {})},
                       log_dir=tmp_path, program=program or FAKE)


class SplitStreamsServer(LocalServer):
    """``fake_server`` whose standard output goes to ``log_path`` and its standard error to ``err_path``."""

    def __init__(self, tmp_path: Path, *args: str, env: dict | None = None):
        self.err_path = Path(tmp_path) / f"stderr-{time.monotonic_ns()}.log"
        self._err = self.err_path.open("wb")
        super().__init__(["--log-level", "warning", *args], env={"OMP_NUM_THREADS": "1", **(env or {})},
                         log_dir=tmp_path, program=FAKE)

    def spawn(self, command, **options):  # LocalServer's, with standard error apart
        return LocalServer.spawn(command, **{**options, "stderr": self._err})

    def log(self) -> str:
        return f"standard output:\n{super().log()}\nstandard error:\n{self.err_path.read_text(errors='replace')[-5000:]}"

    def stop(self, timeout: float = 60.0) -> int:
        try:
            return super().stop(timeout)
        finally:
            self._err.close()


class ServerProcess(LocalServer):
    """One ``packscore serve`` process for a test; its log goes to a file shown when a test fails."""

    def __init__(self, tmp: Path, *args: str, api_key: str | None = API_KEY, env: dict[str, str] | None = None):
        env = {"OMP_NUM_THREADS": "1", **(env or {})}  # two cores in CI: one for the server, one for the test process
        if api_key:
            env["PACKSCORE_API_KEY"] = api_key
        super().__init__(args, env=env, log_dir=tmp)


REPO = Path(__file__).resolve().parents[2]


def run_watching_port(command: list[str], port: int | None, timeout: float = 120.0, env: dict[str, str] | None = None):
    """Runs the CLI with no ``PACKSCORE_*`` variables but ``env``'s; while it runs, keeps trying to
    connect to ``port``. Returns (code, output, connected). A ``port`` from ``tests.ports.held_port``
    stays the test's: a serve that reaches its bind exits 3 there instead of connected turning true."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    with tempfile.TemporaryFile() as log:
        proc = warm_start.popen(command, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        connected = False
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if port is not None:
                with socket.socket() as s:
                    s.settimeout(0.05)
                    connected |= s.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()  # our own child, by its handle
        proc.wait()
        log.seek(0)
        return proc.returncode, log.read().decode(errors="replace"), connected


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``limit_s`` passes), and when it closed (seconds from now)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - t0


def random_sequences(rng: np.random.Generator, n: int, vocab: int, lengths=(2, 120)) -> list[dict]:
    out = []
    for i in range(n):
        length = int(rng.integers(*lengths))
        out.append({"id": f"seq-{i}", "input_ids": rng.integers(0, vocab, length).tolist(),
                    "score_from": int(rng.integers(1, length + 1))})
    return out


def decode(response: httpx.Response, top_k: int) -> list[dict]:
    """Results of a /score answer as numpy arrays, whatever its encoding."""
    if response.headers["content-type"] == "application/msgpack":
        out = []
        for r in msgpack.unpackb(response.content)["results"]:
            d = {"id": r["id"], "logprobs": np.frombuffer(r["logprobs"], "<f4")}
            if "entropy" in r:
                d["entropy"] = np.frombuffer(r["entropy"], "<f4")
            if "top_k_ids" in r:
                d["top_k_ids"] = np.frombuffer(r["top_k_ids"], "<i4").reshape(-1, top_k)
                d["top_k_logprobs"] = np.frombuffer(r["top_k_logprobs"], "<f4").reshape(-1, top_k)
            out.append(d)
        return out
    out = []
    for r in response.json()["results"]:
        d = {"id": r["id"], "logprobs": np.asarray(r["logprobs"], np.float32)}
        if "entropy" in r:
            d["entropy"] = np.asarray(r["entropy"], np.float32)
        if "top_k_ids" in r:
            d["top_k_ids"] = np.asarray(r["top_k_ids"], np.int32).reshape(-1, top_k)
            d["top_k_logprobs"] = np.asarray(r["top_k_logprobs"], np.float32).reshape(-1, top_k)
        out.append(d)
    return out


def post(url, body, *, encoding="json", accept=None, headers=AUTH, timeout=120):
    if encoding == "msgpack":
        packed = {**body, "sequences": [{**s, "input_ids": np.asarray(s["input_ids"], "<i4").tobytes()}
                                        for s in body["sequences"]]}
        content, media = msgpack.packb(packed), "application/msgpack"
    else:
        content, media = json.dumps(body).encode(), "application/json"
    h = {**headers, "Content-Type": media}
    if accept:
        h["Accept"] = accept
    return httpx.post(url + "/score", content=content, headers=h, timeout=timeout)


def long_forward_body(seed: int, sequences: int = 2, length: int = 6000) -> dict:
    """A request whose row (``sequences`` x ``length`` tokens of the tiny model, one row when the
    budget holds it) takes several seconds on a CPU: long enough to signal the server mid-forward."""
    rng = np.random.default_rng(seed)
    return {"sequences": [{"input_ids": rng.integers(0, TINY_VOCAB, length).tolist()} for _ in range(sequences)]}


def post_in_background(url: str, body: dict, **kw) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """``post(url, body)`` on a started thread; its answer lands in the dict under ``"answer"``."""
    answers: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: answers.update(answer=post(url, body, **kw)))
    sender.start()
    return sender, answers


def queued_sequences(url: str) -> float:
    """The server's ``packscore_queued_sequences`` gauge: admitted, not yet scored."""
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith("packscore_queued_sequences "):
            return float(line.split()[1])
    raise AssertionError("packscore_queued_sequences missing")


def signalled_once(server: LocalServer, sender: threading.Thread, started: Callable[[], bool], signals: list[float],
                   signum: int = signal.SIGTERM) -> tuple[int, float]:
    """Once ``started()`` holds (polled, a minute at most), ``signum`` at each of ``signals`` (seconds
    after). The exit status and seconds from the last signal to the exit; the server is stopped and
    ``sender`` (the request under way) joined either way."""
    try:
        deadline = time.monotonic() + 60
        while not started():  # not a sleep: a loaded machine may take longer to get there
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()[-3000:]
            time.sleep(0.01)
        begun = time.monotonic()
        for at in signals:
            time.sleep(max(0.0, begun + at - time.monotonic()))
            server.proc.send_signal(signum)
        t0 = time.monotonic()
        code = server.proc.wait(timeout=90)
        exited_after = time.monotonic() - t0
        sender.join(timeout=30)
    finally:
        server.stop()
    return code, exited_after


def sigterm_mid_forward(server: LocalServer, body: dict, signals: list[float]) -> tuple[int, float, httpx.Response]:
    """Sends ``body``; once it is admitted and its forward under way, a SIGTERM at each of
    ``signals`` (seconds after admission). The exit status, seconds from the last signal to the
    exit, and the request's answer."""
    sender, answers = post_in_background(server.url, body)

    def admitted() -> bool:
        return queued_sequences(server.url) >= len(body["sequences"])

    code, exited_after = signalled_once(server, sender, admitted, signals)
    return code, exited_after, answers["answer"]


def assert_matches(got: list[dict], seqs: list[dict], scorer, *, temperature=1.0, top_k=0, return_entropy=True):
    want = scorer.score([SequenceInput(np.array(s["input_ids"]), s.get("score_from", 1), temperature, top_k,
                                       return_entropy) for s in seqs])
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["id"] == seqs[i].get("id")
        diff = float(np.max(np.abs(g["logprobs"] - w.logprobs), initial=0.0))
        assert diff <= TOL, f"sequence {i}: logprobs max |diff| {diff} > {TOL}"
        if return_entropy:
            diff = float(np.max(np.abs(g["entropy"] - w.entropy), initial=0.0))
            assert diff <= TOL, f"sequence {i}: entropy max |diff| {diff} > {TOL}"
        else:
            assert "entropy" not in g
        if top_k:
            diff = float(np.max(np.abs(g["top_k_logprobs"] - w.top_k_logprobs), initial=0.0))
            assert diff <= TOL, f"sequence {i}: top-k logprobs max |diff| {diff} > {TOL}"
            # Ids may only differ where two neighbouring candidates are tied within the tolerance.
            gaps = np.abs(np.diff(w.top_k_logprobs, axis=-1))
            tied = np.zeros(w.top_k_ids.shape, dtype=bool)
            tied[..., :-1] |= gaps <= TOL
            tied[..., 1:] |= gaps <= TOL
            assert not np.any((g["top_k_ids"] != w.top_k_ids) & ~tied), f"sequence {i}: top-k ids differ away from ties"


class HuggingFaceReference:
    """Hugging Face transformers' own forward of a checkpoint, float32 on the CPU, one sequence at a
    time, and API.md's formulas written out: what an acceptance client checks answers against.
    ``score`` stands in for ``Scorer.score`` in ``assert_matches``."""

    def __init__(self, path):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def score(self, seqs: list[SequenceInput]) -> list[SequenceScores]:
        from tests.checkpoints import hf_scores

        out = []
        for s in seqs:
            logprobs, entropy, top_ids, top_logprobs = hf_scores(self.model, s, s.top_k)
            out.append(SequenceScores(logprobs, entropy, top_ids.astype(np.int32), top_logprobs))
        return out


def served_version(url: str, headers: dict | None = None) -> str:
    """The weights_version the one model at ``url`` serves, asked directly (no proxy from the environment)."""
    with httpx.Client(trust_env=False, timeout=30) as direct:
        (model,) = direct.get(url + "/v1/models", headers=headers).json()["data"]
    return model["weights_version"]


def served_versions(url: str) -> dict[str, str]:
    """The weights_version of each model at ``url``, by its id."""
    return {m["id"]: m["weights_version"] for m in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]}


def wait_status(server: LocalServer, status: str, timeout: float = 240) -> httpx.Response:
    """/readyz's answer once its status is ``status`` (``awaiting_weights``, ...); raises if the process exits
    or ``timeout`` passes. A port taken before the server's bind is given up for another, as in ``wait_ready``."""
    def said() -> httpx.Response | None:
        answer = httpx.get(server.url + "/readyz", timeout=5)
        try:
            return answer if answer.json().get("status") == status else None
        except ValueError:
            return None

    return server.wait_for(said, timeout, what=f"saying {status!r} at /readyz")


def score_request(sequences: int, length: int = 4000) -> bytes:
    """A /score request of ``sequences`` x ``length`` tokens, top_k 20: about 170 bytes of msgpack answer a token."""
    body = orjson.dumps({"sequences": [{"input_ids": [i % 1000 for i in range(length)]} for _ in range(sequences)],
                         "top_k": 20})
    return (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAccept: application/msgpack\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def read_head(sock: socket.socket) -> tuple[bytes, bytes, int]:
    """An answer's head, the body bytes that came with it, and its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    return head, body, int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))


def stalled_answer(server: LocalServer, sequences: int) -> tuple[socket.socket, int]:
    """A connection that asks for a large answer, reads its head and then nothing: (socket, answer length)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(score_request(sequences))
    head, _, length = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head
    return sock, length
