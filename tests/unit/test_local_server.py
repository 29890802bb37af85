"""``LocalServer`` leaves no server running behind its caller: one still up when the caller's
interpreter exits (an exception nobody caught) is stopped then, a ``with`` block stops it at its
end, and one never ready within ``wait_ready``'s timeout is stopped before it raises. A port taken
between its choice and the server's bind does not fail the start, whether the caller waits with
``wait_ready`` or ``wait_for``."""

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.signals import process_state

REPO = Path(__file__).resolve().parents[2]

_CALLER = """
import sys
from service.local_server import LocalServer

how = sys.argv[1]
if how == "exception":
    server = LocalServer(["--model", "tiny", "--device", "cpu"])
    print(server.proc.pid, flush=True)
    raise RuntimeError("the trainer failed")
if how == "with":
    with LocalServer(["--model", "tiny", "--device", "cpu"]) as server:
        print(server.proc.pid, flush=True)
    print("left", server.proc.returncode is not None, flush=True)
if how.startswith("taken"):
    import socket
    import httpx
    import service.local_server as local_server
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]  # what another process took after free_port chose it
    local_server.free_port = lambda real=local_server.free_port: ports.pop() if ports else real()
    with LocalServer(["--model", "tiny", "--device", "cpu"]) as server:
        if how == "taken":
            server.wait_ready()
        else:  # what a caller waits for short of readiness: /healthz answers while the model loads
            assert server.wait_for(lambda: httpx.get(server.url + "/healthz", timeout=5).json(), what="listening")
        print(server.proc.pid, flush=True)
        print(server.port != taken.getsockname()[1], server.url.endswith(f":{server.port}"), flush=True)
if how == "timeout":
    server = LocalServer(["--model", "tiny", "--device", "cpu"])
    print(server.proc.pid, flush=True)
    try:
        server.wait_ready(timeout=0.5)
    except TimeoutError as exc:
        print("raised", server.proc.returncode is not None, flush=True)
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if process_state(pid) in ("gone", "Z"):
            return True
        time.sleep(0.1)
    return False


def _run(how: str) -> tuple[int, list[str], str]:
    run = subprocess.run([sys.executable, "-c", _CALLER, how], capture_output=True, text=True, timeout=180, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = run.stdout.split()
    said = f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert lines, f"the caller printed nothing:\n{said}"
    return int(lines[0]), lines[1:], said


def test_a_caller_dying_of_an_exception_leaves_no_server():
    pid, _, said = _run("exception")
    assert "the trainer failed" in said and _gone(pid, 5), f"server {pid} still running after its caller:\n{said}"


def test_a_with_block_stops_its_server():
    pid, rest, said = _run("with")
    assert rest == ["left", "True"] and _gone(pid, 5), said


def test_a_server_never_ready_in_time_is_stopped_before_wait_ready_raises():
    pid, rest, said = _run("timeout")
    assert rest == ["raised", "True"] and _gone(pid, 5), said


def test_a_port_taken_before_the_server_binds_it_is_given_up_for_another():
    """free_port's port is free when chosen; another process (a test beside it) can bind it first, and
    the server then exits 3 (docs/cli.md). wait_ready raised "server exited with 3"; it starts the
    server again on another port."""
    pid, rest, said = _run("taken")
    assert rest == ["True", "True"] and _gone(pid, 5), said


def test_a_port_taken_before_the_bind_is_given_up_by_wait_for_too():
    """A caller that waits for something short of readiness (a /readyz status, a log line, the workers)
    with ``wait_for`` gets the same new port: its own loop over the first process saw it exit 3."""
    pid, rest, said = _run("taken-wait-for")
    assert rest == ["True", "True"] and _gone(pid, 5), said
