"""``packscore score``'s progress counts a line when it is scored, not when it is written: lines are
written in input order, so a slow first line held back every result behind it from the count."""

import contextlib
import fcntl
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import types

import orjson
import pytest

from service import cli
import service.offline_progress
from service.testing import FakeBackend
from tests.unit.test_offline import score_under_file_size_limit

HELD = 999  # the first token of the line whose forward waits for the gate


class HoldsOneLine(FakeBackend):
    """Two forwards at once; the row holding the line that starts with HELD waits for ``held``."""

    def __init__(self, held: threading.Event):
        super().__init__(concurrency=2)
        self.held = held

    def score_row(self, sequences, group=None):
        if any(int(s.input_ids[0]) == HELD for s in sequences):
            self.held.wait(timeout=5)
        return super().score_row(sequences, group)


def test_progress_counts_lines_scored_behind_a_slow_first_line(monkeypatch, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "first", "input_ids": [HELD] + [1] * 7}] + [{"id": f"r{i}", "input_ids": [2] * 8} for i in range(5)]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    held = threading.Event()
    counts = []  # the bar's count at each redraw while the first line is still held

    class Bar:
        def __init__(self, total, initial, unit, bar_format):
            self.n = initial

        def set_postfix_str(self, s, refresh):
            pass

        def update(self, n=1):
            self.n += n

        def refresh(self):
            if not held.is_set():
                counts.append(self.n)
                if self.n == len(rows) - 1:
                    held.set()

        def close(self):
            pass

    monkeypatch.setattr("service.backends.load_backend", lambda settings: HoldsOneLine(held))
    monkeypatch.setattr(service.offline_progress, "_REFRESH_S", 0.01)
    monkeypatch.setattr(service.offline_progress, "tqdm", Bar)
    monkeypatch.setattr(service.offline_progress.sys.stderr, "isatty", lambda: True)
    # rows of one sequence each, so that the others need not wait for the first one's row
    assert cli.main(["score", str(source), "-o", str(out), "--max-batch-tokens", "8"]) == 0
    assert counts and max(counts) == len(rows) - 1, f"count while the first line was held: {counts[-5:]}"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in rows]


class TokenClock(FakeBackend):
    """A forward takes a second per 100 tokens on ``now``, the clock the progress reads: a fake model's real
    forwards take no time, and a real clock would make the time left vary with the machine's load."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def monotonic(self):
        return self.now

    def score_row(self, sequences, group=None):
        self.now += sum(len(s.input_ids) for s in sequences) / 100
        return super().score_row(sequences, group)


@pytest.mark.parametrize("terminal", [False, True], ids=["log-line", "bar"])
def test_time_left_follows_tokens_when_the_first_line_is_the_longest(monkeypatch, tmp_path, caplog, terminal):
    """With the longest lines first, a time left from lines was many times the time left near the end."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "long", "input_ids": [1] * 2000}] + [{"id": f"r{i}", "input_ids": [2] * 10} for i in range(5)]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    backend = TokenClock()
    shown = []  # the time left in seconds, each time it is shown before the end

    class Bar:
        def __init__(self, total, initial, unit, bar_format):
            pass

        def set_postfix_str(self, s, refresh):
            if (found := re.search(r"about (\d+):(\d\d) left", s)) is not None:
                shown.append(int(found[1]) * 60 + int(found[2]))

        def update(self, n=1):
            pass

        def refresh(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr("service.backends.load_backend", lambda settings: backend)
    monkeypatch.setattr(service.offline_progress, "time", types.SimpleNamespace(monotonic=backend.monotonic))
    monkeypatch.setattr(service.offline_progress, "_LOG_EVERY_S", 0.0)  # a line at each result
    monkeypatch.setattr(service.offline_progress, "tqdm", Bar)
    monkeypatch.setattr(service.offline_progress.sys.stderr, "isatty", lambda: terminal)
    with caplog.at_level(logging.INFO, logger="service.offline"):
        assert cli.main(["score", str(source), "-o", str(out)]) == 0
    if not terminal:
        shown = [float(m) for m in re.findall(r"about (\d+)s left", caplog.text)]
    # 50 tokens are left after the first line's 2000 took 20 s; from lines it read 5 lines at 20 s each
    assert shown and max(shown) <= 1, f"time left shown (s): {shown}, tolerance 1 s; log: {caplog.text[-1000:]}"
    assert len(out.read_bytes().splitlines()) == len(rows)


# A fake model of two forwards at once whose forward of the line starting with HELD takes 30 s: the lines after it
# are scored (and counted by the bar) but wait behind it to be written.
_HELD_FIRST_LINE_RUN = f"""
import sys, time
from service import entrypoint
from service.testing import FakeBackend
import service.backends

class HoldsOneLine(FakeBackend):
    def score_row(self, sequences, group=None):
        if any(int(s.input_ids[0]) == {HELD} for s in sequences):
            time.sleep(30)
        return super().score_row(sequences, group)

service.backends.load_backend = lambda settings: HoldsOneLine(concurrency=2)
sys.argv = ["packscore", *sys.argv[1:]]
sys.exit(entrypoint.main())
"""


def test_the_bar_of_a_stopped_run_is_left_at_the_lines_in_out_not_those_scored(tmp_path):
    """On a terminal, SIGTERM while the first line scores: the bar ends at the lines in OUT (0/6), not at the 5
    lines scored behind it, above the line saying that none of them is in OUT."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "first", "input_ids": [HELD] + [1] * 7}] + [{"id": f"r{i}", "input_ids": [2] * 8} for i in range(5)]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    terminal, stderr = os.openpty()
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's width for tqdm
    # rows of one sequence each, so that the others need not wait for the first one's row
    run = subprocess.Popen([sys.executable, "-c", _HELD_FIRST_LINE_RUN, "score", str(source), "--max-batch-tokens",
                            "8", "--log-level", "warning", "-o", str(out)], stderr=stderr, stdin=subprocess.DEVNULL)
    os.close(stderr)
    shown = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):  # EIO once the child has exited
            while chunk := os.read(terminal, 4096):
                shown.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while b" 5/6 " not in shown:  # the bar drew the lines scored behind the first
        assert run.poll() is None and time.monotonic() < deadline, shown.decode(errors="replace")[-2000:]
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    code = run.wait(timeout=60)
    reader.join(timeout=10)
    os.close(terminal)
    text = shown.decode(errors="replace")
    assert code == 143, f"exit {code}:\n{text[-2000:]}"
    assert not out.exists() or out.read_bytes() == b"", "a line was written behind the first one"
    draws = [part for part in re.split(r"[\r\n]+", text) if re.search(r" \d/6 ", part)]
    said = text.strip().splitlines()[-1]
    assert f"terminated (SIGTERM); 0 of the 6 lines of {source} are in {out}" in said, text[-2000:]
    assert " 0/6 " in draws[-1] and "left" not in draws[-1], f"the bar last showed {draws[-1]!r} above {said!r}"


def test_the_bar_of_a_run_stopped_by_a_full_disk_is_left_at_the_lines_in_out(monkeypatch, tmp_path, capsys):
    """A file size limit fails OUT's writes part way through: the bar shows the whole lines OUT holds, counted once
    OUT is closed, as the error line after it does, not the lines scored."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "input_ids": list(range(1, 200))}) + b"\n"
                                for i in range(60)))
    closed_at = []

    class Bar:
        def __init__(self, total, initial, unit, bar_format):
            self.n = initial

        def set_postfix_str(self, s, refresh):
            self.postfix = s

        def update(self, n=1):
            self.n += n

        def refresh(self):
            pass

        def close(self):
            closed_at.append((self.n, self.postfix))

    monkeypatch.setattr("service.backends.load_backend", lambda settings: FakeBackend())
    monkeypatch.setattr(service.offline_progress, "tqdm", Bar)
    monkeypatch.setattr(service.offline_progress.sys.stderr, "isatty", lambda: True)
    code = score_under_file_size_limit(source, out, 20_000)
    err = capsys.readouterr().err
    in_out = out.read_bytes().count(b"\n")
    assert code == 1 and f"{in_out} of the 60 lines of {source} are in {out}" in err, err[-2000:]
    assert closed_at == [(in_out, closed_at[0][1])] and "left" not in closed_at[0][1], (closed_at, in_out)


