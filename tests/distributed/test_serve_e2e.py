"""``packscore serve --device cpu --world-size 2 --sp 2 --fsdp`` as a real server on 127.0.0.1.

It must answer /score with the numbers of one process, show its layout in /v1/models and
/metrics, and survive a worker killed under load: no request hangs, /readyz drops to 503 and
comes back, and later answers are right again.
"""

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from model_runtime.types import SequenceInput
from service.local_server import LocalServer
from tests.e2e.helpers import (long_forward_body, packscore_command, post_in_background, queued_sequences,
                               sigterm_mid_forward)
from tests.signals import process_state

TOL = {"logprobs": 1e-5, "entropy": 1e-4}
# Against one process scoring the same sequences: the server packs sequences of concurrent
# requests into shared rows as they arrive, other rows than one process's (the layout alone is
# bitwise, docs/parallel.md); the entropy's sum over the vocabulary feels that more than a
# log-probability, so it gets the looser bound.
LAYOUT = {"world_size": 2, "dp": 1, "sp": 2, "fsdp": True}


def _worker_pids(server_pid: int) -> list[int]:
    """The server's children that run ``model_runtime.pool.worker_main`` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z" or b"model_runtime.pool.worker_main" not in cmdline:
            continue
        # started by the server: its child, or an orphan that names it (the server gone)
        if int(fields[1]) == server_pid or f"--parent-pid {server_pid} ".encode() in cmdline + b" ":
            pids.append(int(entry.name))
    return sorted(pids)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = LocalServer(
        ["--device", "cpu", "--world-size", "2", "--sp", "2", "--fsdp", "--max-batch-tokens", "512", "--max-wait-ms", "2"],
        env={"PYTHONUNBUFFERED": "1"},
        log_dir=tmp_path_factory.mktemp("serve"),
        program=packscore_command(),
    )
    try:
        server.wait_ready(timeout=120)
        client = httpx.Client(base_url=server.url, timeout=60.0)  # the url is final once ready (a taken port moves it)
        with client:
            yield server, client
    finally:
        server.stop(timeout=30)
    assert not _worker_pids(server.proc.pid), "workers outlived the server"


@pytest.fixture(scope="module")
def reference():
    return Scorer(load_model("tiny", device="cpu"))


def _request(vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lengths = [3, 41, 120, 7, 1]
    seqs = [
        {"id": f"s{i}", "input_ids": rng.integers(0, vocab, n).tolist(), "score_from": max(1, n // 3)}
        for i, n in enumerate(lengths)
    ]
    return {"sequences": seqs, "temperature": 0.9, "top_k": 2}


def _check_scores(response: httpx.Response, body: dict, reference: Scorer) -> None:
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    want = reference.score(
        [
            SequenceInput(np.array(s["input_ids"]), score_from=s["score_from"], temperature=body["temperature"], top_k=body["top_k"])
            for s in body["sequences"]
        ]
    )
    for got, ref, seq in zip(results, want, body["sequences"]):
        assert got["id"] == seq["id"]
        for name in ("logprobs", "entropy"):
            diff = float(np.max(np.abs(np.array(got[name], dtype=np.float64) - getattr(ref, name)), initial=0.0))
            assert diff <= TOL[name], f"{seq['id']} {name}: max |diff| {diff:.3e} > tol {TOL[name]:.0e}"
        np.testing.assert_array_equal(np.array(got["top_k_ids"]).reshape(ref.top_k_ids.shape), ref.top_k_ids)


def test_serves_the_layout_and_the_numbers_of_one_process(server, reference):
    proc, client = server[0].proc, server[1]
    models = client.get("/v1/models").json()["data"][0]
    assert models["parallel"] == LAYOUT
    assert models["device"] == "cpu"
    assert len(_worker_pids(proc.pid)) == 2
    body = _request(reference.loaded.vocab_size, seed=0)
    _check_scores(client.post("/score", json=body), body, reference)
    metrics = client.get("/metrics").text
    info = [line for line in metrics.splitlines() if line.startswith("packscore_parallel_info")]
    assert info and 'sp="2"' in info[0] and 'fsdp="true"' in info[0], info


def test_the_workers_lines_are_in_the_servers_log_format(server):
    # One stream, one format for the pod's log: a worker's lines name its rank where a request's line names its id.
    form = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO model_runtime\.scoring\.loading: rank=[01] loaded tiny ")
    loaded = [line for line in server[0].log_path.read_text().splitlines() if "loaded tiny" in line]
    assert len(loaded) >= 2 and all(form.match(line) for line in loaded), loaded


WORKER_INFO = re.compile(r" INFO [\w.]+: rank=\d+ ")  # a worker's INFO line (the server's LOG_FORMAT with its rank)


def test_the_workers_follow_the_servers_log_level(server, tmp_path, reference):
    # The default (info): the workers' start lines are there, one per rank.
    started = [line for line in server[0].log_path.read_text().splitlines() if WORKER_INFO.search(line) and "loaded tiny" in line]
    assert {line.split("rank=")[1][0] for line in started} == {"0", "1"}, started
    quiet = LocalServer(["--device", "cpu", "--world-size", "2", "--max-batch-tokens", "512", "--log-level", "warning"],
                        env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    try:
        quiet.wait_ready(timeout=120)
        assert len(_worker_pids(quiet.proc.pid)) == 2
        body = _request(reference.loaded.vocab_size, seed=3)
        _check_scores(httpx.post(quiet.url + "/score", json=body, timeout=60), body, reference)  # the workers ran a row
    finally:
        code = quiet.stop(timeout=30)
    assert code == 0, quiet.log()
    info = [line for line in quiet.log_path.read_text().splitlines() if WORKER_INFO.search(line)]
    assert not info, f"--log-level warning, yet the workers wrote {len(info)} INFO lines: {info[:3]}"


def test_a_killed_worker_fails_fast_then_the_server_recovers(server, reference):
    local, client = server
    proc = local.proc
    vocab = reference.loaded.vocab_size
    victim = _worker_pids(proc.pid)[1]
    statuses = []
    stop = threading.Event()

    def load(thread):
        i = 0
        while not stop.is_set():
            body = _request(vocab, seed=100 * thread + i)
            started = time.monotonic()
            r = client.post("/score", json=body)  # the client's own 60 s timeout catches a hang
            statuses.append((r.status_code, round(time.monotonic() - started, 2)))
            if r.status_code == 200:
                _check_scores(r, body, reference)
            i += 1

    with ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(load, t) for t in range(3)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        saw_not_ready = False
        for _ in range(200):
            if client.get("/readyz").status_code == 503:
                saw_not_ready = True
                break
            time.sleep(0.05)
        time.sleep(0.5)
        stop.set()
        for f in futures:
            f.result(timeout=90)
    assert saw_not_ready, "readiness never dropped after a worker was killed"
    assert {s for s, _ in statuses} <= {200, 503}, statuses
    assert 503 in {s for s, _ in statuses}, f"no request saw the dead worker: {statuses}"
    local.wait_ready(timeout=120)
    assert victim not in _worker_pids(proc.pid)
    body = _request(vocab, seed=7)
    _check_scores(client.post("/score", json=body), body, reference)
    # The metrics keep the story a scrape between the kill and the recovery would miss.
    metrics = client.get("/metrics").text
    restarts = re.findall(r'^packscore_worker_restarts_total\{model="[^"]+"\} (\S+)$', metrics, re.M)
    assert restarts == ["1.0"], [line for line in metrics.splitlines() if "restart" in line]
    assert re.search(r'^packscore_rejections_total\{reason="backend_unavailable"\} [1-9]', metrics, re.M), metrics
    assert "packscore_workers_alive 2.0" in metrics


def test_a_drain_timeout_with_a_worker_mid_row_exits_0_on_time_leaving_no_worker(tmp_path):
    # A worker reads Shutdown only between rows: one cut off mid-row is killed, so the exit keeps
    # to the drain timeout instead of waiting for the row (or for the exit timer 3 s later).
    server = _pool_server(tmp_path, drain_s=1)
    try:
        server.wait_ready(timeout=120)
        workers = _worker_pids(server.proc.pid)
    except BaseException:
        server.stop(timeout=30)
        raise
    code, exited_after, cut = sigterm_mid_forward(server, long_forward_body(13), [1.0])  # its row seconds into a forward
    # The server's shutdown (its pool closed) under the exit timer's 1 + 3 s, by the log's clock: a worker
    # left to finish its row holds it past the timer. The interpreter's teardown after it, a second
    # or more of a loaded machine's CPU, is no part of the bound; the timer still ends it with 0.
    shutdown_after = _logged_after(server, "draining: finishing admitted requests", "Application shutdown complete")
    assert code == 0 and shutdown_after is not None and shutdown_after < 1 + 2.6, (code, shutdown_after, server.log()[-3000:])
    assert exited_after < 1 + 3 + 5, (exited_after, server.log()[-3000:])
    assert cut.status_code == 503, cut.text[:300]
    time.sleep(0.5)
    assert not [pid for pid in workers if process_state(pid) not in ("gone", "Z")], "a worker outlived the server"


def _logged_after(server: LocalServer, first: str, then: str) -> float | None:
    """Seconds from the server's log line holding ``first`` to the one holding ``then`` (None if one is missing)."""
    at = {}
    for line in server.log_path.read_text(errors="replace").splitlines():
        for text in (first, then):
            if text in line and text not in at:
                at[text] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return (at[then] - at[first]).total_seconds() if len(at) == 2 else None


