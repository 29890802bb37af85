"""SIGTERM under load: readiness turns 503, new requests get 503 + Retry-After, every admitted
request is answered correctly, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from tests import warm_start
from tests.checkpoints import nan_in, overflowing_head, rewrite_checkpoint
from tests.e2e.held_exit import HELD
from tests.e2e.helpers import (API_KEY, REPO, TINY_VOCAB, ServerProcess, assert_matches, decode, fake_server,
                               long_forward_body, post, post_in_background, queued_sequences, random_sequences,
                               read_until_closed, signalled_once, sigterm_mid_forward)
from tests.ports import held_port
from tests.signals import catches


def test_sigterm_drains_admitted_requests_and_exits_0(tmp_path, tiny_scorer):
    # Rows of one sequence keep the admitted work queued long enough to observe the drain; a
    # queue of 1,000 s of work admits every request at once (none waits for room).
    server = ServerProcess(tmp_path, "--max-batch-tokens", "64", "--drain-timeout-s", "120",
                           "--queue-seconds", "1000").wait_ready()
    try:
        rng = np.random.default_rng(5)
        # 16 rows a request: three admitted requests keep the drain busy for a second or more, so the
        # late request below still finds the server listening on a fast or a loaded machine
        batches = [random_sequences(rng, 16, TINY_VOCAB, lengths=(40, 64)) for _ in range(6)]
        answers: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda i=i, b=b: answers.update({i: post(server.url, {"sequences": b})}))
                   for i, b in enumerate(batches)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while queued_sequences(server.url) < 48:  # at least three requests admitted and waiting
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = post(server.url, {"sequences": [{"input_ids": [1, 2, 3]}]})
        readiness = httpx.get(server.url + "/readyz", timeout=10)
        for t in threads:
            t.join(timeout=120)
        code = server.proc.wait(timeout=120)
    finally:
        server.stop()
    assert late.status_code == 503 and late.headers["retry-after"].isdigit(), late.text
    assert late.json()["error"]["type"] == "draining"
    # API.md: a 503 carries Retry-After, and one while draining Connection: close (probes included)
    assert late.headers["connection"] == "close", dict(late.headers)
    assert readiness.status_code == 503 and readiness.json()["status"] == "draining"
    assert readiness.headers["retry-after"].isdigit() and readiness.headers["connection"] == "close", dict(readiness.headers)
    # Every request was answered. A 503 "draining" is only ever given before admission; an
    # admitted request cut off by the drain would be a 503 of another type, a lost one no answer.
    assert sorted(answers) == list(range(len(batches)))
    admitted = [i for i, r in answers.items() if r.status_code == 200]
    assert len(admitted) >= 3, {i: r.status_code for i, r in answers.items()}
    for i, response in answers.items():
        if response.status_code != 200:
            assert response.status_code == 503 and response.json()["error"]["type"] == "draining", response.text
    for i in admitted:
        assert_matches(decode(answers[i], 0), batches[i], tiny_scorer)
    assert code == 0, server.log()


def test_a_real_forward_cut_off_by_the_drain_timeout_still_exits_0(tmp_path):
    # One row of 12,000 tokens: several seconds of forward on the CPU, past a 0.5 s drain timeout.
    # The exit must not finalise the interpreter under a running torch forward: that aborts (status -6).
    server = ServerProcess(tmp_path, "--max-batch-tokens", "12000", "--drain-timeout-s", "0.5").wait_ready()
    code, exited_after, cut = sigterm_mid_forward(server, long_forward_body(11), [1.0])
    assert code == 0 and "terminate called" not in server.log(), (code, server.log())
    assert exited_after < 5, exited_after
    assert cut.status_code == 503 and cut.json()["error"]["type"] == "unavailable", cut.text[:300]
    # the drain timeout's line names the request it cut off, which the trainer quotes from its 503
    line = next((line for line in server.log_path.read_text().splitlines() if "drain timeout:" in line), "")
    assert f"drain timeout: 1 unfinished request(s) of tiny get 503 (requests {cut.headers['x-request-id']})" in line, \
        server.log()


def test_a_second_sigterm_answers_what_is_pending_with_the_contracts_503(tmp_path):
    # A second SIGTERM stops without a drain; the request still in its forward gets a JSON 503,
    # not the plain-text 500 that uvicorn's cancellation would give it.
    server = ServerProcess(tmp_path, "--max-batch-tokens", "12000", "--drain-timeout-s", "60").wait_ready()
    code, _, cut = sigterm_mid_forward(server, long_forward_body(12), [0.5, 1.0])
    assert cut.status_code == 503 and cut.headers["content-type"] == "application/json", (cut.status_code, cut.text[:300])
    assert cut.json()["error"]["type"] == "unavailable" and cut.headers["retry-after"].isdigit()
    line = next((line for line in server.log_path.read_text().splitlines() if "without a drain:" in line), "")
    assert ("WARNING service.runtime: stopping without a drain: 1 unfinished request(s) of tiny get 503 "
            f"(requests {cut.headers['x-request-id']})") in line, server.log()
    assert code != -6 and "terminate called" not in server.log(), (code, server.log()[-2000:])


def test_a_body_still_arriving_when_draining_begins_gets_the_drains_503(tmp_path):
    # Headers sent, the body stalled after a few bytes: not admitted, so as new as a request arriving
    # now. The exit must not cut it off, or uvicorn answers a plain-text 500.
    server = ServerProcess(tmp_path, "--drain-timeout-s", "5", "--request-read-timeout-s", "30").wait_ready()
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as conn:
            conn.sendall((f"POST /score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n" + '{"seque').encode())
            time.sleep(0.5)
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _content_length(reply):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                reply += chunk
            answered_after = time.monotonic() - sent
        code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().lower().split("\r\n")
    assert lines[0].startswith("http/1.1 503"), reply[:400]
    assert "content-type: application/json" in lines and "connection: close" in lines, lines
    assert json.loads(body)["error"]["type"] == "draining", body
    assert answered_after < 1.0, f"answered {answered_after:.2f} s after SIGTERM"
    assert code == 0, server.log()


def _content_length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_a_sigterm_before_the_server_runs_exits_0(tmp_path):
    # A pod deleted while torch still imports: nothing was admitted, so the exit is the drain's 0,
    # not the default handler's 143. The console script (service.entrypoint) catches it from its
    # first line, `python -m service.cli` from main(), after its own imports. The signal goes as
    # soon as the process catches SIGTERM, well before torch and the app are imported.
    entrypoint = "import sys; from service.entrypoint import main; sys.exit(main())"
    for i, command in enumerate(([sys.executable, "-c", entrypoint], [sys.executable, "-m", "service.cli"])):
        log = tmp_path / f"early-{i}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([*command, "serve", "--port", "0"], stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while not catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        text = log.read_text()
        assert code == 0 and "SIGTERM before the server started" in text, (command, code, text[-2000:])


# `packscore serve` (main() as the console script runs it) with steps of its start or stop held, 2 s each unless
# given, each after writing a marker file: argv is the steps (module:Class.method[=SECONDS],...), the marker, then serve's.
_HELD_STEP_RUN = """
import importlib, inspect, pathlib, sys, time
from service import cli

