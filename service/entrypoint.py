"""The ``packscore`` console script, kept to the standard library so that its first act comes first.

Until uvicorn runs, ``packscore serve`` has admitted nothing, so a SIGTERM then (a pod deleted while
torch imports or the app is built) ends the process at once with status 0, as a drained SIGTERM
does, instead of the default handler's 143. ``service.http.server.DrainingServer`` hands SIGTERM
back to uvicorn and the drain.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _exit_before_serving(signum, frame) -> None:
    os.write(2, b"packscore: SIGTERM before the server started; nothing was admitted, exiting\n")
    os._exit(0)


def exit_on_sigterm_until_serving(argv: list[str]) -> None:
    """For ``serve`` only: ``score`` writes a resumable file and keeps the default handler."""
    if argv[:1] == ["serve"] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_before_serving)


def hand_sigterm_back() -> None:
    """The default handler again, where ``exit_on_sigterm_until_serving`` installed the early exit,
    just before uvicorn installs its own (on the main thread only, as uvicorn does)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _exit_before_serving:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main() -> int:
    exit_on_sigterm_until_serving(sys.argv[1:])
    from service.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
