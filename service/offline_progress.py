"""``packscore score``'s progress: a bar on a terminal, elsewhere a log line a minute (before the first
result, one every ``still_lines.EVERY_S``, as ``serve``'s "still ..." lines: a first forward on a GPU compiles
its kernels). Both count lines but give the time left from tokens, since a forward's time follows its
tokens, not its lines: with the longest lines first, a rate in lines gives many times the time that is left."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Callable

from tqdm import tqdm

from model_runtime import still_lines

log = logging.getLogger("service.offline")  # the logger the run's other lines come from, as before this module

# How often the bar is redrawn, or a due log line checked, while no result comes (a first forward may take minutes).
_REFRESH_S = 1.0
_LOG_EVERY_S = 60.0
_format_interval = tqdm.format_interval  # "1:02:05"; taken once, so that a test's stand-in for tqdm needs none


def progress(total: int, initial: int, tokens: int, written: Callable[[], int | None] | None = None):
    """``total`` lines, ``initial`` of them already in OUT; ``tokens``: the tokens of the lines left to score;
    ``written()``: the lines this run wrote to OUT (None where it cannot tell), for the bar a stopped run leaves."""
    if sys.stderr.isatty():
        return _BarProgress(total, initial, tokens, written)
    return _LoggedProgress(total, initial, tokens, _LOG_EVERY_S)


async def tick(bar) -> None:
    """Refreshes ``bar`` every _REFRESH_S until cancelled: tqdm redraws (and a log line falls due) only in
    update(), so without it a bar's elapsed time stands still until the first result. On the loop's thread,
    as update() is, so never in the middle of one."""
    while True:
        await asyncio.sleep(_REFRESH_S)
        bar.refresh()


class _Progress:
    """Lines and tokens scored; a subclass's ``update(lines, tokens)`` as each result comes, ``refresh()`` to show them."""

    def __init__(self, total: int, initial: int, tokens: int):
        self.total, self.count, self._initial = total, initial, initial
        self.tokens, self.tokens_done = tokens, 0
        self._start = time.monotonic()

    def _add(self, n: int, tokens: int) -> None:
        self.count += n
        self.tokens_done += tokens

    def _rate_and_left(self, now: float) -> tuple[float, float | None]:
        """Tokens per second so far, and the seconds left at that rate (None before any token is scored)."""
        rate = self.tokens_done / max(now - self._start, 1e-9)
        return rate, ((self.tokens - self.tokens_done) / rate if rate > 0 else None)

    def close(self, ended: bool = True) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(ended=exc_type is None)


class _BarProgress(_Progress):
    """tqdm's bar of lines, with tokens/s and the time left from tokens in place of tqdm's, which come from lines."""

    def __init__(self, total: int, initial: int, tokens: int, written: Callable[[], int | None] | None = None):
        super().__init__(total, initial, tokens)
        self._written = written
        self.bar = tqdm(total=total, initial=initial, unit="seq",
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]", **_unsized(sys.stderr))

    def refresh(self) -> None:
        self._set_left()
        self.bar.refresh()

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self._add(n, tokens)
        self._set_left()
        self.bar.update(n)  # redraws at tqdm's own pace, with the time left just set

    def _set_left(self, stopped: bool = False) -> None:
        rate, left = self._rate_and_left(time.monotonic())
        if left is None:
            shown = ""
        else:  # a stopped run has no time left to give: nothing scores after it
            shown = f"{rate:.0f} tokens/s" + ("" if stopped else f", about {_format_interval(left)} left")
        self.bar.set_postfix_str(shown, refresh=False)

    def close(self, ended: bool = True) -> None:
        """A stopped run's bar is left at the lines in OUT, which the line after it counts: some lines scored may
        not be (those behind a line still scoring, the forward SIGTERM does not wait for, a full disk's)."""
        if not ended:
            self._set_left(stopped=True)
            kept = None if self._written is None else self._written()
            if kept is None:  # no count that could differ from the line after it: the bar is cleared
                self.bar.leave = False
            else:
                self.bar.n = self._initial + kept
        self.bar.close()


def _unsized(stream) -> dict:
    """tqdm's size for a terminal that reports none (0 columns or rows: a pty nobody sized, as `script` run from a
    job makes): tqdm would take -1 from it and draw nothing at all, so it gets an 80x24 terminal's (less 1, as tqdm's)."""
    try:
        columns, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):  # no descriptor (a test's stand-in): tqdm's own size
        return {}
    return {**({"ncols": 79} if columns <= 0 else {}), **({"nrows": 23} if rows <= 0 else {})}


class _LoggedProgress(_Progress):
    """A log line every ``every_s`` seconds, with the rate and what is left: a bar's redraws fill a log file."""

    def __init__(self, total: int, initial: int, tokens: int, every_s: float = 60.0):
        super().__init__(total, initial, tokens)
        self.every_s = every_s
        self._last = self._start
        self._sequences = "sequence" if total == 1 else "sequences"  # "scored 0/1 sequence": the noun follows the total

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self._add(n, tokens)
        self.refresh()

    def refresh(self) -> None:
        """The log line, once ``every_s`` has passed since the last one, whether or not a result came; before
        the first result, the wait's line as often as a "still ..." line, as a warm-up's is in ``serve``."""
        now = time.monotonic()
        every_s = self.every_s if self.count > self._initial else min(self.every_s, still_lines.EVERY_S)
        if now - self._last >= every_s:
            self._last = now
            self._report(now)

    def _report(self, now: float, closing: bool = False) -> None:
        if self.count == self._initial and not closing:  # no rate yet, so no time left to give
            log.info("scored %d/%d %s (none yet after %.0fs: waiting for the first forward's results)",
                     self.count, self.total, self._sequences, now - self._start)
            return
        rate, left = self._rate_and_left(now)
        shown = f", about {left:.0f}s left" if left is not None and self.count < self.total else ""
        log.info("scored %d/%d %s (%.0f tokens/s%s)", self.count, self.total, self._sequences, rate, shown)

    def close(self, ended: bool = True) -> None:
        """The last count, where the run ended: a run stopped (a full disk, a signal) has lines scored that OUT
        lacks, and the line that follows says what OUT holds, so none comes here to read as if it held them."""
        if ended:
            self._report(time.monotonic(), closing=True)
