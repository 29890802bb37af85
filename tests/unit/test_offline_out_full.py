"""``packscore score`` stopped because OUT cannot grow: a full disk (ENOSPC) or a file size limit
(``ulimit -f``: Python ignores SIGXFSZ, so the write fails with EFBIG). The last line names which it
was, how many lines of IN OUT holds, and what to do before the same command resumes after them."""

import random
import resource
import subprocess
import sys

import orjson

# A fake model; with argv[1] > 0, OUT's writes fail with ENOSPC once argv[1] bytes went to it, part
# way through a write as a full disk fails them (the file written as far as there was room).
_RUN = """
import errno, io, os, pathlib, sys
from service import cli
from service.testing import FakeBackend
import service.backends

room, out = int(sys.argv[1]), sys.argv[-1]

class FullDisk(io.RawIOBase):
    def __init__(self, path):
        self.fd, self.room = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), room
    def writable(self):
        return True
    def write(self, data):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(self.fd, bytes(data[:self.room]))
        self.room -= n
        return n
    def fileno(self):
        return self.fd
    def close(self):
        if not self.closed:
            os.close(self.fd)
        super().close()

real_open = pathlib.Path.open
def open_(self, mode="r", *args, **kwargs):
    if room and str(self) == out and mode == "ab":
        return io.BufferedWriter(FullDisk(self), buffer_size=1024)
    return real_open(self, mode, *args, **kwargs)

pathlib.Path.open = open_
service.backends.load_backend = lambda settings: FakeBackend()
sys.exit(cli.main(sys.argv[2:]))
"""

_ROWS = [{"id": f"r{i}", "input_ids": list(range(1, 200))} for i in range(60)]


def _score(tmp_path, room=0, preexec_fn=None):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _ROWS))
    argv = [sys.executable, "-c", _RUN, str(room), "score", str(source), "-o", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=preexec_fn)


def _resumes(tmp_path, kept):
    """OUT holds whole lines only (a script reading it after exit 1 meets no half line), and the same
    command completes it to what one uninterrupted run writes."""
    out, ref = tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    assert out.read_bytes().count(b"\n") == kept
    assert out.read_bytes().endswith(b"\n") or not out.read_bytes(), out.read_bytes()[-200:]
    for target in (out, ref):
        done = subprocess.run([sys.executable, "-c", _RUN, "0", "score", str(tmp_path / "in.jsonl"), "-o", str(target)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes() == ref.read_bytes()


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_a_file_size_limit_is_named_as_one_not_as_a_full_disk(tmp_path):
    """`ulimit -f` (a batch system's file size limit) fails the write with EFBIG: the run names the limit,
    since 'make room' would send the operator to clean a disk that has room."""
    done = _score(tmp_path, preexec_fn=_limit_file_size)
    err = done.stderr
    assert done.returncode == 1 and "Traceback" not in err, f"exit {done.returncode}:\n{err[-2000:]}"
    last = err.splitlines()[-1]
    kept = (tmp_path / "out.jsonl").read_bytes().count(b"\n")
    assert "make room" not in err, last
    for said in ("File too large", "file size limit", "ulimit -f", "20000 bytes",
                 f"{kept} of the 60 lines of {tmp_path / 'in.jsonl'} are in {tmp_path / 'out.jsonl'}",
                 "raise the limit", "the same command"):
        assert said in last, f"{said!r} not in the last line: {last}"
    _resumes(tmp_path, kept)


def test_a_full_disk_ends_with_what_out_holds_then_what_to_do(tmp_path):
    """The log's last progress line said every line was scored, after it the error line said only
    that 'the results written before' were kept: read from the tail, the run looked complete."""
    done = _score(tmp_path, room=20_000)
    err = done.stderr
    assert done.returncode == 1 and "Traceback" not in err, f"exit {done.returncode}:\n{err[-2000:]}"
    kept = (tmp_path / "out.jsonl").read_bytes().count(b"\n")
    assert 0 < kept < 60, kept
    assert "scored 60/60" not in err, err[-2000:]
    last = err.splitlines()[-1]
    said = ["No space left on device", f"{kept} of the 60 lines of {tmp_path / 'in.jsonl'} are in "
            f"{tmp_path / 'out.jsonl'}", "make room, then run the same command"]
    where = [last.find(s) for s in said]
    assert -1 not in where and where == sorted(where), f"the last line does not say {said} in order: {last}"
    _resumes(tmp_path, kept)


def test_the_real_model_stopped_by_a_file_size_limit_exits_1_with_that_line_last(tmp_path):
    """With torch's model (not the fake), the run printed its line, then aborted in the interpreter's
    teardown ("terminate called without an active exception", exit 134): the forward thread, still
    ending a row the closed scheduler had queued, outlived the wait for forwards under way."""
    rng = random.Random(0)
    rows = [{"id": f"r{i}", "input_ids": [rng.randrange(1, 4096) for _ in range(500)], "score_from": 100}
            for i in range(50)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    for attempt in range(3):  # where the thread stands when the write fails varies: each run could abort
        out = tmp_path / f"out-{attempt}.jsonl"
        done = subprocess.run([sys.executable, "-m", "service.cli", "score", str(source), "-o", str(out)],
                              capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size)
        last = done.stderr.splitlines()[-1]
        assert done.returncode == 1 and "cannot write" in last, f"exit {done.returncode}:\n{done.stderr[-2000:]}"


def test_one_line_in_out_is_said_in_the_singular(tmp_path):
    """"1 of the 60 lines ... are in" read as a typo in the line an operator acts on."""
    assert _score(tmp_path).returncode == 0  # OUT complete, then cut to its first line: the rerun resumes after it
    out = tmp_path / "out.jsonl"
    out.write_bytes(out.read_bytes().splitlines(keepends=True)[0])
    done = _score(tmp_path, room=1)
    last = done.stderr.splitlines()[-1]
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"1 of the 60 lines of {tmp_path / 'in.jsonl'} is in {out}, in input order" in last, last
