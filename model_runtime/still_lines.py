"""The "still ..." lines: while slow work runs (a load, a warm-up, a rank reading its shards), one log line
every ``EVERY_S`` says it still does, so that a log is not silent for minutes (a 27B read from a network
disk). One mechanism for ``packscore serve`` (around what it awaits), ``packscore score`` (its load, before
any event loop) and a worker pool's ranks: a daemon thread, no torch.

Example:
    >>> with saying_still(log, "loading Qwen3.5-9B"):  # "still loading Qwen3.5-9B: 30 s", then 60 s, ...
    ...     backend = load_backend(settings)
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import threading
from typing import Iterator

EVERY_S = 30.0  # read at each block's start: a test shortens it


@contextlib.contextmanager
def saying_still(log: logging.Logger, what: str) -> Iterator[None]:
    """Logs "still WHAT: 30 s" on ``log`` every ``EVERY_S`` while the block runs, from a daemon thread in the
    caller's context (a request's lines name it); no line once the block ended, however it ended."""
    every_s = EVERY_S
    ended = threading.Event()
    saying = threading.Lock()  # held while a line is written: the block's end waits for that line, never after it

    def say() -> None:
        for n in itertools.count(1):
            if ended.wait(every_s):
                return
            with saying:
                if ended.is_set():
                    return
                log.info("still %s: %g s", what, n * every_s)

    try:
        threading.Thread(target=contextvars.copy_context().run, args=(say,), name="packscore-still", daemon=True).start()
    except RuntimeError:  # the thread limit: the work runs all the same, without its lines
        pass
    try:
        yield
    finally:
        ended.set()  # first, so that a signal interrupting the wait below still stops the lines
        with saying:
            pass
