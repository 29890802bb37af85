"""Test servers and pool workers forked from one pre-imported Python process instead of started cold.

Every ``packscore serve`` spends about ten seconds of CPU importing torch and transformers'
modeling stack before it reads its options, and the suite starts dozens of them. The tests set
``LocalServer.spawn`` and ``WorkerWorld.spawn`` (tests/conftest.py) to ``popen`` below: a zygote, started once per session,
imports what a server imports and runs no torch op; each server is a fork of it that then runs
``python -m MODULE ARGS`` (or the ``packscore`` script) exactly as a fresh interpreter would, with
the requested environment, working directory, standard streams and passed descriptors.

What a fork cannot redo falls back to ``subprocess.Popen``: an environment that differs from the
zygote's in more than the variables read at run time (``PACKSCORE_*``, the fake backend's,
``PYTHONUNBUFFERED``, ``PYTEST_CURRENT_TEST``, ``TORCHINDUCTOR_CACHE_DIR``), another program, other ``Popen``
options, or a zygote running a thread of its own. ``TESTS_COLD_START=1`` and CUDA start everything cold.

The zygote speaks JSON lines over a Unix socket and receives the standard and passed descriptors
with ``SCM_RIGHTS``; nothing is pickled. A connection is one child: its pid, then its exit status.
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).with_name("packscore")
_ENTRY = "service.entrypoint:main"  # pyproject's [project.scripts] packscore
# Read by the server after it starts, never by an import: a child may differ in these.
_RUNTIME_PREFIXES = ("PACKSCORE_", "FAKE_", "TESTS_")
# pytest sets the second per test; torch's inductor sets the third in this process when first used.
_RUNTIME_NAMES = ("PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")
_PRELOAD = (
    "service.cli", "service.entrypoint", "service.http.app", "service.http.server", "service.testing",
    "model_runtime.scoring.loading", "model_runtime.scoring.scorer", "model_runtime.pool.pool",
    "transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next", "uvicorn", "fastapi",
)


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_RUNTIME_PREFIXES) and k not in _RUNTIME_NAMES}


# ---- the zygote: python -m tests.warm_start SOCKET SESSION_PID -------------------------------

def _serve(path: str, parent: int) -> dict:
    """Forks a child per request while ``parent`` (the session) is this process's parent; returns only
    in a child, with its request."""
    import importlib

    importlib.import_module("numpy")  # its BLAS starts idle threads, which stop themselves around a fork

    global _ALLOWED_THREADS
    _ALLOWED_THREADS = _threads()
    for name in _PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the imports' objects stay out of every child's collections (and its pages unshared)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # connectable once it exists
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                request = _fork(conn, listener, children)
            except (OSError, ValueError, KeyError, TypeError) as e:  # a request cut short or malformed
                _reply(conn, {"refused": repr(e)})
                conn.close()
                continue
            if request is not None:
                return request
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                _reply(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
    sys.exit(0)  # the session ended without stopping us


_ALLOWED_THREADS = 1


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fork(conn: socket.socket, listener: socket.socket, children: dict) -> dict | None:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3 + _MAX_PASS_FDS)
    try:
        request = json.loads(data)
        targets = [0, 1, 2, *request["pass_fds"]]
        threads = _threads()
        if threads > _ALLOWED_THREADS or len(fds) != len(targets):
            raise ValueError(f"{threads} threads, {len(fds)} descriptors for {len(targets)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            for other in children.values():
                other.close()
            conn.close()
            _descriptors(fds, targets)
        except BaseException:
            os._exit(127)  # never a second zygote
        return request
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    _reply(conn, {"pid": pid})
    return None


def _descriptors(received: list[int], targets: list[int]) -> None:
    """Puts each received descriptor at its target number and closes every other one, as
    ``Popen(close_fds=True, pass_fds=...)`` leaves a child."""
    above = max(received + targets) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in received]  # out of the targets' way
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)
    keep = set(targets)
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already


def _reply(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the test process is gone; the child runs on as a cold one would


def _become(request: dict) -> None:
    """Turns this forked child into ``request['argv']`` as a fresh interpreter would run it."""
    import importlib
    import runpy

    import numpy as np

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    np.random.seed()  # a fresh process seeds NumPy's global generator from the OS
    kind, target, args = request["argv"]
    if kind == "module":
        sys.argv = [target, *args]
        sys.modules.pop(target, None)  # as under ``python -m``: the module runs once, as __main__
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        module, _, function = _ENTRY.partition(":")
        sys.argv = [target, *args]
        sys.exit(getattr(importlib.import_module(module), function)())


# ---- the tests' side ------------------------------------------------------------------------

class WarmProcess:
    """The part of ``subprocess.Popen`` that ``LocalServer`` and the tests use, for a forked child."""

    def __init__(self, conn: socket.socket, args: list[str]):
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()
        first = self._read_line(timeout=60.0)
        if first is None or "pid" not in first:
            conn.close()
            raise OSError(f"the zygote did not start {args}: {first}")
        self.pid: int = first["pid"]

    def _read_line(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise OSError("the zygote closed the connection")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):
            return self.returncode  # another thread waits for it: None until then, as Popen.poll answers
        try:
            return self._settle(0.0)
        finally:
            self._lock.release()

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            code = self._settle(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _settle(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            message = self._read_line(timeout)
            if message is not None:
                self.returncode = message["exit"]
                self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it ended and the zygote reaped it before our poll() heard: Popen ignores this too

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def zygote_command(path: str) -> list[str]:
    """The zygote's command line: its socket and this session's pid, named here because a session ended
    during the zygote's imports (seconds) leaves it another parent by the time it first looks."""
    return [sys.executable, "-m", "tests.warm_start", path, str(os.getpid())]


