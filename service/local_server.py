"""``packscore serve`` as a child process on a free loopback port: start it, wait for /readyz, stop it.

Used by the end-to-end tests and the HTTP benchmarks; also a way for a trainer to run a
scorer beside itself. Imports httpx only (no torch).

    >>> server = LocalServer(["--model", "tiny"]).wait_ready()
    >>> server.url
    'http://127.0.0.1:...'
    >>> server.stop()

or ``with LocalServer([...]) as server:``, which stops it at the block's end. A server still running
when this interpreter exits (an exception nobody caught) is stopped then; one never ready within
``wait_ready``'s timeout is stopped before it raises.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from model_runtime.pool.ports import free_port

_REPO_ROOT = Path(__file__).resolve().parent.parent


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
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"server-{self.port}.log" if log_dir is not None else None
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}
        full_env.update(env or {})
        command = [*(program or [sys.executable, "-m", "service.cli"]), "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), *args]
        self._log = self.log_path.open("wb") if self.log_path is not None else None
        output = {"stdout": self._log, "stderr": subprocess.STDOUT} if self._log else {}
        self.proc = self.spawn(command, cwd=_REPO_ROOT, env=full_env, **output)
        atexit.register(self.stop)  # a caller that dies of an exception leaves no server behind

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        """The last 5,000 characters the server wrote (empty without a log file)."""
        return self.log_path.read_text(errors="replace")[-5000:] if self.log_path else ""

    def wait_ready(self, timeout: float = 120.0) -> "LocalServer":
        """Returns once /readyz answers 200; raises if the process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop(timeout=10.0)  # the caller gives up on it: no server left running unseen
        raise TimeoutError(f"server not ready after {timeout}s (stopped):\n{log}")

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
