"""From a decoded body to validated sequences: every check runs here, before admission.

Nothing that fails a check ever reaches the model. Errors name the offending field in the
contract's notation (``sequences[3].input_ids[17]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from model_runtime.types import SequenceInput
from service.http.errors import ApiError, from_validation_errors, short_repr
from service.http.schemas import ScoreRequest

log = logging.getLogger(__name__)
Schema = TypeVar("Schema", bound=BaseModel)


@dataclass(frozen=True)
class Limits:
    """What one request may hold; the service reports these in /readyz and response headers."""

    vocab_size: int | None  # None: not known yet (offline, before the model loads)
    max_model_len: int
    max_sequences_per_request: int
    max_request_tokens: int  # a request larger than the admission bound could never be admitted
    max_request_bytes: int

    def headers(self) -> dict[str, str]:
        return {
            "X-Packscore-Max-Sequences-Per-Request": str(self.max_sequences_per_request),
            "X-Packscore-Max-Request-Tokens": str(self.max_request_tokens),
            "X-Packscore-Max-Request-Bytes": str(self.max_request_bytes),
            "X-Packscore-Max-Model-Len": str(self.max_model_len),
        }

    def as_dict(self) -> dict[str, int]:
        return {
            "max_sequences_per_request": self.max_sequences_per_request,
            "max_request_tokens": self.max_request_tokens,
            "max_request_bytes": self.max_request_bytes,
            "max_model_len": self.max_model_len,
        }


def resolve_model_len(requested: int | None, model_limit: int | None, queued_tokens: int) -> int:
    """The longest sequence accepted: ``--max-model-len`` when given (never past the model's
    ``max_position_embeddings``), else the model's, and never more than the admission bound
    (``--max-queued-tokens``), since a longer sequence could never be admitted."""
    if requested is not None and model_limit and requested > model_limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's {model_limit} positions (config.json's "
                         "max_position_embeddings, or a yarn rope scaling's factor times its original)")
    wanted = requested or model_limit or queued_tokens
    if wanted > queued_tokens:
        log.info("max_model_len %d capped to --max-queued-tokens %d", wanted, queued_tokens)
    return min(wanted, queued_tokens)


@dataclass(frozen=True)
class ScoreJob:
    """A validated /score request."""

    ids: list[str | None]
    sequences: list[SequenceInput]
    return_entropy: bool
    top_k: int
    deadline_ms: int | None
    input_tokens: int
    scored_tokens: int
    model: str = ""  # the served model that scores it
    weights_version: str | None = None  # the pinned version, if any
    rollout: tuple[np.ndarray | None, ...] = ()  # float32 rollout log-probs per sequence, where sent


def body_object(body: Any) -> dict:
    """A decoded body, which must be an object (a JSON object or msgpack map): 422 otherwise."""
    if not isinstance(body, dict):
        raise ApiError(422, "invalid_value", f"The body must be an object, got {type(body).__name__}.")
    return body


def validated(schema: type[Schema], body: dict) -> Schema:
    """``body`` as ``schema``; its first error a 422 naming the field (``from_validation_errors``)."""
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False), sourced=False) from None


def pick_model(requested: Any, served: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> str:
    """The served model a request's ``model`` names (its served name, or an alias of it: the exact
    ``--model`` directory, ``Service.aliases``): 404 for an unknown name, 422 when omitted while
    several are served."""
    if requested is None:
        if len(served) > 1:
            raise ApiError(422, "model_required", f"Several models are served ({', '.join(served)}); name one in 'model'.", "model")
        return next(iter(served))
    if requested in served:
        return requested
    if aliases and requested in aliases:
        return aliases[requested]
    raise ApiError(404, "model_not_found", f"Model {short_repr(requested)} is not served here; this server serves "
                   f"{', '.join(repr(n) for n in served)}.", "model")


def parse_score_request(body: Any, limits: Limits | Mapping[str, Limits], served_name: str = "",
                        aliases: Mapping[str, str] | None = None) -> ScoreJob:
    """Validates a decoded /score body; raises ApiError 404 / 413 / 422.

    ``limits`` is the served model's, or served name -> limits when several are served; ``aliases``,
    other names of served models (``pick_model``).
    """
    served = {served_name: limits} if isinstance(limits, Limits) else limits
    sequences = body_object(body).get("sequences")
    # Counted before the per-item validation, which would otherwise walk an unbounded list.
    any_limits = next(iter(served.values()))  # every model shares the request bounds
    if isinstance(sequences, list) and len(sequences) > any_limits.max_sequences_per_request:
        raise ApiError(
            413,
            "too_many_sequences",
            f"The request has {len(sequences)} sequences; at most {any_limits.max_sequences_per_request} are accepted "
            "per request; split it.",
            "sequences",
        )
    request = validated(ScoreRequest, body)
    model = pick_model(request.model, served, aliases)
    limits = served[model]
    if limits.vocab_size is not None and request.top_k > limits.vocab_size:
        raise ApiError(422, "invalid_value", f"top_k must be at most the vocabulary's {limits.vocab_size} tokens, "
                       f"got {request.top_k}.", "top_k")

    out: list[SequenceInput] = []
    rollout: list[np.ndarray | None] = []
    input_tokens = scored_tokens = 0
    for i, seq in enumerate(request.sequences):
        ids = _checked_ids(seq.input_ids, i, limits)
        if not seq.score_from <= ids.size:
            raise ApiError(
                422,
                "invalid_value",
                f"sequences[{i}].score_from must be in [1, {ids.size}] (the sequence's length), got {seq.score_from}.",
                f"sequences[{i}].score_from",
            )
        out.append(
            SequenceInput(
                input_ids=ids,
                score_from=seq.score_from,
                temperature=request.temperature,
                top_k=request.top_k,
                return_entropy=request.return_entropy,
            )
        )
        rollout.append(None if seq.rollout_logprobs is None else _checked_rollout(seq.rollout_logprobs, i, ids.size - seq.score_from))
        input_tokens += ids.size
        scored_tokens += ids.size - seq.score_from
    if input_tokens > limits.max_request_tokens:
        raise ApiError(
            413,
            "request_too_large",
            f"The request holds {input_tokens} tokens; at most {limits.max_request_tokens} are accepted per request; "
            "split it.",
            "sequences",
            headers=limits.headers(),
        )
    return ScoreJob(
        ids=[s.id for s in request.sequences],
        sequences=out,
        return_entropy=request.return_entropy,
        top_k=request.top_k,
        deadline_ms=request.deadline_ms,
        input_tokens=input_tokens,
        scored_tokens=scored_tokens,
        model=model,
        weights_version=request.weights_version,
        rollout=tuple(rollout),
    )


def _checked_rollout(values: np.ndarray, i: int, n_scored: int) -> np.ndarray:
    param = f"sequences[{i}].rollout_logprobs"
    if values.size != n_scored:
        raise ApiError(422, "invalid_value", f"rollout_logprobs must hold one value per scored position, "
                       f"len(input_ids) - score_from = {n_scored}, got {values.size}.", param)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        j = int(bad[0])
        raise ApiError(422, "invalid_value", "rollout_logprobs must be finite float32 numbers (magnitude below "
                       f"3.4e38), got {values[j]} as float32.", f"{param}[{j}]")
    return values


def _checked_ids(ids: np.ndarray, i: int, limits: Limits) -> np.ndarray:
    param = f"sequences[{i}].input_ids"
    if ids.size == 0:
        raise ApiError(422, "invalid_value", "input_ids must hold at least one token id.", param)
    if ids.size > limits.max_model_len:
        raise ApiError(
            413,
            "sequence_too_long",
            f"Sequence {i} has {ids.size} tokens; the longest accepted is {limits.max_model_len} (max_model_len).",
            param,
            headers=limits.headers(),  # the limits of the model named, which the service's default may not be
        )
    vocab = limits.vocab_size
    top = 1 << 31 if vocab is None else vocab  # no vocabulary reaches 2**31 (the backends hold ids as int32)
    if ids.dtype == object or ids.min() < 0 or ids.max() >= top:
        j = int(np.flatnonzero((ids < 0) | (ids >= top))[0])
        if vocab is not None:
            message = f"Token id {ids[j]} is outside the vocabulary [0, {vocab})."
        elif ids[j] < 0:
            message = f"Token id {ids[j]} is negative; token ids are >= 0."
        else:
            message = f"Token id {ids[j]} is outside any vocabulary; token ids are below 2**31."
        raise ApiError(422, "invalid_value", message, f"{param}[{j}]")
    return ids.astype(np.int64, copy=False)