marker = pathlib.Path(sys.argv[2])

def holding(real, seconds):
    def hold():
        marker.touch()
        time.sleep(seconds)  # a SIGTERM's handler runs meanwhile

    if inspect.iscoroutinefunction(real):
        async def held(self, *args, **kwargs):
            hold()
            return await real(self, *args, **kwargs)
    else:
        def held(self, *args, **kwargs):
            hold()
            return real(self, *args, **kwargs)
    return held

for step in sys.argv[1].split(","):
    name, _, seconds = step.partition("=")
    module, _, name = name.partition(":")
    owner, method = name.split(".")
    cls = getattr(importlib.import_module(module), owner)
    setattr(cls, method, holding(getattr(cls, method), float(seconds or 2)))
sys.argv = ["packscore", *sys.argv[3:]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("step, said", [
    ("service.http.server:DrainingServer.run", "SIGTERM before the server started"),  # the early exit's
    ("uvicorn.config:Config.load", "SIGTERM before the server started"),  # uvicorn's, before its loop is known
    # the loop known: a drain, of a start that admitted nothing yet
    ("uvicorn.lifespan.on:LifespanOn.startup", "draining: stopping the model's start (loading); no request was admitted"),
    ("service.runtime:Service.start", "draining: stopping the model's start (loading); no request was admitted"),
], ids=["before-uvicorn", "uvicorn-config", "lifespan", "service-start"])
def test_a_sigterm_at_each_step_of_the_start_exits_0(tmp_path, step, said):
    # uvicorn's config and lifespan come before startup() knows the event loop: a SIGTERM there was
    # recorded by uvicorn and raised again at its exit under the default handler (-15).
    marker, log = tmp_path / "held", tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _HELD_STEP_RUN, step, str(marker), "serve", "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == 0 and said in text and "Traceback" not in text, (step, code, text[-2000:])


@pytest.mark.parametrize("step, signals, said", [
    ("service.backends:BackendLoader.__call__=30", ["SIGINT"], "stopping the model's start (loading) at once"),
    ("model_runtime.scoring.backend:LocalBackend.score_row=30", ["SIGINT"], "stopping the model's start (probing) at once"),
    # the drain's line first; the Ctrl-C then stops what is left of the start, with no line promising 503s
    ("model_runtime.scoring.backend:LocalBackend.score_row=30", ["SIGTERM", "SIGINT"],
     "draining: stopping the model's start (probing)"),
], ids=["loading-sigint", "probing-sigint", "probing-sigterm-sigint"])
def test_a_ctrl_c_during_the_start_says_the_start_stops_not_that_admitted_requests_get_503(tmp_path, step, signals,
                                                                                             said):
    # Nothing is admitted before the first readiness pass: "admitted requests still pending are answered 503" was untrue.
    marker, log = tmp_path / "held", tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _HELD_STEP_RUN, step, str(marker), "serve", "--port", "0",
                                 "--model", "tiny"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        assert _once(marker.exists, "the held step", log.read_text, proc, 120), log.read_text()[-3000:]
        for sig in signals:
            proc.send_signal(getattr(signal, sig))
            if sig == "SIGTERM":
                assert _once_logged("draining:", log.read_text, proc), log.read_text()[-3000:]
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == 130 and said in text and "Traceback" not in text, (code, text[-3000:])
    assert "no request was admitted yet" in text and "admitted requests still pending" not in text, text[-3000:]


def _once(done, what: str, read_log, proc, timeout_s: float = 60) -> bool:
    """Waits until ``done()`` (a state, not a sleep) or the process's exit; whether it still runs then."""
    deadline = time.monotonic() + timeout_s
    while not done() and proc.poll() is None:
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s:\n{read_log()[-3000:]}"
        time.sleep(0.005)
    return proc.poll() is None


def _once_logged(line: str, read_log, proc, timeout_s: float = 60) -> bool:
    return _once(lambda: line in read_log(), f"{line!r} logged", read_log, proc, timeout_s)


def _once_queued(server: ServerProcess, sequences: int) -> None:
    """Waits until ``sequences`` are admitted (a forward under way, passes queued behind it); the server runs."""
    assert _once(lambda: queued_sequences(server.url) >= sequences, f"{sequences} sequences queued", server.log,
                 server.proc), server.log()[-3000:]


@pytest.mark.parametrize("after", ["stopping without a drain", "Shutting down", "Finished server process"],
                         ids=["first-handled", "shutting-down", "finished"])
def test_a_second_sigint_exits_130_with_the_service_stopped_and_no_traceback(tmp_path, after):
    # Ctrl-C twice: uvicorn's forced exit skipped the app's shutdown, so the loop's close cancelled
    # the lifespan (a logged traceback) and the service never stopped (a worker pool's workers); and a
    # second one in the exit's teardown raised KeyboardInterrupt there (a traceback).
    server = ServerProcess(tmp_path).wait_ready()
    try:
        server.proc.send_signal(signal.SIGINT)
        # the log line, not a sleep: sent before the first was handled, the two merge into one
        if _once_logged(after, server.log, server.proc):
            server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    log = server.log()
    assert code == 130, f"exit status {code}, expected 130:\n{log[-3000:]}"
    assert "Traceback" not in log and "Application shutdown complete" in log, log[-3000:]
    # SIGINT drains nothing: the log says so instead of promising the drain timeout
    assert "stopping without a drain" in log and "draining: finishing" not in log, log[-3000:]


@pytest.mark.parametrize("after", ["Shutting down", "Finished server process"], ids=["shutting-down", "finished"])
def test_a_sigint_once_a_sigterm_drain_stopped_the_server_is_ignored_and_it_exits_0(tmp_path, after):
    # Ctrl-C while the drained server stops: the default handler's KeyboardInterrupt landed anywhere in
    # the exit (the interpreter's teardown: a traceback), or turned the drain's 0 into 130.
    server = ServerProcess(tmp_path).wait_ready()
    try:
        server.proc.send_signal(signal.SIGTERM)
        if _once_logged(after, server.log, server.proc):
            server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    log = server.log()
    assert code == 0, f"exit status {code}, expected 0:\n{log[-3000:]}"
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert "draining: finishing" in log and "Application shutdown complete" in log, log[-3000:]


def test_a_sigint_during_a_sigterm_drain_stops_it_without_waiting_and_exits_130(tmp_path):
    # Ctrl-C during the drain skips its wait, as a second Ctrl-C skips the shutdown's: the forward
    # still running is answered the contract's 503 and the exit does not wait for it.
    server = ServerProcess(tmp_path, "--max-batch-tokens", "12000", "--drain-timeout-s", "60").wait_ready()
    sender, answers = post_in_background(server.url, long_forward_body(13))
    try:
        _once_queued(server, 2)  # admitted, its forward under way
        server.proc.send_signal(signal.SIGTERM)
        assert _once_logged("draining: finishing", server.log, server.proc), server.log()[-3000:]
        server.proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        code = server.proc.wait(timeout=60)
        exited_after = time.monotonic() - sent
        sender.join(timeout=30)
    finally:
        server.stop()
    log = server.log()
    assert code == 130 and exited_after < 15, f"exit status {code} {exited_after:.1f} s after SIGINT:\n{log[-3000:]}"
    assert "Traceback" not in log and "stopping without a drain: 1 unfinished request(s)" in log, log[-3000:]
    cut = answers["answer"]
    assert cut.status_code == 503 and cut.json()["error"]["type"] == "unavailable", cut.text[:300]


@pytest.fixture(scope="module")
def failing_models(checkpoint_dir, tmp_path_factory):
    """Checkpoints whose start fails once the port is bound: refused once loaded (2), non-finite at the first pass (1)."""
    root, source = tmp_path_factory.mktemp("failing"), checkpoint_dir("qwen3_5")
    return {"refused": rewrite_checkpoint(source, root / "nan", nan_in("model.layers.3.self_attn.q_proj.weight")),
            "non-finite": rewrite_checkpoint(source, root / "overflow", overflowing_head)}


@pytest.mark.parametrize("start, after", [
    ("refused", "Waiting for application shutdown"), ("refused", HELD),
    ("non-finite", "Waiting for application shutdown"), ("non-finite", HELD),
    ("port-in-use", HELD),  # over FakeBackend: a model still loading when the bind fails ends the process at once
], ids=["refused-shutting-down", "refused-teardown", "non-finite-shutting-down", "non-finite-teardown",
        "port-in-use-teardown"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_sigint_or_sigterm_once_a_failed_start_stopped_the_server_is_ignored_and_keeps_its_status(
        tmp_path, failing_models, start, after, sig):
    # Ctrl-C while a server that could not start exits: the default handler's KeyboardInterrupt landed in the
    # interpreter's teardown (a traceback), or during uvicorn's shutdown made it 130 without the start's error line.
    # A SIGTERM (a supervisor stopping the failed pod): in the teardown the default's -15, in uvicorn's shutdown a drain
    # of nothing, its "draining" line and its timer's exit 0 armed. held_exit.py holds the teardown for the signal.
    expected = {"refused": 2, "non-finite": 1, "port-in-use": 3}[start]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with held_port() as port, log.open("wb") as out:
        served = (["tests.e2e.fake_server", "serve", "--port", str(port)] if start == "port-in-use" else
                  ["service.entrypoint", "serve", "--port", "0", "--model", str(failing_models[start])])
        proc = warm_start.popen([sys.executable, "-m", "tests.e2e.held_exit", *served, "--host", "127.0.0.1"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        # held: it cannot have exited before
        assert _once_logged(after, log.read_text, proc, 120), f"exited before {after!r}:\n{log.read_text()[-3000:]}"
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == expected, f"exit status {code}, expected {expected}:\n{text[-3000:]}"
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "draining" not in text, text[-3000:]  # nothing was admitted: no drain, and no timer to exit 0 at its end
    errors = [line for line in text.splitlines() if line.startswith("packscore: error: could not start:")]
    assert len(errors) == (0 if start == "port-in-use" else 1) and HELD in text, text[-3000:]


@pytest.mark.parametrize("start, held", [
    # the first readiness pass's ticket, queued as the drain begins: the drain waits for it, and it fails the start
    ("non-finite", "service.scheduling.scheduler:Scheduler.submit"),
    # the app starting, the bind ahead (the port is taken), the model's load still under way at the exit
    ("port-in-use", "uvicorn.lifespan.on:LifespanOn.startup,service.backends:BackendLoader.__call__=30"),
], ids=["non-finite", "port-in-use"])
@pytest.mark.parametrize("then", ["drain-timer", "second-sigterm"])
def test_a_start_that_fails_once_a_sigterm_began_its_drain_keeps_its_status_and_line(tmp_path, failing_models, start,
                                                                                      held, then):
    # A SIGTERM while the model starts begins a drain, and then the start fails. The drain's timer (its timeout + 3 s)
    # ended a stop that took longer (a worker pool's by its own timeouts; here Service.stop held) with 0 and no error
    # line; a second SIGTERM during that stop was not ignored, as it is once a failed start stopped the server without a
    # drain (-15 in place of 1); and the port's line named the start's phase "draining".
    expected = {"non-finite": 1, "port-in-use": 3}[start]
    stop_s, drain_s = (12, "3") if then == "drain-timer" else (2, "30")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}, "OMP_NUM_THREADS": "1"}
    model = ["--model", str(failing_models[start])] if start in failing_models else []
    marker, log = tmp_path / "held", tmp_path / "serve.log"
    with held_port() as taken, log.open("wb") as out:
        port = str(taken if start == "port-in-use" else 0)
        proc = subprocess.Popen([sys.executable, "-c", _HELD_STEP_RUN, f"{held},service.runtime:Service.stop={stop_s}",
                                 str(marker), "serve", "--port", port, "--drain-timeout-s", drain_s, *model], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        assert _once(marker.exists, "the held step", log.read_text, proc, 120), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        if then == "second-sigterm":  # during the failed start's stop
            assert _once_logged("Waiting for application shutdown", log.read_text, proc), log.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == expected, f"exit status {code}, expected {expected}:\n{text[-3000:]}"
    # the drain began first, during the start (probing, loading): nothing admitted, the line says the start stops
    assert "draining: stopping the model's start (" in text and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("packscore: error: could not start:")]
    assert len(errors) == (1 if start == "non-finite" else 0), text[-3000:]
    if then == "drain-timer":
        assert "past the drain timeout; exiting" in text, text[-3000:]  # the timer, not the stop, ended the exit
    elif start == "port-in-use":
        assert "the port could not be bound, so the model's start (loading), still running" in text, text[-3000:]


class _SigintIgnored(ServerProcess):
    """Started as a script's `packscore serve &` starts it: SIGINT ignored, which the server inherits."""

    def spawn(self, command, **options):
        return ServerProcess.spawn(command, **options, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def test_a_sigint_ignored_at_start_stays_ignored_and_sigterm_still_drains(tmp_path):
    server = _SigintIgnored(tmp_path).wait_ready()
    try:
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert server.proc.poll() is None, f"stopped by an ignored SIGINT:\n{server.log()[-3000:]}"
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop()
    assert code == 0, f"exit status {code}:\n{server.log()[-3000:]}"


def test_a_readyz_pass_a_sigint_cuts_off_is_logged_as_cancelled_not_as_a_failure(tmp_path):
    # A real model: /readyz's pass (the proof older than 10 s) waits behind a long forward when SIGINT stops the
    # server; its scheduler's close failed the pass's ticket, logged as "readiness pass of ... failed: The server is
    # stopping without a drain; retry." at ERROR level, as if the model had failed it.
    server = ServerProcess(tmp_path, "--max-batch-tokens", "12000").wait_ready()
    time.sleep(10.5)  # the first pass's proof goes stale: the next /readyz runs a pass
    sender, _ = post_in_background(server.url, long_forward_body(17))
    try:
        _once_queued(server, 2)  # admitted, its forward under way
        probe = threading.Thread(target=lambda: httpx.get(server.url + "/readyz", timeout=30), daemon=True)
        probe.start()
        _once_queued(server, 3)  # the pass queued behind the forward
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=60)
        sender.join(timeout=30)
    finally:
        server.stop()
    log = server.log()
    passes = [line for line in log.splitlines() if "readiness pass of" in line]
    assert code == 130 and len(passes) == 1 and " INFO service.runtime: " in passes[0], log[-3000:]
    assert passes[0].endswith("cancelled: the server is stopping without a drain") and " ERROR " not in log, log[-3000:]


def test_a_sigint_during_a_weights_load_exits_130_without_waiting_for_it_and_answers_the_drains_503(tmp_path):
    """uvicorn cancels the update's handler after its grace; its load ran in asyncio's default executor,
    whose thread the loop's close waited for: the SIGINT waited out the load, and the trainer got
    uvicorn's plain-text 500 (counted as a server error)."""
    from tests.e2e.helpers import fake_server

    (tmp_path / "step-1").mkdir()
    # --log-level info: the update's first line says its load began
    server = fake_server(tmp_path, "--weights-root", str(tmp_path), "--log-level", "info",
                         env={"FAKE_LOAD_SECONDS": "60"}).wait_ready()
    answers: dict[str, httpx.Response] = {}
    sender = threading.Thread(target=lambda: answers.update(
        update=httpx.post(server.url + "/v1/weights", json={"path": "step-1"}, timeout=90)))
    sender.start()
    code, exited_after = signalled_once(server, sender, lambda: "weights update of" in server.log(), [0.0],
                                        signal.SIGINT)
    log = server.log()
    assert code == 130 and exited_after < 15, f"exit status {code} {exited_after:.1f} s after SIGINT:\n{log[-3000:]}"
    answer = answers.get("update")
    assert answer is not None and answer.status_code == 503, (answer, answer and answer.text, log[-3000:])
    assert answer.json()["error"]["type"] == "draining", answer.text


def test_every_answer_while_draining_closes_its_connection(tmp_path):
    # An admitted request's answer during the drain on a kept-alive connection: the exit follows its last one
    # at once, so the client's next request on that connection would meet a closed socket, not the drain's 503.
    server = fake_server(tmp_path, "--drain-timeout-s", "20", "--max-wait-ms", "1",
                         env={"FAKE_SECONDS_PER_TOKEN": "0.02"}).wait_ready()
    body = json.dumps({"sequences": [{"input_ids": list(range(1, 51))}]}).encode()  # a forward of 1 s
    request = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as admitted:
            admitted.sendall(request)
            deadline = time.monotonic() + 10
            while queued_sequences(server.url) < 1:
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            probe = httpx.get(server.url + "/healthz", timeout=10)
            reply, _ = read_until_closed(admitted, 10)  # returns once the server closed the connection
        code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    head = reply.split(b"\r\n\r\n", 1)[0].decode().lower().split("\r\n")
    assert head[0].startswith("http/1.1 200") and "connection: close" in head, reply[:400]
    assert probe.status_code == 200 and probe.headers.get("connection") == "close", dict(probe.headers)
    assert code == 0, server.log()
