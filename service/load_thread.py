"""The thread a load or a weights update runs in, off the event loop: ``in_load_thread``.

Its threads are named ``LOAD_THREAD``, so that a stop can tell whether one still runs
(``Service.torch_work_running``); one the process's thread limit refuses fails its future with
``NoLoadThreadError``.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Callable

from service.scheduling.forward_thread import settle

LOAD_THREAD = "packscore-load"


def in_load_thread(fn: Callable, *args, ended: Callable[[Any, BaseException | None], None] | None = None) -> asyncio.Future:
    """Starts ``fn(*args)`` (a load or a weights update) in a daemon thread, in the caller's context (its
    log lines name the caller's request); a future of its outcome. ``ended(result, error)`` runs on the
    loop, in that context too, once the thread is done (or could not start), before the future settles,
    whether or not anyone still awaits it (a handler cancelled at shutdown leaves the thread running); in
    the thread itself if the loop closed first. A daemon thread: a SIGTERM during a slow load must not wait for it
    (``torch_work_running`` sees it). A thread that cannot start fails it with ``NoLoadThreadError``."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def done(result, error) -> None:
        try:
            if ended is not None:
                ended(result, error)
        except Exception as exc:  # a bug in ``ended``: its awaiter fails with it instead of going on without
            result, error = None, error or exc
        settle(future, result, error)

    def target():
        try:
            result, error = context.run(fn, *args), None
        except BaseException as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(done, result, error, context=context)
        except RuntimeError:  # the loop closed meanwhile (the server stopped): nothing else runs on it now
            if ended is not None:
                ended(result, error)

    try:
        threading.Thread(target=target, name=LOAD_THREAD, daemon=True).start()
    except RuntimeError as exc:  # no thread (the thread limit): ``ended`` runs all the same, or "updating" never ends
        refused = NoLoadThreadError(f"no thread could be started for it ({exc}); the server is at its thread limit")
        refused.__cause__ = exc
        loop.call_soon(done, None, refused)
    return future


class NoLoadThreadError(RuntimeError):
    """``in_load_thread`` could not start its thread (the process's thread limit): the server's
    momentary condition, nothing about what it was to load."""
