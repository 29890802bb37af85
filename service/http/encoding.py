"""Wire encodings: JSON through orjson, msgpack with raw little-endian arrays (docs/api.md).

Request bodies are decoded here (400 on anything malformed); responses are encoded from plain
dicts holding numpy arrays, never from pydantic objects, so that a 100k-token answer costs
milliseconds.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import msgpack
import numpy as np
import orjson

from model_runtime.wording import counted
from service.http.errors import ApiError, OversizedInt, short_repr

Encoding = Literal["json", "msgpack"]

JSON = "application/json"
MSGPACK = "application/msgpack"
_MEDIA_TYPES: dict[str, Encoding] = {
    "application/json": "json",
    "application/msgpack": "msgpack",
    "application/x-msgpack": "msgpack",
    "application/vnd.msgpack": "msgpack",
}
CONTENT_TYPE: dict[Encoding, str] = {"json": JSON, "msgpack": MSGPACK}


def _media_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


def request_encoding(content_type: str | None, content_encoding: str | None = None) -> Encoding:
    """The body's encoding from ``Content-Type``; 400 for anything but JSON or msgpack, and for a
    compressed body (``Content-Encoding``), which would otherwise fail to decode with a puzzling message."""
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise ApiError(400, "unsupported_content_encoding",
                       f"Content-Encoding {short_repr(content_encoding)} is not supported; send the body uncompressed.",
                       "Content-Encoding")
    media = _media_type(content_type or "")
    if media not in _MEDIA_TYPES:
        shown = short_repr(content_type) if content_type else "none"
        raise ApiError(
            400,
            "unsupported_content_type",
            f"Content-Type must be application/json or application/msgpack, got {shown}.",
            "Content-Type",
        )
    return _MEDIA_TYPES[media]


def response_encoding(accept: str | None, default: Encoding) -> Encoding:
    """The encoding ``Accept`` prefers, as RFC 9110 ranks it: each encoding takes the q of the most
    specific range that matches it (its own media type, then ``application/*``, then ``*/*``); the
    higher q wins, then the one named by its own type, then the first named, then ``default``. When
    neither is acceptable: ``default``, or the other one when ``default`` alone is refused (q=0)."""
    ranges = []  # (specificity, q, position, encoding or None for a wildcard)
    for position, part in enumerate((accept or "").split(",")):
        fields = part.split(";")
        media = fields[0].strip().lower()
        q = 1.0
        for param in fields[1:]:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if not math.isfinite(q):
            q = 0.0
        if media in _MEDIA_TYPES:
            ranges.append((2, q, position, _MEDIA_TYPES[media]))
        elif media in ("application/*", "*/*"):
            ranges.append((1 if media == "application/*" else 0, q, position, None))
    ranked: dict[Encoding, tuple[float, int, int]] = {}
    refused: set[Encoding] = set()
    for encoding in ("json", "msgpack"):
        matching = [r for r in ranges if r[3] in (encoding, None)]
        if not matching:
            continue
        specificity = max(r[0] for r in matching)
        most_specific = [r for r in matching if r[0] == specificity]  # aliases of one type: the best of them
        q = max(r[1] for r in most_specific)
        if q <= 0:
            refused.add(encoding)
            continue
        ranked[encoding] = (-q, -specificity, min(r[2] for r in most_specific if r[1] == q))
    if ranked:
        return min(ranked, key=lambda e: (*ranked[e], e != default))
    other: Encoding = "msgpack" if default == "json" else "json"
    return other if default in refused and other not in refused else default


class MsgpackExt:
    """A msgpack extension value (no field of the contract takes one): one opaque value, so that
    validation names the field that holds it, not an element of a ``(code, data)`` pair."""

    __slots__ = ("code", "size")

    def __init__(self, code: int, data: bytes):
        self.code, self.size = code, len(data)

    def __repr__(self) -> str:
        return f"a msgpack extension value (type {self.code}, {counted(self.size, 'byte')})"


def decode_body(raw: bytes, encoding: Encoding) -> Any:
    if encoding == "msgpack":
        try:
            # strict_map_key: maps keyed by strings, as every map of the contract is; other keys
            # (integers hash predictably) would let a body flood a dict with colliding keys.
            # A bin key (bytes) gets through; validation refuses it (errors.from_validation_errors).
            # surrogateescape: a str whose bytes are not UTF-8 is a value validation refuses naming its field (422),
            # as a JSON string's lone surrogate escape is; a body that is not msgpack at all stays a 400.
            return msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=MsgpackExt,
                                   unicode_errors="surrogateescape")
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            detail = str(exc).strip() or type(exc).__name__
            if "map key" in detail:  # valid msgpack, but no request of this API can have it
                raise ApiError(400, "malformed_body", f"Every map key of the body must be a string ({detail}).") from None
            raise ApiError(400, "malformed_body", f"The body is not valid msgpack ({detail}).") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        fast_error = exc
    # orjson reads an integer literal past 64 bits as a float (validation then names the field:
    # errors.past_64_bits), and refuses one past a double's range ("number is infinity") and the
    # NaN / Infinity literals that many JSON writers emit (Python's json among them). Such bodies
    # are well-formed and their values are what is wrong: parse them slowly so that validation
    # answers 422 naming the field.
    try:
        return json.loads(raw, parse_int=_parse_int)
    except (ValueError, RecursionError):
        raise ApiError(400, "malformed_body", _not_json(raw, fast_error)) from None


def _not_json(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """Why a body is not JSON: where it stops being UTF-8 (orjson says "surrogates not allowed" at char 0
    for any byte that is not), else orjson's own words."""
    if (bad := not_utf8_at(raw)) is not None:
        return (f"The body is not valid JSON: it is not UTF-8 at byte {bad + 1} (JSON is UTF-8; a msgpack "
                f"body is sent with Content-Type: {MSGPACK}).")
    return f"The body is not valid JSON: {exc}."


