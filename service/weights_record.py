"""``--weights-record FILE``: the last weight update of each served model, kept across restarts.

After every successful ``POST /v1/weights`` the server rewrites FILE atomically (a temporary file
in the same directory, flushed and fsynced, then renamed over it)::

    {"format": 1, "models": {"policy": {"model": "/ckpt/step-0", "path": "step-120", "version": "step-120",
                                        "requested_at": 1733480000.25,
                                        "files": [["config.json", 1234, 1733480000000000000], ...]}}}

``model`` is the ``--model`` source the process was started with, as configured; ``path`` the
update's checkpoint relative to ``--weights-root``; ``requested_at`` the wall-clock time the
update's request arrived (absent in older records: 0); ``files`` the name, size and modification
time of each file its weights were read from. Several servers may share FILE (a ReadWriteMany
volume): each write reads FILE again under a lock on ``FILE.lock`` and replaces one model's entry
only with an update requested at the same time or later, keeping every other entry as it finds
it, so that a new replica starts at the last update any of them recorded. At start, before the server is ready, a served
model whose entry names its own ``--model`` source is swapped to the recorded checkpoint through
the route's own checks and serves it under the recorded version. A model whose recorded checkpoint
cannot be served is withheld (``Withheld``): serving ``--model`` instead would silently score with
other weights than the trainer last sent, so the process waits, not ready, for that model's next
update. A record that cannot be read or kept refuses the start (``RecordError``). The lock is tried
once at start too, and temporary files left by writers killed mid-write are removed under it, at
start and at each write (``_remove_stale_temporaries``). docs/weights.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    from service.settings import Settings

log = logging.getLogger(__name__)

FORMAT = 1
LOCK_WAIT_S = 10.0  # a write takes milliseconds: a lock held this long belongs to a stuck writer
# a write of a few KB takes milliseconds, even a stalled NFS mount's minutes: a temporary file a day
# old has no live writer on any host, whatever the clocks of the hosts and the file server
TEMPORARY_LIFETIME_S = 24 * 3600.0
CLOCK_SLACK_S = 1.0  # NTP keeps hosts within milliseconds: an entry further in the future shows a skewed clock

# fcntl locks are the process's own: threads of one process (two records of one file) queue here first
_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


class RecordError(ValueError):
    """The record cannot be read or kept: the start is refused before anything loads."""


class UnservableError(Exception):
    """A recorded checkpoint cannot be served now: ``reason`` in full (paths included), ``summary``
    without paths (for ``GET /readyz``, which answers without a key)."""

    def __init__(self, reason: str, summary: str):
        super().__init__(reason)
        self.reason, self.summary = reason, summary


@dataclass(frozen=True)
class RecordedUpdate:
    """One model's entry: the last update it served."""

    model: str  # the --model source the process that wrote it was started with
    path: str  # the checkpoint, relative to --weights-root
    version: str  # the weights_version it served under
    files: tuple | None = None  # ``files_snapshot`` of the checkpoint when it was loaded; None: not recorded
    requested_at: float = 0.0  # wall-clock seconds when its request arrived; 0: an older record's entry

    @classmethod
    def from_json(cls, raw: dict) -> RecordedUpdate:
        return cls(raw["model"], raw["path"], raw["version"],
                   None if raw.get("files") is None else tuple(tuple(f) for f in raw["files"]),
                   float(raw.get("requested_at", 0.0)))

    def as_json(self) -> dict:
        entry = {"model": self.model, "path": self.path, "version": self.version, "requested_at": self.requested_at}
        if self.files is not None:
            entry["files"] = [list(f) for f in self.files]
        return entry


def unservable(exc: Exception) -> UnservableError:
    """Why the recorded checkpoint could not be swapped in, whatever refused it: the path's checks, the
    checkpoint's (``CheckpointError``) or its load."""
    from model_runtime.scoring.checkpoint_error import CheckpointError
    from service.http.weights import checkpoint_refused

    if isinstance(exc, UnservableError):
        return exc
    if isinstance(exc, CheckpointError):  # named as the route's 422 would name it
        return UnservableError(str(exc), f"the checkpoint was refused ({checkpoint_refused(exc).type})")
    return UnservableError(f"loading it failed: {exc}", "loading it failed")


@dataclass(frozen=True)
class Withheld:
    """A served model whose recorded checkpoint could not be served at start: it scores nothing
    until a weight update for it succeeds."""

    entry: RecordedUpdate
    reason: str  # why, in full: the log, /score's 503 and /v1/models (behind the key)
    summary: str  # why, without paths: /readyz

    def card(self) -> dict:
        """``awaiting_weights`` of the model's /v1/models entry."""
        return {"path": self.entry.path, "version": self.entry.version, "reason": self.reason}


