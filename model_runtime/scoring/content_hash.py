"""A checkpoint's content version, and the one read of its tensors that takes it and checks their values.

``content_version`` is ``xxh3-<12 hex>`` over the config and every tensor. ``scan_tensors`` reads
each tensor's bytes once, with positioned reads into a buffer each thread reuses, and from those
bytes takes the hash, checks the values for NaN and infinity by their bits, or both: an update in
place checks the checkpoint and names it in one pass before copying it (docs/weights-loading.md).

Example:
    >>> version, bad = scan_tensors(Path("step-120"), finite={"lm_head.weight"})
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from model_runtime.scoring.checkpoint import safetensors_files
from model_runtime.scoring.checkpoint_error import CheckpointError
from model_runtime.scoring.tensor_file import _DTYPES, PieceDigest, TensorFileError, read_header

# The nice value of the threads that hash a checkpoint (Linux: each thread has its own): where the
# host's cores are busy, the threads of the forwards serving beside them go first. Only threads
# that run no torch op: a thread pool torch creates from one would inherit its priority.
BACKGROUND_NICE = 10
HASH_THREADS = 8  # beside serving forwards
START_HASH_THREADS = 16  # at start, where nothing serves yet


def background_thread() -> None:
    """Lowers the calling thread's CPU priority to ``BACKGROUND_NICE`` (never raises it): an
    executor's ``initializer`` for work that runs beside serving forwards."""
    if not BACKGROUND_NICE or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))
    except OSError:
        pass


CONTENT_VERSION_PREFIX = "xxh3-"  # a content hash's version; service/http/weights.py reserves it
CONTENT_PIECE = 1 << 30  # a content version hashes each tensor in pieces of this many bytes


class HashStopped(Exception):
    """The ``halt`` event was set while the checkpoint was read: no version (its owner closed)."""


class ReadDigests:
    """The pieces of ``content_version`` of the tensors a read goes through, by checkpoint name,
    taken from the bytes as they are read: a second read of the checkpoint is not needed."""

    def __init__(self, piece: int = CONTENT_PIECE):
        self.piece = piece
        self.tensors: dict[str, PieceDigest] = {}

    def of(self, name: str) -> PieceDigest:
        if name in self.tensors:  # fed twice, its pieces would hash other bytes
            raise ValueError(f"{name} is read twice")
        self.tensors[name] = PieceDigest(self.piece)
        return self.tensors[name]


