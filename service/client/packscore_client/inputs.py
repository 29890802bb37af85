"""A ``score`` call's input checked before anything is sent, as the server would check it: the
sequences (``Seq``), the call's options, and the client's time bounds and keys."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_DEADLINE_MS = 2**64 - 1  # the server's bound on deadline_ms (a uint64)

_INT32_MAX = 2**31 - 1


@dataclass
class Seq:
    """One sequence as sent: checked ids, where scoring starts, the caller's id."""

    ids: np.ndarray  # int64 [L]
    score_from: int
    id: str | None
    rollout: np.ndarray | None = None  # float32 [L - score_from], the rollout engine's log-probs


_SEQUENCE_KEYS = frozenset({"id", "input_ids", "score_from", "rollout_logprobs"})


def as_seq(item: Any) -> Seq:
    """A dict with input_ids / score_from / id (and optionally rollout_logprobs), or a plain 1-D
    sequence of ids, checked."""
    rollout = None
    if isinstance(item, dict):
        if "input_ids" not in item:
            raise ValueError(f"a sequence given as a dict needs input_ids; got the keys {sorted(item)}")
        # dropped, a misspelt score_from would score from 1 silently; the server refuses such fields too
        if unknown := sorted(map(str, item.keys() - _SEQUENCE_KEYS)):
            raise ValueError(f"{unknown[0]!r} is not a field of a sequence (it takes "
                             f"{', '.join(sorted(_SEQUENCE_KEYS))})")
        ids, score_from, seq_id = item["input_ids"], item.get("score_from", 1), item.get("id")
        # int() would pass 2.5 as 2 and True as 1, which the server refuses (422)
        if isinstance(score_from, (bool, np.bool_)) or not isinstance(score_from, (int, np.integer)):
            raise TypeError(f"score_from must be an int, got {score_from!r}")
        if item.get("rollout_logprobs") is not None:
            values = item["rollout_logprobs"]
            rollout = np.asarray(values)
            # a cast would pass "1" and True as 1.0, which the server refuses (422): numbers only
            if rollout.ndim == 1 and (isinstance(values, (list, tuple)) or rollout.dtype.kind not in "fiu"):
                listed = values if isinstance(values, (list, tuple)) else rollout.tolist()
                if bad := next(((j, v) for j, v in enumerate(listed) if isinstance(v, (bool, np.bool_))
                                or not isinstance(v, (int, float, np.number))), None):
                    raise TypeError(f"rollout_logprobs must be numbers, got {bad[1]!r} at rollout_logprobs[{bad[0]}]")
            rollout = rollout.astype(np.float32)
            if rollout.ndim != 1:
                raise TypeError(f"rollout_logprobs must be 1-D, got shape {rollout.shape}")
    else:
        ids, score_from, seq_id = item, 1, None
    if isinstance(ids, (bytes, bytearray)):
        raise TypeError("input_ids must be a sequence of ints or a numpy array, not bytes")
    arr = np.asarray(ids)
    if arr.ndim == 0 and np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"got the single token id {arr.item()}, not a sequence: score() takes a list of sequences "
                        "(to score one, pass [ids])")
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"input_ids must be a 1-D sequence of ints, got dtype {arr.dtype} and shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):  # before the cast: uint64 would wrap in it
        # msgpack sends int32; a silent wrap-around could turn a bad id into a valid one.
        j = int(np.flatnonzero((arr < 0) | (arr > _INT32_MAX))[0])
        raise ValueError(f"token ids must be in [0, 2**31), got {int(arr[j])} at input_ids[{j}]")
    arr = arr.astype(np.int64, copy=False)
    if rollout is not None and rollout.size != arr.size - int(score_from):
        raise ValueError(f"rollout_logprobs must hold len(input_ids) - score_from = {arr.size - int(score_from)} "
                         f"values, got {rollout.size}")
    return Seq(arr, int(score_from), seq_id, rollout)


def as_seqs(sequences: Any) -> list[Seq]:
    """``score``'s input; a padded 2-D array is refused: its rows would be scored pads and all."""
    if getattr(sequences, "ndim", 1) >= 2:
        raise TypeError(
            f"score() got a {sequences.ndim}-D array {tuple(sequences.shape)}: its rows would be scored with their "
            "pad tokens. Pass a padded batch to score_padded(input_ids, attention_mask, response_mask), or a "
            "list of unpadded 1-D sequences"
        )
    wanted = "sequences must be an iterable of sequences (dicts with input_ids, lists of ids or 1-D arrays)"
    if isinstance(sequences, Mapping):  # iterated, its keys would be taken for the sequences
        raise TypeError(f"{wanted}, got a dict with the keys {sorted(map(str, sequences))}: pass a list of sequences "
                        "([sequence] for one)")
    try:  # a generator or an iterator is taken as it is
        items = None if isinstance(sequences, (str, bytes, bytearray)) else iter(sequences)
    except TypeError:
        items = None
    if items is None:
        given = "None" if sequences is None else f"{type(sequences).__name__} {reprlib.repr(sequences)}"
        raise TypeError(f"{wanted}, got {given}")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(as_seq(item))
        except (TypeError, ValueError) as exc:  # named by its place in the caller's list, as the server's errors are
            raise type(exc)(f"sequences[{i}]: {exc}") from None
    return out


def seconds(value: Any, name: str, zero: bool = False) -> float:
    """``value`` checked as a bound in seconds: a finite number above 0 (or 0 itself, with ``zero``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy scalars are fine
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be finite and {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


def bearer_key(key: str | None, what: str) -> str | None:
    """``key`` as the server reads its own, surrounding whitespace stripped (a key read from a file
    keeps its newline, which no header may hold); a control character or one beyond ASCII inside is
    refused here, since the HTTP library's refusal comes at a call, obscure or quoting the key."""
    key = key.strip() if key is not None else ""
    if not key.isascii() or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"{what} holds a control character or one beyond ASCII, which no HTTP header can carry "
                         "(the key is not shown)")
    return key or None


def options(temperature, return_entropy, top_k, model, deadline_ms, weights_version=None) -> dict:
    """The request fields every part of one ``score`` call shares, checked: a cast would pass top_k=2.5
    as 2, True as 1 and return_entropy="no" as True, all of which the server refuses (422)."""
    def number(value) -> bool:
        return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))

    if not number(temperature):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if not isinstance(return_entropy, (bool, np.bool_)):
        raise TypeError(f"return_entropy must be True or False, got {return_entropy!r}")
    if deadline_ms is not None and not number(deadline_ms):
        raise TypeError(f"deadline_ms must be a number of milliseconds or None, got {deadline_ms!r}")
    for name, value in (("model", model), ("weights_version", weights_version)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {value!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if deadline_ms is not None and not (math.isfinite(deadline_ms) and deadline_ms <= MAX_DEADLINE_MS):  # the server's
        raise ValueError(f"deadline_ms must be finite and below 2**64 (None: no deadline), got {deadline_ms}")
    if isinstance(deadline_ms, np.generic):  # a numpy int is sent as is when <= 0: JSON and msgpack take no numpy
        deadline_ms = deadline_ms.item()
    opts = {"model": model, "temperature": float(temperature), "return_entropy": bool(return_entropy),
            "top_k": int(top_k), "deadline_ms": deadline_ms}
    if weights_version is not None:  # a server without version pins knows no such field
        opts["weights_version"] = weights_version
    return opts
