"""``--weights-record`` on a shared volume: temporary files of writers killed mid-write are removed,
and the lock is tried at start (docs/weights.md "Surviving a restart"). Real files, real processes."""

import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from service.weights_record import TEMPORARY_LIFETIME_S, WeightsRecord, _writer
from tests.unit.trainer_service import make_weights_root
from tests.unprivileged import unprivileged

pytestmark = pytest.mark.usefixtures("no_packscore_env")

REPO = Path(__file__).resolve().parents[2]
OLD = TEMPORARY_LIFETIME_S + 3600.0  # seconds: past the bound


def _temporary(directory: Path, record: str, writer: str, pid: int, suffix: str = ".tmp", age_s: float = 0.0) -> str:
    """A temporary file as a writer ``writer`` (``host+hash``), process ``pid``, leaves it when killed mid-write."""
    path = directory / f".{record}.{writer}.{pid}.{secrets.token_hex(4)}{suffix}"
    path.write_text('{"format": 1, "models": {')
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path.name


def _dead_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_temporary_files_of_writers_gone_are_removed_at_start_and_at_each_write_and_no_live_writers(tmp_path, caplog):
    root, state = make_weights_root(tmp_path), tmp_path / "state"
    state.mkdir()
    file = state / "record.json"
    own, known = _writer()
    assert known, "this host names no pid namespace (/proc): a dead pid cannot be told from another host's"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead = _dead_pid()
        legacy = [".record.json.old-build.1234.k_x9ab2z.tmp", ".record.json.abcd_123.probe"]  # earlier builds' names
        for name in legacy:  # a day old: by age only
            (state / name).write_text("{")
            os.utime(state / name, (time.time() - OLD,) * 2)
        gone = {_temporary(state, "record.json", own, dead),  # killed mid-write on this host
                _temporary(state, "record.json", own, dead, ".probe"),  # killed while its start probed
                _temporary(state, "record.json", own, os.getpid()),  # this process's: none is being written
                _temporary(state, "record.json", "other-pod+0123abcd", dead, age_s=OLD),  # another host's, a day old
                _temporary(state, "record.json", own, live.pid, age_s=OLD),  # no write lasts a day
                *legacy}
        kept = {_temporary(state, "record.json", own, live.pid),  # a live writer's (it may write without the lock)
                _temporary(state, "record.json", "other-pod+0123abcd", dead),  # another host's pid: not ours to judge
                _temporary(state, "record.json", "other-pod+0123abcd", dead, age_s=TEMPORARY_LIFETIME_S - 600),
                ".record.json.old-build.1234.k_x9ab2z.tmp.keep",
                _temporary(state, "other.json", own, dead),  # another record's
                _temporary(state, "record.json.x", own, dead),  # another record's, whose name extends this one's
                "record.json.notes"}
        (state / "record.json.notes").write_text("an operator's file")
        (state / ".record.json.old-build.1234.k_x9ab2z.tmp.keep").write_text("not a temporary file")
        (state / f".record.json.{own}.{dead}.0badc0de.tmp").mkdir()  # a directory is never removed
        kept.add(f".record.json.{own}.{dead}.0badc0de.tmp")

        with caplog.at_level(logging.INFO, logger="service.weights_record"):
            record = WeightsRecord.open(file, root, {None: "/ckpt/base"})
        left = set(os.listdir(state)) - {"record.json.lock"}
        assert left == kept, f"removed {sorted(kept - left)}, left {sorted(left - kept)}"
        assert f"removed {len(gone)} temporary file(s) of writers gone" in caplog.text, caplog.text

        later = _temporary(state, "record.json", own, dead)  # a writer killed after this server started
        assert record.write("policy", None, root / "step-1", "v1", None)
        assert later not in os.listdir(state)
        assert set(os.listdir(state)) == kept | {"record.json", "record.json.lock"}
        assert json.loads(file.read_text())["models"]["policy"]["version"] == "v1"
    finally:
        live.kill()
        live.wait()


def test_the_record_is_readable_as_a_plain_new_file_is_not_only_by_its_writer(tmp_path):
    """Servers of another user sharing the record, or the operator, must read it: not mkstemp's 0600."""
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    umask = os.umask(0o022)
    try:
        assert WeightsRecord.open(file, root, {None: "/ckpt/base"}).write("policy", None, root / "step-1", "v1", None)
    finally:
        os.umask(umask)
    assert file.stat().st_mode & 0o777 == 0o644, oct(file.stat().st_mode)


# ---- the lock, tried at start -----------------------------------------------------------------


def test_a_filesystem_without_locks_is_said_at_start_once_not_at_the_first_update(tmp_path, monkeypatch, caplog):
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with caplog.at_level(logging.WARNING, logger="service.weights_record"):
        record = WeightsRecord.open(file, root, {None: "/ckpt/base"})
        (warning,) = caplog.records
        assert "cannot be locked (No locks available)" in warning.getMessage() and str(file) in warning.getMessage()
        assert record.write("policy", None, root / "step-1", "p1", None)
        assert record.write("ref", None, root / "step-2", "r2", None)
    assert len(caplog.records) == 1, caplog.text
    assert {n: e["version"] for n, e in json.loads(file.read_text())["models"].items()} == {"policy": "p1", "ref": "r2"}


