"""``packscore score``'s OUT: the checks before a run, its lock, its last flush, and why it could not grow."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
from pathlib import Path
from typing import IO

log = logging.getLogger("service.offline")  # the logger the run's other lines come from


class OutputError(OSError):
    """OUT could not be written (disk full, a quota, a file size limit, an I/O error); what it holds is kept."""


def path_problem(input_path: Path, output_path: Path) -> str | None:
    """What keeps these paths from a run, found before the model loads (minutes for a large one)."""
    if str(input_path) != "-" and not input_path.exists():
        return f"{input_path} does not exist"
    if input_path.is_dir():
        return f"{input_path} is a directory; give IN as a file of JSON lines"
    if not input_path.is_file():  # read once to check every line and again to score: a pipe cannot be
        return (f"{input_path} is not a regular file (IN is read more than once, to check every line before scoring, "
                "so stdin or a pipe cannot be IN: write it to a file first)")
    if output_path.exists() and output_path.samefile(input_path):
        return f"-o {output_path} is IN itself; give the results a file of their own"
    if output_path.is_dir():
        return f"-o {output_path} is a directory; give a file"
    if str(output_path) == "-" or (output_path.exists() and not output_path.is_file()):
        shown = "stdout" if str(output_path) == "-" else f"{output_path}, not a regular file,"
        return (f"-o {output_path}: {shown} cannot be OUT (a rerun reads OUT back to resume after the results it "
                "holds): write to a file, then read or compress it from there")
    try:
        output_path.open("ab").close()  # created now, empty: a missing folder or no permission shows here
    except OSError as exc:
        return f"-o {output_path}: cannot write it: {exc.strerror or exc}"
    return None


def remove_if_empty(output_path: Path) -> None:
    """Removes ``output_path`` where it is empty and no other run holds its lock (an OUT this run made, stopped
    before it took the lock); left as it is otherwise, or where it cannot tell."""
    try:
        with output_path.open("rb") as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            here = os.fstat(probe.fileno())
            if here.st_size == 0 and os.path.samestat(here, os.stat(output_path)):
                output_path.unlink()
    except OSError:  # gone already, another run's lock (BlockingIOError), a filesystem without locks
        pass


def close_output(out: IO[bytes]) -> None:
    """Flushed to the disk and closed; a failure (the disk filled) as OutputError."""
    try:
        try:
            out.flush()
            os.fsync(out.fileno())
        finally:
            out.close()  # closes the file also where its flush fails
    except OSError as exc:
        raise OutputError(exc.errno, exc.strerror or str(exc)) from None


def lock_output(output_path: Path) -> IO[bytes] | None:
    """OUT opened and locked (two runs appending to one OUT, a job retried while the first still
    runs, would interleave); None where another run holds the lock."""
    while True:
        lock = output_path.open("ab")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: NFS without its lock daemon, Lustre without -o flock
            log.warning("-o %s: cannot lock it (%s): a second packscore score into it is not refused on this "
                        "filesystem", output_path, exc.strerror or exc)
            return lock
        try:
            here = os.path.samestat(os.fstat(lock.fileno()), os.stat(output_path))
        except FileNotFoundError:
            here = False
        if here:
            return lock
        lock.close()  # a refused first run removed the file between our open and lock: lock the one there now


def cut_torn(output_path: Path, start: int) -> None:
    """OUT cut back to its last whole line from byte ``start`` on, where a write that found no room left part of
    one: a reader of OUT after the failure meets whole lines only (cutting needs no room, nor a raised limit)."""
    try:
        with output_path.open("r+b") as f:
            end = pos = f.seek(0, os.SEEK_END)
            while pos > start:
                step = min(1 << 16, pos - start)
                f.seek(pos - step)
                newline = f.read(step).rfind(b"\n")
                pos -= step
                if newline >= 0:
                    pos += newline + 1
                    break
            if pos < end:
                f.truncate(pos)
    except OSError:  # left for the rerun, which cuts a torn last line too
        log.warning("%s: could not cut off the torn last line; the next run does", output_path)


def whole_lines(output_path: Path, start: int) -> int | None:
    """The whole lines of OUT from byte ``start`` on (a torn last one is cut off by the rerun); None if unreadable."""
    count = 0
    try:
        with output_path.open("rb") as f:
            f.seek(start)
            while chunk := f.read(1 << 20):
                count += chunk.count(b"\n")
    except OSError:
        return None
    return count


def why_full(exc: OutputError) -> tuple[str, str]:
    """Why OUT could not grow, and what lets the same command resume: a file size limit is no full disk."""
    if exc.errno != errno.EFBIG:
        return "", "make room"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # Python ignores SIGXFSZ: the write fails with EFBIG
    if limit != resource.RLIM_INFINITY:
        return (f" (this process's file size limit, RLIMIT_FSIZE or `ulimit -f`, of {limit} bytes; the disk is not "
                "full)", "raise the limit (`ulimit -f unlimited`, or the batch system's file size limit)")
    return (" (the largest file its filesystem holds)",
            "move OUT to a filesystem that holds larger files and give it as -o")
