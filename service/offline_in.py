"""``packscore score``'s IN: its lines read as JSON objects, each named by its line where it cannot be."""

from __future__ import annotations

import codecs
import shlex
from pathlib import Path
from typing import Iterator

import orjson


class InputError(ValueError):
    """A line of IN that cannot be scored; the message names the line."""


def in_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """Each line of ``path`` that is not blank, as its number and its object (``id`` set: ``line-<number>``
    where absent or null); a line that is no such object raises InputError naming it."""
    try:
        yield from _read_lines(path)
    except OSError as exc:  # no permission, an I/O error: the user's to fix, so one line and exit 2
        raise InputError(f"{path}: cannot read it: {exc.strerror or exc}") from None


def _read_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):  # as Windows tools write UTF-8; orjson refuses it
                raw = raw[len(codecs.BOM_UTF8):]
            if number == 1 and raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # PowerShell 5's >
                raise InputError(f"{path}: the file is UTF-16, JSON lines are UTF-8: save it as UTF-8 (in PowerShell: "
                                 "Out-File -Encoding utf8) and run again")
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:  # orjson's "line 2 column 1" counts the newline: give the column
                raise InputError(_not_json(path, number, raw, exc)) from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{number}: expected a JSON object with input_ids, got {type(obj).__name__}")
            if obj.get("id") is None:  # absent or null, the API's default
                obj["id"] = f"line-{number}"
            if not isinstance(obj["id"], str):
                raise InputError(f"{path}:{number}: id must be a string, got {obj['id']!r}")
            yield number, obj


def _not_json(path: Path, number: int, raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why line ``number`` is not JSON, named as its cause where a common one shows."""
    if (bad := _not_utf8(raw)) is not None:  # orjson says "column 1: ... surrogates not allowed" for any
        return (f"{path}:{number}: not UTF-8 at byte {bad + 1} of the line: JSON lines are UTF-8 (a compressed or "
                "binary file, such as gzip or msgpack, must be turned into JSON lines first)")
    if b"\r" in raw[:exc.pos].replace(b"\r\n", b""):  # JSON takes \r as blank space: the next object follows
        fixed = path.with_name(f"{path.stem}.lf{path.suffix}")
        return (f"{path}:{number}: the line holds carriage returns (\\r) not followed by newlines: CR-only line "
                "endings (as classic Mac OS wrote them), so the lines they end read as one; JSON lines end in \\n "
                f"(\\r\\n is accepted too): convert them, as with tr '\\r' '\\n' < {shlex.quote(str(path))} > "
                f"{shlex.quote(str(fixed))}, and run again with that file")
    return f"{path}:{number}: not valid JSON at column {min(exc.pos, len(raw.rstrip())) + 1}: {exc.msg}"


def _not_utf8(raw: bytes) -> int | None:
    """Where ``raw`` stops being UTF-8, None where it is."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return None
