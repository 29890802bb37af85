"""``packscore score``'s progress counts a line when it is scored, not when it is written: lines are
written in input order, so a slow first line held back every result behind it from the count."""

import threading

import orjson

from service import cli
import service.offline
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
        def __init__(self, total, initial, unit):
            self.n = initial

        def update(self, n=1):
            self.n += n

        def refresh(self):
            if not held.is_set():
                counts.append(self.n)
                if self.n == len(rows) - 1:
                    held.set()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr("service.backends.load_backend", lambda settings: HoldsOneLine(held))
    monkeypatch.setattr(service.offline, "_REFRESH_S", 0.01)
    monkeypatch.setattr(service.offline, "tqdm", Bar)
    monkeypatch.setattr(service.offline.sys.stderr, "isatty", lambda: True)
    # rows of one sequence each, so that the others need not wait for the first one's row
    assert cli.main(["score", str(source), "-o", str(out), "--max-batch-tokens", "8"]) == 0
    assert counts and max(counts) == len(rows) - 1, f"count while the first line was held: {counts[-5:]}"
    assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [r["id"] for r in rows]
