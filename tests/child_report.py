"""A child that writes what it sees at its start as JSON: tests/unit/test_warm_start.py runs it
forked from the zygote and cold, and compares the two."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time


def _open_descriptors() -> list[int]:
    found = []
    for fd in range(256):
        try:
            fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            continue
        found.append(fd)
    return found


def main() -> int:
    for fd in map(int, os.environ.get("TESTS_REPORT_WRITE_FDS", "").split()):
        os.write(fd, b"passed")
    report = {
        "argv": sys.argv[1:],
        "argv0": os.path.basename(sys.argv[0]),
        "main": sys.modules["__main__"].__spec__.name if sys.modules["__main__"].__spec__ else None,
        "cwd": os.getcwd(),
        "env": sorted(os.environ.items()),
        "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD)},
        "descriptors": _open_descriptors(),
        "stdin_is_a_tty": os.isatty(0),
    }
    print(json.dumps(report), flush=True)
    time.sleep(float(os.environ.get("TESTS_REPORT_SLEEP_S", "0")))
    return int(os.environ.get("TESTS_REPORT_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