def _pool_server(tmp_path, drain_s: int) -> LocalServer:
    """Two data-parallel CPU workers, rows large enough for a forward of seconds."""
    return LocalServer(["--device", "cpu", "--world-size", "2", "--max-batch-tokens", "12000", "--drain-timeout-s", str(drain_s)],
                       env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())


def _long_row_admitted(server: LocalServer):
    """Posts a row of seconds of work in the background; returns once the server admitted it."""
    body = long_forward_body(13)
    sender, answers = post_in_background(server.url, body)
    deadline = time.monotonic() + 60
    while queued_sequences(server.url) < len(body["sequences"]):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.01)
    return sender, answers


def test_a_sigterm_to_the_whole_process_group_still_drains(tmp_path):
    """systemd (KillMode=control-group), `kill -TERM -PGID` and supervisors signal every process:
    the workers must keep scoring what the server admitted until the pool stops them."""
    server = _pool_server(tmp_path, drain_s=60)
    try:
        server.wait_ready(timeout=120)
        workers = _worker_pids(server.proc.pid)
        sender, answers = _long_row_admitted(server)
        time.sleep(0.5)  # its forward under way
        for pid in (*workers, server.proc.pid):
            os.kill(pid, signal.SIGTERM)
        code = server.proc.wait(timeout=90)
        sender.join(timeout=30)
    finally:
        server.stop(timeout=30)
    answer = answers["answer"]
    assert answer.status_code == 200, (answer.text[:300], server.log()[-3000:])
    assert code == 0, server.log()[-3000:]
    time.sleep(0.5)
    assert _worker_pids(server.proc.pid) == [], "a worker outlived the server"


