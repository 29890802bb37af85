"""The ``packscore`` console script (``python -m service.cli`` runs it too), kept to the standard library so
that its first act comes first.

Until uvicorn runs, ``packscore serve`` has admitted nothing, so a SIGTERM then (a pod deleted while
torch imports or the app is built) ends the process at once with status 0, as a drained SIGTERM
does, instead of the default handler's 143. ``service.http.server.DrainingServer`` takes SIGTERM
over for uvicorn and the drain (exiting so itself until its event loop is known), and puts the default
back when uvicorn is done.

Until ``packscore score`` scores, a SIGTERM (a preempted batch job) raises ``Terminated`` where Ctrl-C
raises KeyboardInterrupt, so the run stops by Ctrl-C's paths (a worker pool's processes stopped) with
one line and status 143, as a SIGTERM while it scores exits; its scoring loop then takes SIGTERM over.
Ctrl-C (SIGINT) raises KeyboardInterrupt for both commands, as Python's default handler does, except that
one, like ``score``'s SIGTERM, that lands while torch imports is held until the imports under way end:
raised there, where torch's C++ init runs Python, the exception would abort the process (SIGABRT, 134).
One whose exception code calling Python from C reported as unraisable and went on is sent again.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time


def exit_before_serving(signum, frame) -> None:
    os.write(2, b"packscore: SIGTERM before the server started; nothing was admitted, exiting\n")
    os._exit(0)


class Terminated(KeyboardInterrupt):
    """SIGTERM before ``packscore score`` began scoring; a KeyboardInterrupt, so that every path Ctrl-C
    stops by (a worker pool's start, the model's close held) stops by it too."""


def terminate_before_scoring(signum, frame) -> None:
    _raise_unless_torch_imports(signum, Terminated)


def interrupt(signum, frame) -> None:
    """Python's default SIGINT handler (KeyboardInterrupt), held while torch imports."""
    _raise_unless_torch_imports(signum, KeyboardInterrupt)


def _raise_unless_torch_imports(signum: int, exception: type[BaseException]) -> None:
    if _importing_torch():  # raised there, under torch's C++ init, it aborts the process (SIGABRT, exit 134)
        if not _send_later(signum):  # no thread (the thread limit): raised at once, as before
            raise exception from None
        return
    raise exception


def _send_later(signum: int, pause_s: float = 0.0) -> bool:
    """Sends ``signum`` again from a thread, after ``pause_s`` and once the imports under way end; False where no
    thread could start. One held signal of each kind is sent again, however many came."""
    if signum not in _held:
        _held[signum] = threading.Thread(target=_send_once_imports_end, args=(signum, pause_s),
                                         name=f"packscore-{signal.Signals(signum).name.lower()}-held", daemon=True)
        try:
            _held[signum].start()
        except RuntimeError:
            del _held[signum]
            return False
    return True


def _send_swallowed_again(info) -> None:
    """``sys.unraisablehook`` while these handlers are in place: code that calls Python from C (pydantic-core) may
    report a handler's exception as unraisable and go on, as if no Ctrl-C or SIGTERM came; the signal is sent
    again, a moment later, for the Python code then running to raise. Anything else goes to the hook found."""
    for signum, handler, kind in ((signal.SIGTERM, terminate_before_scoring, Terminated),
                                  (signal.SIGINT, interrupt, KeyboardInterrupt)):
        if isinstance(info.exc_value, kind) and signal.getsignal(signum) is handler:
            if not _send_later(signum, pause_s=_AGAIN_AFTER_S):
                os.kill(os.getpid(), signum)
            return
    _unraisable_found(info)


_AGAIN_AFTER_S = 0.01  # long enough for the call that swallowed it to return
_unraisable_found = sys.unraisablehook


_held: dict[int, threading.Thread] = {}


def _importing_torch() -> bool:
    """Whether a module of torch is being imported (importlib marks its spec ``_initializing`` until it is)."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for name, module in list(sys.modules.items()) if name == "torch" or name.startswith("torch."))


def _importing() -> bool:
    """Whether any module is being imported."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False) for module in list(sys.modules.values()))


def _send_once_imports_end(signum: int, pause_s: float = 0.0) -> None:
    """Sends the held signal again once the imports under way, torch's and the one that asked for it, have
    ended, for the handler then in place to act on: as the next module's classes are made, KeyboardInterrupt
    in a ``__set_name__`` (a dataclass field's) would turn into a RuntimeError (exit 1, a traceback)."""
    time.sleep(pause_s)
    while _importing():
        time.sleep(0.01)
    del _held[signum]
    os.kill(os.getpid(), signum)


def before_scoring(output) -> str:
    """What a SIGTERM before scoring began ends ``score`` with, after "packscore: "; ``output`` None where OUT
    is not known yet."""
    out = "OUT" if output is None else output
    return (f"terminated (SIGTERM) before scoring began; nothing was scored yet, {out} is as it was: the "
            "same command starts again")


def handle_early_signals(argv: list[str]) -> None:
    """SIGTERM's and SIGINT's handlers until the command takes them over, where each is the default (one ignored,
    or set by someone else, is left as it is)."""
    early = {"serve": exit_before_serving, "score": terminate_before_scoring}.get(argv[0] if argv else "")
    if early is not None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, early)
    if early is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupt)
    if early is not None and sys.unraisablehook is not _send_swallowed_again:
        global _unraisable_found
        _unraisable_found, sys.unraisablehook = sys.unraisablehook, _send_swallowed_again


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
    handle_early_signals(sys.argv[1:])
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        from service.cli import main as cli_main

        return cli_main()
    except Terminated:  # while the imports ran, before OUT was read from the command line
        print(f"packscore: {before_scoring(None)}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling (the imports, serve's checks): a line
        if command not in _INTERRUPTED_BEFORE:
            raise
        print(f"packscore: {_INTERRUPTED_BEFORE[command]}", file=sys.stderr)
        return 130


_INTERRUPTED_BEFORE = {"score": "interrupted before scoring began; OUT is as it was",
                       "serve": "interrupted before the server started; nothing was admitted"}


if __name__ == "__main__":
    sys.exit(main())
