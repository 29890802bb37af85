"""A server command whose exit holds 2 s in the interpreter's teardown (an atexit callback), after it
writes ``held: exiting`` to standard error, for tests that signal it there:

    python -m tests.e2e.held_exit service.entrypoint serve [serve options]     # packscore serve
    python -m tests.e2e.held_exit tests.e2e.fake_server serve [serve options]  # over FakeBackend
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import time

HELD = "held: exiting"


def _hold() -> None:
    os.write(2, f"{HELD}\n".encode())
    time.sleep(2)  # a signal's handler runs meanwhile


if __name__ == "__main__":
    atexit.register(_hold)  # atexit runs once the command returned, after threading's wait for other threads
    module = importlib.import_module(sys.argv[1])
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    sys.exit(module.main())