def test_a_lock_held_by_another_writer_at_start_is_no_warning(tmp_path, caplog):
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nfcntl.lockf(fd, fcntl.LOCK_EX)\n"
                               "print('locked', flush=True)\ntime.sleep(60)", f"{file}.lock"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="service.weights_record"):
            WeightsRecord.open(file, root, {None: "/ckpt/base"})
        assert time.monotonic() - began < 2.0  # tried once, not waited for
        assert not caplog.records, caplog.text
    finally:
        holder.kill()
        holder.wait()


def _serve_with_record(prepare) -> tuple[Path, subprocess.CompletedProcess]:
    """``packscore serve`` as nobody (or this user where the tests do not run as root) with
    ``--weights-record`` in a fresh directory ``prepare(state)`` sets up, and a --model that does not
    exist (the refusal after the record's). Returns the record's path and the finished process."""
    as_user = unprivileged()  # root writes anywhere: the refusals are a user's
    shared = Path(tempfile.mkdtemp())  # tmp_path's parents admit only their owner
    try:
        shared.chmod(0o755)
        root, state = make_weights_root(shared), shared / "state"
        for path in (shared / "root", *(shared / "root").rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        state.mkdir()
        file = state / "record.json"
        prepare(state, file)
        argv = [*as_user, sys.executable, "-m", "service.cli", "serve", "--weights-root", str(root),
                "--weights-record", str(file), "--model", str(shared / "no-such-model")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PACKSCORE_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "service" / "client"), env.get("PYTHONPATH", "")])
        return file, subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    finally:
        shutil.rmtree(shared)


@pytest.mark.parametrize("case", ["directory", "lock-file"])
def test_the_cli_refuses_a_record_it_could_not_write_or_lock_in_one_line_before_anything_loads(case):
    """``packscore serve`` as a process: the directory takes no new file, or FILE.lock (another user's,
    say) cannot be opened to lock it: exit 2 with one line naming it, before the model is even looked at
    (a --model that does not exist would be the next refusal)."""

    def prepare(state: Path, file: Path) -> None:
        if case == "lock-file":  # the directory takes new files; FILE.lock is another's, read-only
            state.chmod(0o777)
            Path(f"{file}.lock").touch(0o444)
        else:
            state.chmod(0o555)

    file, done = _serve_with_record(prepare)
    want = "its directory cannot take a new file" if case == "directory" else \
        f"its lock file '{file}.lock' cannot be opened for writing"
    assert done.returncode == 2 and want in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("packscore: error: --weights-record ") and "Traceback" not in done.stderr, line


@pytest.mark.parametrize("owner", ["another-user", "its-own"])
def test_the_cli_refuses_a_record_another_user_owns_in_a_sticky_directory_in_one_line(owner):
    """A sticky directory (mode 1777, like /tmp) lets only a file's owner (or the directory's) rename
    over it: with FILE another user's, every write would fail while a new file is still taken. Refused
    as nobody in one line naming FILE and the reason; FILE of that user itself passes the record's checks
    (the next refusal is the --model that does not exist)."""
    if os.geteuid() != 0:
        pytest.skip("a record of another user needs root to make it")

    def prepare(state: Path, file: Path) -> None:
        state.chmod(0o1777)
        file.write_text('{"format": 1, "models": {}}')
        file.chmod(0o644)  # readable by every user: only its replacement is refused
        if owner == "its-own":
            os.chown(file, 65534, 65534)

    file, done = _serve_with_record(prepare)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    if owner == "its-own":
        assert "--weights-record" not in line and "no-such-model" in line, line
        return
    assert line.startswith(f"packscore: error: --weights-record '{file}'"), line
    assert "sticky (mode 1777)" in line and "another user's (uid 0)" in line and "every write" in line, line


def test_an_entry_requested_in_this_hosts_future_is_kept_with_a_warning_about_the_clocks(tmp_path, caplog):
    """A server whose clock runs ahead records the future: later updates of others are not recorded
    until their clocks pass it. That is said as a WARNING naming the clocks, not an INFO line."""
    root, file = make_weights_root(tmp_path), tmp_path / "record.json"
    ahead, here = (WeightsRecord.open(file, root, {None: "/ckpt/base"}) for _ in range(2))
    assert ahead.write("policy", None, root / "step-1", "v1", None, requested_at=time.time() + 3600)
    with caplog.at_level(logging.INFO, logger="service.weights_record"):
        assert here.write("policy", None, root / "step-2", "v2", None)  # requested now, by this host's clock
    assert json.loads(file.read_text())["models"]["policy"]["version"] == "v1"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "the clocks of the servers sharing FILE disagree" in message and "'step-2' as 'v2'" in message, message
    assert any(f"requested {s}s after this host's now" in message for s in (3599, 3600)), message
