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
from pathlib import Path

import torch

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

    def read(self, name: str, rows: slice | None = None, *, pin: bool = False) -> torch.Tensor:
        """Tensor ``name`` (its rows ``rows`` of dim 0 when given, a step of 1) as a new CPU tensor;
        ``pin``: in page-locked memory, which a non-blocking copy sends to a GPU directly."""
        dtype, shape, begin, end = self._entries[name]
        if rows is not None and shape:
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"rows must be contiguous, got a step of {step}")
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            stop = max(start, stop)
            begin, end, shape = begin + start * row_bytes, begin + stop * row_bytes, (stop - start, *shape[1:])
        buffer = torch.empty(end - begin, dtype=torch.uint8, pin_memory=pin)
        self._pread_into(buffer, self._data_start + begin)
        return buffer.view(dtype).reshape(shape)

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
