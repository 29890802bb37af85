"""``packscore score``'s IN: its lines read as JSON objects, each named by its line where it cannot be."""

from __future__ import annotations

import codecs
import shlex
from pathlib import Path
from typing import Iterator

import orjson

from service.http.encoding import not_utf8_at

# Bytes a line may take per token of the longest sequence the run allows: an id below 2**31 (10 digits)
# and a rollout log-prob (a float's shortest repr, up to 24 characters), each with ", ", and room to spare;
# plus room for the id and the other fields. A longer line is refused before it is read whole, and one
# with more commas than such a sequence has before it is parsed.
LINE_BYTES_PER_TOKEN = 64
LINE_BYTES_FIXED = 1 << 20


class InputError(ValueError):
    """A line of IN that cannot be scored; the message names the line."""


def line_bytes(max_tokens: int) -> int:
    """The longest line that can hold a sequence of at most ``max_tokens`` tokens, generously."""
    return LINE_BYTES_PER_TOKEN * max_tokens + LINE_BYTES_FIXED


def in_lines(path: Path, max_tokens: int) -> Iterator[tuple[int, dict]]:
    """Each line of ``path`` that is not blank, as its number and its object (``id`` set: ``line-<number>``
    where absent or null); a line that is no such object raises InputError naming it, as does one longer
    than a sequence of ``max_tokens`` tokens can take, before it is read whole."""
    try:
        yield from _read_lines(path, max_tokens)
    except OSError as exc:  # no permission, an I/O error: the user's to fix, so one line and exit 2
        raise InputError(f"{path}: cannot read it: {exc.strerror or exc}") from None


def _read_lines(path: Path, max_tokens: int) -> Iterator[tuple[int, dict]]:
    limit = line_bytes(max_tokens)
    with path.open("rb") as f:
        number = 0
        # read up to the limit: a line parsed whole holds a Python int per id, many times the line's bytes
        while raw := f.readline(limit + 1):
            number += 1
            if len(raw) > limit:
                raise InputError(f"{path}:{number}: the line is longer than {limit} bytes, more than any sequence of "
                                 f"at most {max_tokens} tokens (max_model_len) takes ({LINE_BYTES_PER_TOKEN} bytes a "
                                 f"token, for its id and rollout log-prob, and {LINE_BYTES_FIXED >> 20} MiB for its "
                                 "other fields); refused before it was read whole")
            # few bytes a value ("1,"): the values are bounded too, before orjson makes a Python int of each
            if (commas := raw.count(b",")) > 2 * max_tokens + LINE_BYTES_FIXED:
                raise InputError(f"{path}:{number}: the line holds {commas} commas, more than any sequence of at most "
                                 f"{max_tokens} tokens (max_model_len) needs (one after each id and rollout log-prob, "
                                 f"and {LINE_BYTES_FIXED} more for its other fields); refused before it was parsed")
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
    if (bad := not_utf8_at(raw)) is not None:  # orjson says "column 1: ... surrogates not allowed" for any
        return (f"{path}:{number}: not UTF-8 at byte {bad + 1} of the line: JSON lines are UTF-8 (a compressed or "
                "binary file, such as gzip or msgpack, must be turned into JSON lines first)")
    if b"\r" in raw[:exc.pos].replace(b"\r\n", b""):  # JSON takes \r as blank space: the next object follows
        fixed = path.with_name(f"{path.stem}.lf{path.suffix}")
        return (f"{path}:{number}: the line holds carriage returns (\\r) not followed by newlines: CR-only line "
                "endings (as classic Mac OS wrote them), so the lines they end read as one; JSON lines end in \\n "
                f"(\\r\\n is accepted too): convert them, as with tr '\\r' '\\n' < {shlex.quote(str(path))} > "
                f"{shlex.quote(str(fixed))}, and run again with that file")
    return f"{path}:{number}: not valid JSON at column {min(exc.pos, len(raw.rstrip())) + 1}: {exc.msg}"

