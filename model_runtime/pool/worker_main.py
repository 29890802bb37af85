"""A pool worker's process: ``python -m model_runtime.pool.worker_main`` (standard library only).

It sets up what must hold while the worker still imports torch (seconds), then runs the rank
(``model_runtime.pool.worker``): SIGINT and SIGTERM ignored, and a watch on the pool's process, so
a worker whose server is SIGKILLed or OOM-killed during a start or a restart exits at once instead
of once its imports finish.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import threading
import time


def _watch_parent(parent: int) -> None:
    """Exits when the pool's process goes away, even while this rank imports torch or is busy in a forward."""
    try:
        pidfd = os.pidfd_open(parent)  # readable once that process ends, whoever our parent is
    except ProcessLookupError:
        os._exit(0)
    except OSError:
        pidfd = None  # a kernel without pidfds: the parent's death shows as another parent pid

    def watch():
        if pidfd is not None:
            select.select([pidfd], [], [])
            os._exit(0)
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="packscore worker process (started by the worker pool)")
    parser.add_argument("--recv-fd", type=int, required=True, help="inherited descriptor of the command pipe")
    parser.add_argument("--send-fd", type=int, required=True, help="inherited descriptor of the reply pipe")
    parser.add_argument("--parent-pid", type=int, default=None, help="the pool's process id (default: the parent now)")
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal, and a SIGTERM sent to the whole process group (systemd's control group,
    # `kill -TERM -PGID`, supervisors' stopasgroup), reach every worker too: the pool decides when
    # workers stop (Shutdown, or SIGKILL past the drain), so the server can drain what it admitted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(args.parent_pid or os.getppid())
    from model_runtime.pool.worker import run  # torch: seconds of imports, under the watch

    run(args.recv_fd, args.send_fd)


if __name__ == "__main__":
    main()