def test_a_worker_lost_during_the_drain_leaves_no_restarted_worker_behind(tmp_path):
    """A worker that dies while the server drains makes the pool start a new world; the server's
    exit must take those loading workers down with it, not leave them to notice on their own."""
    server = _pool_server(tmp_path, drain_s=30)
    try:
        server.wait_ready(timeout=120)
        first = _worker_pids(server.proc.pid)
        sender, answers = _long_row_admitted(server)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 30  # the restart has launched its workers
        while not set(_worker_pids(server.proc.pid)) - set(first) and server.proc.poll() is None:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)
        code = server.proc.wait(timeout=60)
        sender.join(timeout=30)
        left = _worker_pids(server.proc.pid)
    finally:
        server.stop(timeout=30)
    assert answers["answer"].status_code == 503, answers["answer"].text[:300]  # its world failed: a JSON 503
    assert code == 0, server.log()[-3000:]
    assert left == [], f"workers {left} outlived the server"
    # The restart the exit cut short is no failure: an ERROR line or a traceback at a clean exit pages someone.
    noise = [line for line in server.log_path.read_text().splitlines() if "restart failed" in line or "Traceback" in line]
    assert not noise, noise


def test_a_worker_lost_before_the_first_readiness_pass_is_restarted_not_fatal(tmp_path, reference):
    """A worker that dies during the start's warm-up or first readiness pass is replaced as one
    lost later would be: the server waits for its pool and becomes ready, instead of exiting 1."""
    server = LocalServer(["--device", "cpu", "--world-size", "2", "--max-batch-tokens", "512"],
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    try:
        server.wait_for(lambda: "worker pool generation 1 up" in server.log_path.read_text(errors="replace"), 120,
                        interval=0.002, what="up (worker pool generation 1)")
        first = _worker_pids(server.proc.pid)
        os.kill(first[0], signal.SIGKILL)  # the warm-up and the first pass take a fraction of a second here
        server.wait_ready(timeout=120)
        assert "waiting for its pool to restart" in server.log_path.read_text(), "the kill came after the first pass"
        assert first[0] not in _worker_pids(server.proc.pid)
        body = _request(reference.loaded.vocab_size, seed=11)
        _check_scores(httpx.post(server.url + "/score", json=body, timeout=60), body, reference)
    finally:
        code = server.stop(timeout=30)
    assert code == 0, server.log()[-3000:]


def _two_workers(server: LocalServer) -> list[int]:
    """The server's two workers, as soon as both run (``wait_for``: a port taken before the bind moves the server)."""
    return server.wait_for(lambda: pids if len(pids := _worker_pids(server.proc.pid)) >= 2 else None, 120,
                           interval=0.002, what="running two workers")


def _held_in_the_rendezvous(server: LocalServer) -> tuple[int, int]:
    """Holds the first world where it forms: one worker is stopped before it joins the process
    group, then the other joins and waits there for it, so the world cannot be up until the
    stopped one goes on. Returns (stopped pid, waiting pid)."""
    deadline = time.monotonic() + 120
    held, waiting = _two_workers(server)
    os.kill(held, signal.SIGSTOP)
    while process_state(held) != "T":
        assert time.monotonic() < deadline, process_state(held)
        time.sleep(0.002)
    log = server.log_path.read_text(errors="replace")
    assert f"pid {held} joining" not in log, "the worker to hold joined before it was stopped (imports take seconds)"
    while f"pid {waiting} joining" not in server.log_path.read_text(errors="replace"):
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
        time.sleep(0.01)
    return held, waiting


def test_a_worker_lost_while_the_first_world_forms_is_replaced_not_fatal(tmp_path, reference):
    """A worker killed (here in the rendezvous, its peer held back) before the start's world is up
    does not fail the start: the world is formed again, and the server serves one process's numbers."""
    server = LocalServer(["--device", "cpu", "--world-size", "2", "--max-batch-tokens", "512"],
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    held = None
    try:
        held, waiting = _held_in_the_rendezvous(server)
        os.kill(waiting, signal.SIGKILL)
        server.wait_ready(timeout=180)
        log = server.log_path.read_text()
        assert "worker pool generation 1 not formed" in log and "killed by SIGKILL" in log, log[-3000:]
        assert "worker pool generation 1 up" not in log and "worker pool generation 2 up" in log, log[-3000:]
        assert not {held, waiting} & set(_worker_pids(server.proc.pid))
        body = _request(reference.loaded.vocab_size, seed=12)
        _check_scores(httpx.post(server.url + "/score", json=body, timeout=60), body, reference)
    finally:
        if held is not None and process_state(held) not in ("gone", "Z"):
            os.kill(held, signal.SIGCONT)
        code = server.stop(timeout=30)
    assert code == 0, server.log()[-3000:]


def test_a_sigterm_while_the_first_world_forms_exits_at_once_leaving_no_worker(tmp_path):
    """Nothing was admitted: the server exits 0 at once, and the workers still loading go with it
    instead of finishing their imports first and only then noticing that the server is gone."""
    server = LocalServer(["--device", "cpu", "--world-size", "2", "--max-batch-tokens", "512"],
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    try:
        workers = _two_workers(server)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=60)
        took = time.monotonic() - sent
        left = [pid for pid in workers if process_state(pid) not in ("gone", "Z")]
    finally:
        server.stop(timeout=30)
    assert code == 0 and took < 5, (code, took, server.log()[-3000:])
    assert not left, f"workers {left} outlived the server: {[process_state(p) for p in left]}"
    noise = [line for line in server.log_path.read_text().splitlines() if "Traceback" in line or " ERROR " in line]
    assert not noise, noise


def _maps_torch(pid: int) -> bool:
    """Whether the process has loaded any of torch's native libraries (its import is seconds in)."""
    return "/torch/lib/" in Path(f"/proc/{pid}/maps").read_text()


def test_a_server_killed_while_its_workers_import_torch_leaves_no_worker(tmp_path):
    """SIGKILL (or the OOM killer) gives the server no chance to stop its workers: each must notice
    at once, while it still imports torch, instead of lingering until its imports finish."""
    server = LocalServer(["--device", "cpu", "--world-size", "2", "--max-batch-tokens", "512"],
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    workers = []
    try:
        deadline = time.monotonic() + 120
        workers = _two_workers(server)
        for pid in workers:  # held where they are, so what /proc shows is where the kill finds them
            os.kill(pid, signal.SIGSTOP)
        while any(process_state(pid) != "T" for pid in workers):
            assert time.monotonic() < deadline, [process_state(pid) for pid in workers]
            time.sleep(0.002)
        assert not any(_maps_torch(pid) for pid in workers), "a worker loaded torch before it was stopped"
        server.proc.kill()
        server.proc.wait(timeout=30)
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        # A whole torch import (seconds) is still ahead of them; noticing the server's end is not.
        while (left := [pid for pid in workers if process_state(pid) not in ("gone", "Z")]) and time.monotonic() - resumed < 1.0:
            time.sleep(0.01)
        took = time.monotonic() - resumed
    finally:
        for pid in workers:  # ours to end if the test failed: the server's workers
            if process_state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)
        server.stop(timeout=30)
    assert not left, f"workers {left} outlived the server by {took:.2f} s: {[process_state(p) for p in left]}"


def test_a_peer_killed_mid_collective_costs_the_survivor_one_line_not_a_traceback(tmp_path):
    """FSDP lockstep: a rank killed while its peer waits in a collective with it fails the peer's step
    ("Connection reset by peer"). The server names the loss; the survivor says why it stopped in one
    line, without a traceback. The server is held stopped meanwhile, so it cannot kill the survivor
    before the survivor logs (in a soak, a race it won most times)."""
    server = LocalServer(["--device", "cpu", "--world-size", "2", "--fsdp", "--max-batch-tokens", "512", "--max-wait-ms", "2"],
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    try:
        server.wait_ready(timeout=120)
        lost, survivor = _worker_pids(server.proc.pid)
        os.kill(lost, signal.SIGSTOP)
        sender, answers = post_in_background(server.url, {"sequences": [{"input_ids": list(range(200))}]})
        time.sleep(2.0)  # the survivor takes the row's step and waits in its first collective for the stopped rank
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            os.kill(lost, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while process_state(survivor) not in ("gone", "Z"):  # it exits 1 once it has logged and replied
                assert time.monotonic() < deadline, f"the survivor still runs: {process_state(survivor)}"
                time.sleep(0.05)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        sender.join(timeout=90)
        assert answers["answer"].status_code == 503, answers["answer"].text
        server.wait_ready(timeout=180)
    finally:
        code = server.stop(timeout=30)
    log_text = server.log_path.read_text()
    assert code == 0, log_text
    broke = [line for line in log_text.splitlines() if "a collective broke, a peer is lost" in line]
    assert len(broke) == 1 and "rank=" in broke[0] and " WARNING " in broke[0], log_text
    assert "Traceback" not in log_text, log_text


def test_an_update_while_the_pool_cannot_restart_says_why(tmp_path, checkpoint_dir):
    """Files saved over the directory that serves, then a worker lost: the restart is refused until
    they are back (docs/parallel.md). A trainer's next update is refused too; its 503 must name why,
    as /score's does, with the pool's Retry-After, not "restarting" and a retry that cannot help."""
    from tests.checkpoints import rewrite_checkpoint

    root = tmp_path / "root"
    base = rewrite_checkpoint(checkpoint_dir("qwen3_5"), root / "base")

    def scaled(factor):
        return lambda tensors: {**tensors, "lm_head.weight": tensors["lm_head.weight"] * factor}

    rewrite_checkpoint(base, root / "next", scaled(2.0))
    server = LocalServer(["--model", str(base), "--device", "cpu", "--world-size", "2", "--max-batch-tokens", "512",
                          "--weights-root", str(root)],
                         env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, log_dir=tmp_path, program=packscore_command())
    try:
        server.wait_ready(timeout=120)
        assert httpx.post(server.url + "/v1/weights", json={"path": "next"}, timeout=60).status_code == 200
        rewrite_checkpoint(base, root / "next", scaled(3.0))  # a trainer saves another step over it
        os.kill(_worker_pids(server.proc.pid)[0], signal.SIGKILL)
        server.wait_for(lambda: httpx.get(server.url + "/readyz", timeout=10).json()["status"] == "restart_failed" or None,
                        60, what="restart_failed")
        answer = httpx.post(server.url + "/v1/weights", json={"path": "base"}, timeout=60)
    finally:
        code = server.stop(timeout=30)
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "backend_unavailable", answer.text
    assert "could not restart" in answer.text and "holds other weights" in answer.text, answer.text
    assert 1 <= int(answer.headers["retry-after"]) <= 30, answer.headers
    assert f"the next attempt is in {answer.headers['retry-after']}s." in answer.text, "the message and Retry-After disagree"
    assert code == 0, server.log()[-3000:]