# dtype -> (integer view, mask of the magnitude bits, the magnitude of infinity): in these IEEE
# formats a value is NaN or infinite exactly when its magnitude bits reach infinity's (float8
# e4m3fn has no infinity: its NaN's magnitude is the largest).
FLOAT_BITS = {
    torch.bfloat16: (np.int16, 0x7FFF, 0x7F80),
    torch.float16: (np.int16, 0x7FFF, 0x7C00),
    torch.float32: (np.int32, 0x7FFF_FFFF, 0x7F80_0000),
    torch.float64: (np.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    torch.float8_e4m3fn: (np.int8, 0x7F, 0x7F),
    torch.float8_e5m2: (np.int8, 0x7F, 0x7C),
}
# Bytes a thread reads at a time, into one buffer it reuses: hashed and checked while still in the
# core's cache (sizes timed in docs/weights-loading.md).
READ_BUFFER = 4 << 20
BITS_CHUNK = 1 << 20  # bytes masked at a time: the temporary stays in the core's cache


def finite_bits(data: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether the values of ``dtype`` (a key of ``FLOAT_BITS``) stored in ``data`` (bytes, a
    uint8 array of whole values) are all finite, by their bits; NumPy releases the GIL."""
    view, magnitude, infinity = FLOAT_BITS[dtype]
    if not data.size:
        return True
    scratch = np.empty(min(BITS_CHUNK, data.size), dtype=np.uint8).view(view)
    values = data.view(view)
    step = scratch.size
    for at in range(0, values.size, step):
        part = values[at:at + step]
        if int(np.bitwise_and(part, magnitude, out=scratch[:part.size]).max()) >= infinity:
            return False
    return True


def content_version(path: Path, *, threads: int | None = None, piece: int = CONTENT_PIECE,
                    read: ReadDigests | None = None, halt: threading.Event | None = None) -> str:
    """``xxh3-<12 hex>`` over the checkpoint's config and every tensor: name, dtype, shape and
    bytes, in name order, so the same tensors give the same version however they are split into
    files (one file, shards, another shard size).

    XXH3-128, not a cryptographic hash, so that hashing costs an update little beside reading
    (docs/weights-loading.md): a version needs no resistance to forgery (whoever writes the
    checkpoint chooses the weights anyway), and 12 hex digits would not give it. Tensors are
    hashed in pieces of at most ``piece`` bytes side by side (xxhash releases the GIL).
    ``read``: the digests of the tensors an update read (in pieces of ``piece``), so that only the
    others (a vision tower, ``mtp.*``) are read here. ``halt`` set meanwhile ends the read with
    ``HashStopped``.
    """
    version, _ = scan_tensors(path, threads=threads, piece=piece, read=read, halt=halt)
    return version


def scan_tensors(path: Path, *, content: bool = True, finite: Collection[str] = (), threads: int | None = None,
                 piece: int = CONTENT_PIECE, read: ReadDigests | None = None,
                 halt: threading.Event | None = None) -> tuple[str | None, list[str]]:
    """One read of the tensors of checkpoint ``path`` (``threads`` at a time, at nice
    ``BACKGROUND_NICE``): ``content_version``'s value when ``content`` (every tensor hashed, but
    those in ``read``), else None; and which of the tensors ``finite`` (checkpoint names) hold
    NaN or infinity, in name order (floating-point ones; checked by their bits, from the bytes
    hashed). A checked tensor whose file ends short of it raises ``TensorFileError``; one of a
    dtype this reader does not know too. ``halt`` set meanwhile ends the read with ``HashStopped``."""
    if read is not None and read.piece != piece:
        raise ValueError(f"digests in pieces of {read.piece} bytes for a version in pieces of {piece}")
    if finite and piece % 8:
        raise ValueError(f"pieces of {piece} bytes would cut values in two")
    known = {} if read is None else {name: d.hexdigests() for name, d in read.tensors.items()}
    entries: dict[str, tuple[str, list, Path, int, int]] = {}  # name -> dtype, shape, file, begin, end
    for file in safetensors_files(path):
        with open(file, "rb", buffering=0) as f:
            header, data_start = read_header(f.fileno(), os.fstat(f.fileno()).st_size, file)
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = (int(x) for x in info["data_offsets"])
                entries[name] = (str(info["dtype"]), list(info["shape"]), file, data_start + begin, data_start + end)
    checked: dict[str, torch.dtype] = {}  # name -> dtype, the tensors whose values are checked
    for name in finite:
        if name not in entries:
            raise ValueError(f"{path}: no tensor {name} to check")
        dtype = _DTYPES.get(entries[name][0])
        if dtype is None or (dtype.is_floating_point and dtype not in FLOAT_BITS):
            raise TensorFileError(f"{entries[name][2]}: tensor {name} has a dtype this reader does not know: {entries[name][0]}")
        if dtype.is_floating_point:
            checked[name] = dtype
    hashed = {name for name in entries if content and name not in known}
    pieces = [(name, start, min(end, start + piece)) for name, (_, _, _, begin, end) in sorted(entries.items())
              if name in hashed or name in checked for start in range(begin, max(begin + 1, end), piece)]

    buffers = threading.local()  # one reused buffer a thread: no mapping and unmapping per read

    def scan(item) -> tuple[str | None, bool]:
        name, start, stop = item
        h = xxhash.xxh3_128() if name in hashed else None
        dtype = checked.get(name)
        finite_so_far = True
        if not hasattr(buffers, "view"):
            buffers.array = np.empty(READ_BUFFER, dtype=np.uint8)
            buffers.view = memoryview(buffers.array)
        with open(entries[name][2], "rb", buffering=0) as f:
            at = start
            while at < stop:
                if halt is not None and halt.is_set():
                    raise HashStopped(f"{path}: hash stopped")
                want = min(stop - at, len(buffers.view))
                n = _read_at(f.fileno(), buffers.view[:want], at)
                if h is not None:
                    h.update(buffers.view[:n])
                if dtype is not None and finite_so_far and n:
                    finite_so_far = finite_bits(buffers.array[:n - n % dtype.itemsize], dtype)
                at += n
                if n < want:  # the file ends here
                    break
        if dtype is not None and at < stop:
            raise TensorFileError(f"{entries[name][2]}: the file ends {stop - at} bytes short of tensor {name} "
                                  "(cut short while it was read?)")
        return (None if h is None else h.hexdigest()), finite_so_far

    threads = HASH_THREADS if threads is None else threads
    with ThreadPoolExecutor(max(1, min(threads, len(pieces) or 1)), initializer=background_thread) as ex:
        parts = list(ex.map(scan, pieces))
    bad = sorted({name for (name, _, _), (_, ok) in zip(pieces, parts) if not ok})
    if not content:
        return None, bad
    per_tensor: dict[str, list[str]] = dict(known)
    for (name, _, _), (part, _) in zip(pieces, parts):
        if part is not None:
            per_tensor.setdefault(name, []).append(part)
    total = xxhash.xxh3_128()
    config = Path(path) / "config.json"
    if config.is_file():  # the settings as parsed: key order and layout of the file do not count
        try:
            settings = json.loads(config.read_text())
        except ValueError as exc:  # rewritten since it was checked (a trainer saving again): retryable
            raise CheckpointError("unreadable", f"{config} is not readable JSON: {exc}") from None
        total.update(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(entries):
        dtype, shape, *_ = entries[name]
        total.update(f"{name}|{dtype}|{shape}|{','.join(per_tensor.get(name, ()))}\n".encode())
    return f"{CONTENT_VERSION_PREFIX}{total.hexdigest()[:12]}", bad


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Fills ``view`` from ``offset`` of file ``fd`` (positioned reads release the GIL); fewer
    bytes only where the file ends."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done
