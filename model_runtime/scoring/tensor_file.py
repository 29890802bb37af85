"""Tensors of one safetensors file, read with positioned reads into fresh buffers, never mapped.

``safetensors.safe_open`` maps the file: a file cut short while its tensors are read (a trainer
re-saving a checkpoint into the directory being loaded, a copy still under way) faults on the
missing pages, and SIGBUS kills the whole server, every served model with it. A positioned
read of a missing range returns short instead, which refuses the checkpoint and keeps serving
the weights already loaded.

The format: a little-endian u64 ``N``, ``N`` bytes of JSON mapping each tensor's name to its
``dtype``, ``shape`` and ``data_offsets`` (begin, end) from the end of the header, then the
data. Only these bytes are interpreted; nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import xxhash

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20


class TensorFileError(OSError):
    """The file is not the safetensors file its header describes (cut short, damaged)."""


def read_header(fd: int, size: int, path: Path) -> tuple[dict, int]:
    """The JSON header of the safetensors file open as ``fd`` (``size`` bytes) and where its data
    starts; TensorFileError when the file does not start as safetensors does."""
    length = int.from_bytes(_pread(fd, 8, 0, path), "little")
    if not 2 <= length <= min(_MAX_HEADER, size - 8):
        raise TensorFileError(f"{path}: a header of {length} bytes in a file of {size}")
    try:
        header = json.loads(_pread(fd, length, 8, path))
    except ValueError as err:
        raise TensorFileError(f"{path}: the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: the header is not a JSON object")
    return header, 8 + length


def has_header(path: Path) -> bool:
    """Whether ``path`` starts as a safetensors file does (its tensors are not checked)."""
    try:
        with open(path, "rb", buffering=0) as f:
            read_header(f.fileno(), os.fstat(f.fileno()).st_size, Path(path))
        return True
    except OSError:  # TensorFileError included
        return False


def cut_in_header(path: Path) -> bool:
    """Whether ``path`` is a safetensors file cut before its header ends, as one still being
    written is: empty, shorter than the length word, or shorter than the JSON header it announces."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            start = os.pread(f.fileno(), 9, 0)
    except OSError:
        return False
    if size < 8:
        return True
    length = int.from_bytes(start[:8], "little")
    # a pickle or other file renamed *.safetensors announces no such header
    return 2 <= length <= _MAX_HEADER and length > size - 8 and start[8:9] in (b"", b"{")


def _pread(fd: int, count: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, count, offset)
    if len(data) != count:
        raise TensorFileError(f"{path}: {count} bytes at {offset} asked, {len(data)} read (the file is shorter)")
    return data


