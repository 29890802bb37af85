"""The ``packscore`` console script, kept to the standard library so that its first act comes first.

Until uvicorn runs, ``packscore serve`` has admitted nothing, so a SIGTERM then (a pod deleted while
torch imports or the app is built) ends the process at once with status 0, as a drained SIGTERM
does, instead of the default handler's 143. ``service.http.server.DrainingServer`` takes SIGTERM
over for uvicorn and the drain (exiting so itself until its event loop is known), and puts the default
back when uvicorn is done.
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def exit_before_serving(signum, frame) -> None:
    os.write(2, b"packscore: SIGTERM before the server started; nothing was admitted, exiting\n")
    os._exit(0)


def exit_on_sigterm_until_serving(argv: list[str]) -> None:
    """For ``serve`` only: ``score`` keeps the default until its scoring loop handles SIGTERM (exit 143)."""
    if argv[:1] == ["serve"] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, exit_before_serving)


def after_serving(handler):
    """The handler to put back for SIGTERM once the server stops handling it, where ``handler`` is the
    one it found: the default instead of the early exit (a SIGTERM then is no longer one before serving)."""
    return signal.SIG_DFL if handler is exit_before_serving else handler


def hard_exit(status: int) -> None:
    """Ends the process now with ``status``, its logs flushed, without the interpreter's teardown:
    torch's C++ teardown under a forward still running on its thread aborts (SIGABRT)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> int:
    exit_on_sigterm_until_serving(sys.argv[1:])
    from service.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