class _Zygote:
    """One pre-imported process for one import-time environment."""

    def __init__(self, env: dict[str, str]):
        self.path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "socket")
        self.proc = subprocess.Popen(zygote_command(self.path), cwd=_REPO_ROOT,
                                     env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the zygote did not start (status {self.proc.returncode})")
            time.sleep(0.05)

    def connect(self) -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
        except OSError:  # the zygote ended: start cold
            conn.close()
            return None
        return conn

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


_ZYGOTES: dict[frozenset, _Zygote | None] = {}  # None: that environment's zygote failed, start cold
_MAX_ZYGOTES = 4  # each holds the imports' memory (about 400 MB)
_MAX_PASS_FDS = 8
_LOCK = threading.Lock()


def cold_only() -> bool:
    """TESTS_COLD_START=1, or a machine with CUDA: a fork must not inherit an initialised CUDA driver."""
    import torch

    return os.environ.get("TESTS_COLD_START") == "1" or torch.cuda.is_available()


def _connect(env: dict[str, str]) -> socket.socket | None:
    if cold_only():
        return None
    key = frozenset(_import_time_env(env).items())
    with _LOCK:
        if key not in _ZYGOTES:
            if len(_ZYGOTES) >= _MAX_ZYGOTES:
                return None
            try:
                _ZYGOTES[key] = _Zygote(dict(key))
            except OSError:
                _ZYGOTES[key] = None
        zygote = _ZYGOTES[key]
    return zygote.connect() if zygote is not None else None


@atexit.register
def _stop_all() -> None:
    for zygote in _ZYGOTES.values():
        if zygote is not None:
            zygote.stop()


def _argv(command: list[str]) -> list | None:
    if len(command) >= 2 and command[0] == sys.executable and command[1] == "-m":
        return ["module", command[2], command[3:]]
    if command and command[0] == str(_SCRIPT):
        return ["script", command[0], command[1:]]
    return None


def popen(command, *, cwd=None, env=None, stdout=None, stderr=None, pass_fds=(), **other):
    """``subprocess.Popen(command, ...)``, forked from the zygote where that starts the same program."""
    command = [str(c) for c in command]
    full_env = dict(os.environ if env is None else env)
    argv = _argv(command)

    def cold():
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, pass_fds=pass_fds, **other)

    # files or the inherited streams, not PIPE or DEVNULL, which Popen makes itself
    files = (stdout is None or hasattr(stdout, "fileno")) and (
        stderr in (None, subprocess.STDOUT) or hasattr(stderr, "fileno"))
    if argv is None or other or not files or len(pass_fds) > _MAX_PASS_FDS:
        return cold()
    conn = _connect(full_env)
    if conn is None:
        return cold()
    out = stdout.fileno() if stdout is not None else 1
    err = out if stderr is subprocess.STDOUT else stderr.fileno() if stderr is not None else 2
    request = {"argv": argv, "env": full_env, "cwd": str(cwd or os.getcwd()), "pass_fds": list(pass_fds)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, out, err, *pass_fds])
    try:
        return WarmProcess(conn, command)
    except OSError:
        conn.close()
        return cold()


if __name__ == "__main__":
    _become(_serve(sys.argv[1], int(sys.argv[2])))