class TensorFile:
    """One open safetensors file: ``keys()``, ``shape(name)`` and ``read(name, rows)``; a context
    manager that closes it.

    Example: ``with TensorFile(path) as f: w = f.read("lm_head.weight", slice(0, 1024))``
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._file = open(self.path, "rb", buffering=0)
        try:
            self._entries, self._data_start = self._parse_header()
        except BaseException:
            self._file.close()
            raise

    def _parse_header(self) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
        size = os.fstat(self._file.fileno()).st_size
        header, data_start = read_header(self._file.fileno(), size, self.path)
        data_size = size - data_start
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise TensorFileError(f"{self.path}: tensor {name!r} has no valid dtype, shape and offsets: {info!r}") from None
            if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
                raise TensorFileError(f"{self.path}: tensor {name!r} {list(shape)} {info['dtype']} claims bytes "
                                      f"[{begin}, {end}) of {data_size}")
            entries[name] = (dtype, shape, begin, end)
        return entries, data_start

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def locate(self, name: str, rows: slice | None = None) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        """Tensor ``name``'s dtype and shape (its rows ``rows`` of dim 0 when given, a step of 1), and
        where those bytes lie in the file: their offset and their length."""
        dtype, shape, begin, end = self._entries[name]
        if rows is not None and shape:
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"rows must be contiguous, got a step of {step}")
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            stop = max(start, stop)
            begin, end, shape = begin + start * row_bytes, begin + stop * row_bytes, (stop - start, *shape[1:])
        return dtype, shape, self._data_start + begin, end - begin

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name`` (its rows ``rows`` of dim 0 when given, a step of 1) as a new CPU tensor."""
        dtype, shape, offset, length = self.locate(name, rows)
        buffer = torch.empty(length, dtype=torch.uint8)
        self._pread_into(buffer, offset)
        return buffer.view(dtype).reshape(shape)

    def read_into(self, dest: torch.Tensor, name: str, rows: slice | None = None, staging: "Staging | None" = None,
                  digest: "PieceDigest | None" = None) -> None:
        """Copies the bytes of tensor ``name`` (its rows ``rows``) into ``dest``, a uint8 tensor of
        their length: without ``staging`` read straight into it (host memory); with it, through its
        buffers, the copies queued on the current stream (synchronise it before reading ``dest``).
        ``digest`` is fed the bytes as they are read."""
        _, _, offset, length = self.locate(name, rows)
        if dest.numel() != length:
            raise ValueError(f"{name}: {length} bytes to read into a buffer of {dest.numel()}")
        if staging is None:
            self._pread_into(dest, offset)
            if digest is not None:
                digest.update(memoryview(dest.numpy()))
            return
        done = 0
        while done < length:
            with staging.slot() as (buffer, copied):
                n = min(buffer.numel(), length - done)
                self._pread_into(buffer[:n], offset + done)
                dest[done:done + n].copy_(buffer[:n], non_blocking=True)
                copied.record()
                if digest is not None:  # beside the copy, which only reads the buffer too
                    digest.update(memoryview(buffer[:n].numpy()))
            done += n

    def _pread_into(self, buffer: torch.Tensor, offset: int) -> None:
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            n = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if n == 0:
                raise TensorFileError(f"{self.path}: the file ends {len(view) - done} bytes short of a tensor at "
                                      f"{offset} (cut short while it was read?)")
            done += n

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PieceDigest:
    """XXH3-128 of a stream of bytes in pieces of ``piece`` bytes from its start, fed in any cuts:
    a tensor's part of a content version (``content_hash.content_version``)."""

    def __init__(self, piece: int):
        self.piece = piece
        self._done: list[str] = []
        self._hash, self._fed = xxhash.xxh3_128(), 0

    def update(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            take = min(len(data), self.piece - self._fed)
            self._hash.update(data[:take])
            self._fed += take
            data = data[take:]
            if self._fed == self.piece:
                self._done.append(self._hash.hexdigest())
                self._hash, self._fed = xxhash.xxh3_128(), 0

    def hexdigests(self) -> list[str]:
        """One per piece; an empty stream is one piece of no bytes."""
        return self._done + ([self._hash.hexdigest()] if self._fed or not self._done else [])


class Staging:
    """Page-locked host buffers through which tensors travel to a GPU, ``count`` slots of ``size``
    bytes, and the side stream that copies them; made once per device (``staging_for``) and
    reused by every read, since allocating or freeing page-locked memory stops every CUDA call of
    the process while it runs (docs/weights-loading.md). Each slot carries the event of its last
    copy, waited for before the slot is filled again; one stream lets the caching allocator reuse
    an update's blocks in the next.
    """

    def __init__(self, device: torch.device, count: int = 16, size: int = 16 << 20):
        self.stream = torch.cuda.Stream(device)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):  # blocking events: a thread waiting for a slot sleeps instead of spinning
            self._free.put((torch.empty(size, dtype=torch.uint8, pin_memory=True), torch.cuda.Event(blocking=True)))

    @contextmanager
    def slot(self):
        """A free slot, ``(buffer, event)``, once its last copy is done; the caller records ``event``
        after queueing the copy out of ``buffer``."""
        buffer, copied = self._free.get()
        try:
            copied.synchronize()
            yield buffer, copied
        finally:
            self._free.put((buffer, copied))


_staging: dict[torch.device, Staging] = {}
_staging_lock = threading.Lock()


def staging_for(device: torch.device) -> Staging:
    """The process's staging buffers and side stream for ``device`` (a CUDA device), made at the
    first call."""
    if device.index is None:  # "cuda" and "cuda:0" are one device, and must share one Staging
        device = torch.device(device.type, torch.cuda.current_device())
    with _staging_lock:
        if device not in _staging:
            _staging[device] = Staging(device)
        return _staging[device]
