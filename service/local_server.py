"""``packscore serve`` as a child process on a free loopback port: start it, wait for /readyz, stop it.

Used by the end-to-end tests and the HTTP benchmarks; also a way for a trainer to run a
scorer beside itself. Imports httpx only (no torch).

    >>> server = LocalServer(["--model", "tiny"]).wait_ready()
    >>> server.url
    'http://127.0.0.1:...'
    >>> server.stop()

or ``with LocalServer([...]) as server:``, which stops it at the block's end. A server still running
when this interpreter exits (an exception nobody caught) is stopped then; one never ready within
``wait_ready``'s timeout is stopped before it raises. ``wait_for(check)`` waits the same way for what
comes short of readiness (a /readyz status, a log line, the workers started).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx

from model_runtime.pool.ports import free_port

_REPO_ROOT = Path(__file__).resolve().parent.parent
_EXIT_NOT_LISTENING = 3  # docs/cli.md: uvicorn could not listen (the port is in use)
_PORT_ATTEMPTS = 5  # free_port's port can be taken before the server binds it: so many ports at most
T = TypeVar("T")


class LocalServer:
    """One ``packscore serve`` process on 127.0.0.1.

    ``args`` are the serve options after ``--host``/``--port``; ``env`` is added to this
    process's environment, whose ``PACKSCORE_*`` variables are dropped so that only ``args`` and
    ``env`` configure the server. With ``log_dir`` the server's output goes to
    ``log_dir/server-<port>.log`` and its tail is shown when the server dies or is not ready in
    time. ``program`` is the command that starts the CLI (default: this interpreter,
    ``-m service.cli``).
    """

    # How the child is started; the tests fork it from a pre-imported process (tests/warm_start.py).
    spawn = staticmethod(subprocess.Popen)

    def __init__(
        self,
        args: list[str] | tuple[str, ...] = (),
        *,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        program: list[str] | None = None,
    ):
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}
        self._env.update(env or {})
        self._command = [*(program or [sys.executable, "-m", "service.cli"]), "serve", "--host", "127.0.0.1"]
        self._args = list(args)
        self._start()
        atexit.register(self.stop)  # a caller that dies of an exception leaves no server behind

    def _start(self) -> None:
        """Starts the server on a port free right now (``port``, ``url``, ``log_path`` name it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self._log_dir / f"server-{self.port}.log" if self._log_dir is not None else None
        self._log = self.log_path.open("wb") if self.log_path is not None else None
        output = {"stdout": self._log, "stderr": subprocess.STDOUT} if self._log else {}
        self.proc = self.spawn([*self._command, "--port", str(self.port), *self._args], cwd=_REPO_ROOT, env=self._env,
                               **output)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        """The last 5,000 characters the server wrote (empty without a log file)."""
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path else ""

    def wait_ready(self, timeout: float = 120.0) -> "LocalServer":
        """Returns once /readyz answers 200; raises if the process exits or ``timeout`` passes. A port
        another process took between ``free_port`` and the server's bind (exit 3) is given up for a new
        one, a few times: ``port`` and ``url`` are final once this returns."""
        self.wait_for(lambda: httpx.get(self.url + "/readyz", timeout=5).status_code == 200, timeout, what="ready")
        return self

    def wait_for(self, check: Callable[[], T], timeout: float = 120.0, *, interval: float = 0.2,
                 what: str = "there") -> T:
        """``check()``'s first true value, called every ``interval`` seconds (an ``httpx.HTTPError`` counts as
        not yet): what a caller waits for other than readiness (a /readyz status, a log line), with
        ``wait_ready``'s handling of the process: it raises if the process exits, and a port taken before the
        server's bind (exit 3) is given up for a new one. Once ``timeout`` passes, the server is stopped and
        ``TimeoutError`` says it was not ``what``."""
        deadline = time.monotonic() + timeout
        port_attempts = _PORT_ATTEMPTS
        while time.monotonic() < deadline:
            if self.proc.poll() == _EXIT_NOT_LISTENING and port_attempts > 1:
                port_attempts -= 1
                if self._log is not None:
                    self._log.close()
                self._start()
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if found := check():
                    return found
            except httpx.HTTPError:
                pass
            time.sleep(interval)
        log = self.log()
        self.stop(timeout=10.0)  # the caller gives up on it: no server left running unseen
        raise TimeoutError(f"server not {what} after {timeout}s (stopped):\n{log}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains), then a kill after ``timeout``; returns the exit status."""
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by its handle
                self.proc.wait()
        if self._log is not None:
            self._log.close()
        return self.proc.returncode