def not_utf8_at(raw: bytes) -> int | None:
    """Where ``raw`` stops being UTF-8 (a 0-based byte offset), None where it is."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return None


def _parse_int(literal: str) -> int | OversizedInt:
    # 20 digits hold every 64-bit integer; longer literals are refused by validation, by field.
    return int(literal) if len(literal.lstrip("-")) <= 20 else OversizedInt(literal)


def result_record(seq_id, scores, *, return_entropy: bool, top_k: int) -> dict:
    """One sequence's answer as docs/api.md lays it out (numpy arrays; the encoder formats them)."""
    record = {"id": seq_id, "logprobs": scores.logprobs}
    if return_entropy:
        record["entropy"] = scores.entropy
    if top_k:
        record["top_k_ids"] = scores.top_k_ids
        record["top_k_logprobs"] = scores.top_k_logprobs
    return record


def non_finite_score(scores) -> str | None:
    """Where a sequence's scores hold NaN or infinity (the model's logits overflowed float32 or
    were NaN), as ``logprobs[3]``; None where every number is finite. Log 0 is reported as
    float32's lowest value, so a finite model never lands here."""
    for name in ("logprobs", "entropy", "top_k_logprobs"):
        values = getattr(scores, name)
        if values is None or values.size == 0:
            continue
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            index = np.unravel_index(bad[0], values.shape)
            return name + "".join(f"[{int(i)}]" for i in index)
    return None


def encode_json(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def _bin(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def encode_score_response(body: dict, encoding: Encoding) -> bytes:
    """Encodes a /score answer whose results hold numpy arrays.

    JSON: plain (nested) lists, float32 numbers in float32's shortest form. msgpack: ``logprobs`` /
    ``entropy`` / ``top_k_logprobs`` as float32 bins, ``top_k_ids`` as an int32 bin, top-k flattened
    row-major ``[n_scored, k]``, the ``mismatch`` figures as doubles.
    """
    if encoding == "json":
        return encode_json(body)
    results = []
    for result in body["results"]:
        packed = {"id": result["id"], "logprobs": _bin(result["logprobs"], "<f4")}
        if "entropy" in result:
            packed["entropy"] = _bin(result["entropy"], "<f4")
        if "top_k_ids" in result:
            packed["top_k_ids"] = _bin(result["top_k_ids"], "<i4")
            packed["top_k_logprobs"] = _bin(result["top_k_logprobs"], "<f4")
        if "mismatch" in result:  # float32 figures as msgpack doubles (msgpack has no numpy scalars)
            packed["mismatch"] = {name: float(value) for name, value in result["mismatch"].items()}
        results.append(packed)
    return msgpack.packb({**body, "results": results}, use_bin_type=True)