def test_the_wait_for_the_first_result_is_logged_as_often_as_a_still_line(monkeypatch, caplog):
    """A first forward on a GPU compiles its kernels (about a minute with an empty cache): its wait is said every
    still_lines.EVERY_S, as serve's "still warming up" is, and the lines with a rate come once a minute after it."""
    import model_runtime.still_lines

    clock = [0.0]
    monkeypatch.setattr(service.offline_progress, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(model_runtime.still_lines, "EVERY_S", 30.0)
    progress = service.offline_progress._LoggedProgress(total=4, initial=1, tokens=40, every_s=60.0)
    said = []
    with caplog.at_level(logging.INFO, logger="service.offline"):
        for at, scored in ((29.0, 0), (30.0, 0), (45.0, 0), (60.0, 0), (70.0, 1), (100.0, 0), (120.0, 0)):
            clock[0] = at
            progress.update(scored, 10 * scored) if scored else progress.refresh()
            said.append((at, [r.getMessage() for r in caplog.records]))
            caplog.clear()
    lines = [(at, messages) for at, messages in said if messages]
    assert [at for at, _ in lines] == [30.0, 60.0, 120.0], said
    assert all("none yet after" in m[0] for _, m in lines[:2]) and "tokens/s" in lines[2][1][0], said


def test_the_bar_shows_on_a_terminal_that_reports_no_size(tmp_path):
    """A pty nobody sized (0x0: `script` run from a job, `os.openpty()`) is a terminal to tqdm, whose bar takes
    -1 columns and rows from it and drew nothing: no bar and no log line. The real command, on the tiny preset."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "input_ids": [1, 2, 3, 4]}) + b"\n" for i in range(3)))
    terminal, stderr = os.openpty()
    assert os.get_terminal_size(stderr) == (0, 0)
    run = subprocess.Popen([sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out), "--log-level",
                            "warning"], stderr=stderr, stdin=subprocess.DEVNULL,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(stderr)
    shown = bytearray()
    with contextlib.suppress(OSError):  # EIO once the child has exited
        while chunk := os.read(terminal, 4096):
            shown.extend(chunk)
    code = run.wait(timeout=120)
    os.close(terminal)
    text = shown.decode(errors="replace")
    assert code == 0 and len(out.read_bytes().splitlines()) == 3, text[-2000:]
    assert re.search(r"100%\|[^\r\n]*\| 3/3 \[", text), f"no bar drawn on the terminal:\n{text[-2000:]}"