def describe_withheld(withheld: Mapping[str, Withheld], *, full: bool) -> str:
    """What the models named in ``withheld`` wait for, in one sentence's clause; ``full``: with the
    recorded path and version and the whole reason, else the summary only."""
    parts = [f"{name!r} (its recorded checkpoint {w.entry.path!r}, version {w.entry.version!r}, cannot be served: "
             f"{w.reason})" if full else f"{name!r} (its recorded checkpoint cannot be served: {w.summary})"
             for name, w in withheld.items()]
    one = len(parts) == 1
    return (f"{', '.join(parts)} {'waits' if one else 'wait'} for a weight update (POST /v1/weights) and "
            f"{'scores' if one else 'score'} nothing until then")


class WeightsRecord:
    """The record file, its entries as read at start, and each served model's configured source.

    ``sources``: ``--model`` as configured (before a hub id is resolved), keyed as
    ``Settings.model_specs()`` keys it (None for a plain ``--model X``).
    """

    def __init__(self, file: Path, root: Path, sources: Mapping[str | None, str], entries: dict[str, dict]):
        self.file, self.root = Path(file), Path(root)
        self.sources = dict(sources)
        self._entries = entries  # served name -> entry as JSON, as read at start
        self.lock_file = self.file.with_name(self.file.name + ".lock")
        self._unlocked_logged = False  # a filesystem without locks is said once, not at every update

    @classmethod
    def from_settings(cls, settings: Settings) -> WeightsRecord | None:
        """``--weights-record`` opened (None when unset), with ``--model`` as configured: before a
        hub id becomes a cache directory, so that the entries keep naming the hub id."""
        if settings.weights_record is None:
            return None
        if settings.weights_root is None:
            raise RecordError(f"--weights-record {str(settings.weights_record)!r} records weight updates, which need "
                              "--weights-root DIR: give both, or unset --weights-record")
        return cls.open(settings.weights_record, settings.weights_root, settings.model_specs())

    @classmethod
    def open(cls, file: Path, root: Path, sources: Mapping[str | None, str]) -> "WeightsRecord":
        """Reads FILE (absent: no entry yet), checks that its directory takes a new file, that a new
        file may replace FILE (a sticky directory's) and that ``FILE.lock`` opens, so that the first
        update cannot fail late, and tries the lock once: a filesystem that locks nothing is said
        now, and temporary files of writers gone are removed."""
        file = Path(file)
        where = f"--weights-record {str(file)!r}"
        if not file.parent.is_dir():
            raise RecordError(f"{where}: its directory {str(file.parent)!r} does not exist; create it, or record "
                              "elsewhere")
        if file.exists() and not file.is_file():
            raise RecordError(f"{where} is not a regular file")
        record = cls(file, root, sources, {})
        with _process_lock(file):  # this process's temporary files are made and removed under it only
            try:  # a real file, as each write makes one: permissions, a read-only mount, a full disk
                fd, probe = _create_temporary(file, ".probe")
                os.close(fd)
                os.unlink(probe)
            except OSError as exc:
                raise RecordError(f"{where}: its directory cannot take a new file: {exc.strerror or exc}") from None
            refused = _replacement_refused(file)
            if refused is not None:
                raise RecordError(f"{where}: {refused}")
            try:
                fd = os.open(record.lock_file, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:  # another user's lock file, say: every write would go unlocked
                raise RecordError(f"{where}: its lock file {str(record.lock_file)!r} cannot be opened for writing: "
                                  f"{exc.strerror or exc}; make it writable by this server's user (uid {os.getuid()}), "
                                  "as by every server sharing FILE") from None
            try:
                locked = record._lock_or_warn(fd, 0.0)
                if locked is not False:  # locked, or a filesystem without locks: the writes go on without one too
                    _remove_stale_temporaries(file)
            finally:
                os.close(fd)  # releases the lock
        record._entries = _read_entries(file)
        return record

    # ---- at start -----------------------------------------------------------------------------

    def entry_for(self, name: str, key: str | None) -> RecordedUpdate | None:
        """The update to restore for served model ``name`` (``--model`` key ``key``), or None:
        none recorded, or one recorded for another ``--model`` source (warned; kept for the servers
        started with that source, until an update of ``name`` replaces it)."""
        source = self.sources[key]
        raw = self._entries.get(name)
        if raw is None:
            return None
        entry = RecordedUpdate.from_json(raw)
        if entry.model != source:
            log.warning("%s: the entry of %r was recorded for --model %s, not %s as now: ignored (serving --model; "
                        "kept until an update of %r replaces it)", self.file, name, entry.model, source, name)
            return None
        return entry

    def warn_unserved(self, served: set[str]) -> None:
        for name in sorted(set(self._entries) - served):
            log.warning("%s: model %r has an entry but is not served: ignored (kept)", self.file, name)

    def withhold(self, name: str, entry: RecordedUpdate, error: UnservableError) -> Withheld:
        """``name`` waits for an update: the ERROR paragraph naming the entry, the reason and the remedies."""
        log.error(
            "--weights-record %s: model %r last served %r under --weights-root %s as version %r, which cannot be "
            "served now: %s. Serving --model %s instead would silently score with other weights than the last "
            "update's, so %r scores nothing and the server stays not ready (awaiting_weights) until a weight update "
            "of %r succeeds: send one (POST /v1/weights; update_weights_everywhere reaches pods not ready), or "
            "delete %s and restart to serve --model %s.",
            self.file, name, entry.path, self.root, entry.version, error.reason.rstrip("."), entry.model, name, name,
            self.file, entry.model)
        return Withheld(entry, error.reason.rstrip("."), error.summary)

    def checked_path(self, entry: RecordedUpdate) -> Path:
        """The recorded checkpoint, resolved inside --weights-root as the route resolves it, with
        the files its weights were read from unchanged since; else ``UnservableError``."""
        from model_runtime.scoring.weights import files_snapshot
        from service.http.errors import ApiError
        from service.http.weights import resolve_checkpoint

        try:
            path = resolve_checkpoint(self.root, entry.path)
        except ApiError as exc:
            summary = "it leaves --weights-root" if exc.status == 403 else "it is no directory under --weights-root"
            raise UnservableError(exc.message.rstrip("."), summary) from None
        if entry.files is not None:
            now = files_snapshot(path)
            if now != entry.files:
                changed = sorted({f[0] for f in set(now) ^ set(entry.files)})
                raise UnservableError(f"its files changed since it was recorded ({', '.join(changed[:5])}"
                                      f"{', ...' if len(changed) > 5 else ''}), so {entry.version!r} would name other "
                                      "weights", "its files changed since it was recorded")
        return path

    # ---- after an update ----------------------------------------------------------------------

    def write(self, name: str, key: str | None, path: Path, version: str, files: tuple | None,
              serving: Callable[[], str] | None = None, requested_at: float | None = None) -> bool:
        """Records that ``name`` serves ``path`` as ``version``, an update requested at ``requested_at``
        (wall-clock seconds; None: now); never raises. Whether it was written or rightly skipped: a
        failure is logged, and the update, which already serves, stands. ``serving`` (the version the
        model serves now) skips a write that a later update of this process overtook; an entry in FILE
        requested later (by another server sharing it) is kept."""
        requested_at = time.time() if requested_at is None else requested_at
        try:
            relative = Path(path).resolve().relative_to(self.root.resolve()).as_posix()
            entry = RecordedUpdate(self.sources[key], relative, version, files, requested_at)
            with _process_lock(self.file), self._file_lock():
                if serving is not None and serving() != version:  # a later update serves, and records itself
                    return True
                entries = _read_entries(self.file)  # again: other servers may have written since
                later = entries.get(name)
                if later is not None and RecordedUpdate.from_json(later).requested_at > requested_at:
                    same = (later["path"], later["version"]) == (relative, version)
                    ahead = RecordedUpdate.from_json(later).requested_at - time.time()
                    if not same and ahead > CLOCK_SLACK_S:  # only a clock ahead of this host's records the future
                        log.warning("--weights-record %s: %s keeps %r as %r, requested %.0fs after this host's now, "
                                    "over this update (%r as %r): the clocks of the servers sharing FILE disagree, "
                                    "and until this host's clock passes that time its updates of %s are not recorded; "
                                    "sync the clocks (NTP)", self.file, name, later["path"], later["version"], ahead,
                                    relative, version, name)
                        return True
                    log.log(logging.DEBUG if same else logging.INFO,
                            "--weights-record %s: %s keeps %r as %r, an update requested after this one (%r as %r)",
                            self.file, name, later["path"], later["version"], relative, version)
                    return True
                entries[name] = entry.as_json()
                data = json.dumps({"format": FORMAT, "models": entries}, indent=2, sort_keys=True).encode() + b"\n"
                write_atomically(self.file, data)
        except Exception as exc:  # the new weights serve already: a lost record must not undo the 200
            log.error("--weights-record %s: recording %s serving %s as %r failed: %s; the update stands, but a "
                      "restart would not restore it", self.file, name, path, version, exc)
            return False
        return True

    @contextlib.contextmanager
    def _file_lock(self):
        """``FILE.lock`` locked (fcntl) for one read-merge-write. Where the filesystem takes no lock
        (or a stuck writer holds it), the write goes on without it, said in a WARNING: a whole
        record still replaces the old one, but two servers writing at once may lose one's entry.
        Temporary files of writers gone are removed meanwhile."""
        fd = None
        try:
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            self._say_unlocked(exc)
        try:
            if fd is not None:
                self._lock_or_warn(fd, LOCK_WAIT_S)
            _remove_stale_temporaries(self.file)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def _lock_or_warn(self, fd: int, wait_s: float) -> bool | None:
        """True: locked; False: another writer held it past ``wait_s`` (WARNING unless ``wait_s`` is 0,
        the try at start); None: the filesystem locks nothing (one WARNING for the process's life)."""
        try:
            _lock_exclusively(fd, wait_s)
            return True
        except TimeoutError:
            if wait_s > 0:
                log.warning("--weights-record %s: %s stayed locked by another writer for %.0fs: writing without it",
                            self.file, self.lock_file, wait_s)
            return False
        except OSError as exc:
            self._say_unlocked(exc)
            return None

    def _say_unlocked(self, exc: OSError) -> None:
        if not self._unlocked_logged:
            self._unlocked_logged = True
            log.warning("--weights-record %s: %s cannot be locked (%s): writing without a lock from now on; "
                        "servers sharing FILE that write at the same moment may lose one of their entries",
                        self.file, self.lock_file, exc.strerror or exc)


def _process_lock(file: Path) -> threading.Lock:
    key = os.path.realpath(file)
    with _process_locks_guard:
        return _process_locks.setdefault(key, threading.Lock())


def _lock_exclusively(fd: int, wait_s: float) -> None:
    """An exclusive fcntl lock on ``fd`` within ``wait_s`` (``TimeoutError`` past it); any other
    OSError: the filesystem locks nothing (ENOLCK on NFS without a lock manager, EOPNOTSUPP)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a POSIX lock: the kind NFS passes between hosts
            return
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            raise TimeoutError(errno.ETIMEDOUT, "held by another writer")
        time.sleep(0.02)


def _replacement_refused(file: Path) -> str | None:
    """Why renaming a new file over FILE would fail where a new file is taken: a sticky directory
    (mode 1777, like /tmp) lets only FILE's owner, the directory's or a process with CAP_FOWNER
    replace it. None where nothing says so."""
    try:
        own, directory = os.lstat(file), os.stat(file.parent)
    except OSError:  # no FILE yet: the first write makes it this server's
        return None
    me = os.geteuid()
    if not directory.st_mode & stat.S_ISVTX or me in (own.st_uid, directory.st_uid) or _may_replace_any_file():
        return None
    return (f"its directory {str(file.parent)!r} is sticky (mode {stat.S_IMODE(directory.st_mode):o}) and the record "
            f"is another user's (uid {own.st_uid}): only its owner may rename over it, so every write by this server "
            f"(uid {me}) would fail; run every server sharing the record as one user, chown it to uid {me}, or record in a "
            "directory without the sticky bit")


def _may_replace_any_file() -> bool:
    """Whether this process holds CAP_FOWNER, which the sticky bit does not bind (root's, usually)."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line.split()[1] for line in f if line.startswith("CapEff:"))
        return bool(int(caps, 16) >> 3 & 1)  # CAP_FOWNER is capability 3
    except (OSError, StopIteration, ValueError, IndexError):
        return os.geteuid() == 0


def write_atomically(file: Path, data: bytes) -> None:
    """``data`` as FILE's whole content, never seen in part: written to a temporary file beside it,
    flushed to disk, renamed over FILE, and the directory's entry flushed too."""
    fd, tmp = _create_temporary(file, ".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    directory = os.open(file.parent, os.O_RDONLY)
    try:  # the rename itself survives a power loss only once the directory is on disk
        os.fsync(directory)
    finally:
        os.close(directory)


def _writer() -> tuple[str, bool]:
    """This process's writer name in its temporary files' names: the host, then a hash of the boot and
    the pid namespace (containers of one host, or pods with the host's network, share a host name but
    not their pids); and whether that hash is known, so that a pid in it can be checked here."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"{host}+00000000", False
    return f"{host}+{hashlib.sha256(f'{boot} {namespace}'.encode()).hexdigest()[:8]}", True


def _create_temporary(file: Path, suffix: str) -> tuple[int, str]:
    """A new file ``.FILE.<writer>.<pid>.<8 hex><suffix>`` beside FILE, opened for writing; its mode
    is a plain new file's (umask applied), which FILE takes with the rename: other users may read it."""
    writer, _ = _writer()
    for _ in range(100):
        tmp = os.path.join(file.parent, f".{file.name}.{writer}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", str(file.parent))


def _remove_stale_temporaries(file: Path) -> None:
    """Removes FILE's temporary files whose writer is certainly gone: of this pid namespace and a pid
    not alive (or this process's own: under its process lock none is being written), or of any
    writer, older than TEMPORARY_LIFETIME_S (a writer killed mid-write leaves its file, on a volume
    that outlives every pod). Earlier builds' names (``.FILE.<host>.<pid>.<random>.tmp``,
    ``.FILE.<random>.probe``) go by age only. Never raises: it is housekeeping."""
    own, certain = _writer()
    name = re.escape(file.name)
    ours = re.compile(rf"\.{name}\.(?P<writer>[A-Za-z0-9-]+\+[0-9a-f]{{8}})\.(?P<pid>[0-9]+)"
                      r"\.[0-9a-f]{8}\.(?:tmp|probe)")
    any_build = re.compile(rf"\.{name}\.(?:.+\.)?[A-Za-z0-9_]{{8}}\.(?:tmp|probe)")
    removed = []
    try:
        names = os.listdir(file.parent)
    except OSError:
        return
    now = time.time()
    for entry in names:
        match = ours.fullmatch(entry)
        if match is None and any_build.fullmatch(entry) is None:
            continue
        path = file.parent / entry
        try:
            st = path.lstat()
            gone = (match is not None and certain and match["writer"] == own and not _alive(int(match["pid"])))
            if stat.S_ISREG(st.st_mode) and (gone or now - st.st_mtime > TEMPORARY_LIFETIME_S):
                path.unlink()
                removed.append(entry)
        except OSError:  # removed meanwhile by another server, or not ours to remove
            continue
    if removed:
        log.info("--weights-record %s: removed %d temporary file(s) of writers gone (killed mid-write): %s",
                 file, len(removed), ", ".join(sorted(removed)[:5]) + (", ..." if len(removed) > 5 else ""))


def _alive(pid: int) -> bool:
    """Whether ``pid`` of this pid namespace may still write; this process's own writes are done."""
    if pid == os.getpid():
        return False
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _read_entries(file: Path) -> dict[str, dict]:
    """The record's entries, checked ({} where FILE is absent); one that cannot be read or parsed
    refuses the start, and a write."""
    def refuse(reason: str) -> RecordError:
        return RecordError(f"--weights-record {file}: {reason}; it names the weights each model served last, so "
                           f"the start is refused rather than serve --model silently: repair it, or delete {file} to "
                           "serve --model")

    for attempt in range(3):
        try:
            data = file.read_bytes()
            break
        except FileNotFoundError:
            return {}
        except OSError as exc:  # ESTALE: on NFS another host renamed a new record over the one opened
            if exc.errno != errno.ESTALE or attempt == 2:
                raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    try:
        record = json.loads(data)
    except ValueError as exc:  # no JSON, or no UTF-8
        raise refuse(f"is no JSON record ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("models"), dict):
        shown = record.get("format") if isinstance(record, dict) else None
        raise refuse(f'is no record of format {FORMAT} ({{"format": {FORMAT}, "models": {{...}}}}; format {shown!r})')
    for name, entry in record["models"].items():
        fields = ("model", "path", "version")
        if not isinstance(entry, dict) or not all(isinstance(entry.get(f), str) and entry[f] for f in fields):
            raise refuse(f"the entry of {name!r} needs the strings {', '.join(fields)}")
        files = entry.get("files")
        if files is not None and not (isinstance(files, list) and all(
                isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and all(isinstance(v, int) for v in f[1:])
                for f in files)):
            raise refuse(f"the entry of {name!r} has files that are not [name, size, mtime_ns] lists")
        at = entry.get("requested_at", 0.0)
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
            raise refuse(f"the entry of {name!r} has a requested_at that is no time in seconds ({at!r})")
    return record["models"]
