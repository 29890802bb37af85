"""``packscore score``'s progress counts a line when it is scored, not when it is written: lines are
written in input order, so a slow first line held back every result behind it from the count."""

import logging
import re
import threading
import types

import orjson
import pytest

from service import cli
import service.offline_progress
from service.testing import FakeBackend

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
