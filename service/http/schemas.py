"""Pydantic models of the HTTP contract (docs/api.md): requests, responses, errors.

Requests are validated with these models. Responses are built as plain dicts of numpy arrays
(encoding 100k floats through pydantic would cost more than the forward on a small model); the
response models document their shape in the OpenAPI page and tests check answers against them.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from model_runtime.types import MAX_TOP_K


def _token_ids(value: Any, handler) -> np.ndarray:
    """A list of ints (JSON or msgpack) or a msgpack bin of little-endian int32, as a numpy array.

    Pydantic checks list items strictly (no booleans, floats or strings), so an error names the
    offending index. Ids beyond int64 stay Python ints in an object array so that the range check
    can name them too instead of overflowing here.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) % 4:
            # errors.py appends ", got <the input>" (here the byte count) to the message.
            raise ValueError("a bin of input_ids must hold whole little-endian int32 values")
        return np.frombuffer(raw, dtype="<i4")
    ids = handler(value)
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:
        return np.asarray(ids, dtype=object)


# A string holding a lone surrogate: what a JSON \ud800 escape gives, and a msgpack str's bytes that are not
# UTF-8 (decoded with surrogateescape, so that validation names its field). errors.py says it for keys too.
NOT_UNICODE = ("must be valid Unicode text, without unpaired surrogates (a lone \\ud800-\\udfff escape in JSON, "
               "bytes that are not UTF-8 in a msgpack str)")


def _encodable(text: str) -> str:
    # Python's JSON parser (the fallback for NaN and huge integers) lets lone surrogates through;
    # such a string could never be echoed back in UTF-8.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(NOT_UNICODE) from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]


def _version_rule(value: Any, handler) -> str:
    # pydantic's own words for these constraints print the regex and call a string's characters "items"
    try:
        return handler(value)
    except ValidationError as exc:
        if exc.errors()[0]["type"] in ("too_short", "too_long", "string_too_short", "string_too_long",
                                       "string_pattern_mismatch"):
            raise PydanticCustomError("version_rule", "a version is 1 to 256 characters, holds no control character "
                                      "and neither begins nor ends with a space") from None
        raise


VersionName = Annotated[
    Text,
    Field(min_length=1, max_length=256, pattern=r"^[^\s\x00-\x1f\x7f](?:[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f])?$"),
    WrapValidator(_version_rule),
]

TokenIds = Annotated[
    list[StrictInt],
    WrapValidator(_token_ids),
    Field(
        description="token ids of the whole sequence (prompt and response), each in [0, vocab_size); "
        "in msgpack also a bin of little-endian int32",
        json_schema_extra={"minItems": 1, "items": {"type": "integer", "minimum": 0}},
    ),
]


def _float32s(value: Any, handler) -> np.ndarray:
    """A list of numbers (JSON or msgpack) or a msgpack bin of little-endian float32, as float32.

    Non-finite values pass here; validation names the first one with its index.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) % 4:
            raise ValueError("a bin of rollout_logprobs must hold whole little-endian float32 values")
        return np.frombuffer(raw, dtype="<f4")
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf, which validation names
        return np.asarray(handler(value), dtype=np.float32)


Float32s = Annotated[
    list[StrictFloat],
    WrapValidator(_float32s),
    Field(
        description="the rollout engine's log-prob of each scored token (positions score_from .. L-1, so "
        "len(input_ids) - score_from values, finite); in msgpack also a bin of little-endian float32",
        json_schema_extra={"items": {"type": "number"}},
    ),
]


class SequenceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Text | None = Field(None, description="echoed back unchanged")
    input_ids: TokenIds
    score_from: StrictInt = Field(1, ge=1, description="first position scored; 1 <= score_from <= len(input_ids)")
    rollout_logprobs: Float32s | None = Field(None, description="turns on `mismatch` in this sequence's result")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": None,
                    "sequences": [{"id": "traj-17", "input_ids": [101, 872, 198, 979], "score_from": 2}],
                    "temperature": 1.0,
                    "return_entropy": True,
                    "top_k": 0,
                    "deadline_ms": None,
                }
            ]
        },
    )

    model: Text | None = Field(None, description="served model name (or the exact --model directory it is served from, "
                               "docs/cli.md); null means the only served model")
    sequences: list[SequenceIn] = Field(min_length=1, description="sequences to score, each independent of the others")
    temperature: float = Field(1.0, strict=True, gt=0, allow_inf_nan=False, description="logits are divided by it")
    return_entropy: StrictBool = Field(True, description="whether entropy is returned")
    top_k: StrictInt = Field(0, ge=0, le=MAX_TOP_K, description="when > 0 also return the k most likely tokens")
    deadline_ms: StrictInt | None = Field(None, ge=0, description="give up (504) when not done after this many ms "
                                          "(0: at once, as a deadline already passed)")
    weights_version: Text | None = Field(
        None, description="score only with exactly this version of the model's weights, else 409 weights_version_mismatch"
    )


class Mismatch(BaseModel):
    """Packscore's log-probs ``p`` against the rollout's ``r``, ``d = p - r`` over the scored tokens."""

    mean_abs_diff: float = Field(description="mean |d|")
    max_abs_diff: float = Field(description="max |d|")
    k3_kl: float = Field(description="mean(exp(d) - 1 - d): the k3 estimate of KL(rollout || served model)")


class SequenceResult(BaseModel):
    id: str | None = Field(description="the request's id for this sequence")
    logprobs: list[float] = Field(description="log p(x_t | x_<t) for t in score_from .. L-1")
    entropy: list[float] | None = Field(None, description="entropy of each scored position (when return_entropy)")
    top_k_ids: list[list[int]] | None = Field(None, description="[n_scored][k] most likely ids (when top_k > 0)")
    top_k_logprobs: list[list[float]] | None = Field(None, description="[n_scored][k] their log-probabilities")
    mismatch: Mismatch | None = Field(None, description="against rollout_logprobs (when the sequence sent them)")


class Usage(BaseModel):
    input_tokens: int
    scored_tokens: int


class ScoreResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "qwen3.5-9b",
                    "weights_version": "2026-11-29T10:00:00Z#a1b2c3",
                    "results": [{"id": "traj-17", "logprobs": [-3.1, -0.2], "entropy": [4.0, 1.3]}],
                    "usage": {"input_tokens": 4, "scored_tokens": 2},
                }
            ]
        }
    )

    model: str
    weights_version: str
    results: list[SequenceResult]
    usage: Usage


class WeightsRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"model": "policy", "path": "step-000120", "version": "step-120"}]},
    )

    model: Text | None = Field(None, description="served model name (or the exact --model directory it is served from, "
                               "docs/cli.md); null means the only served model")
    path: Text = Field(description="checkpoint directory (config.json + *.safetensors) relative to --weights-root")
    version: VersionName | None = Field(
        None,
        description="the new weights_version: no control characters, no space at either end, not starting with "
        "'xxh3-', 'sha256-', 'preset:' or 'mixed:' (the names packscore gives); default: a hash of the checkpoint's content",
    )


class WeightsResponse(BaseModel):
    model: str
    weights_version: str = Field(description="the version now serving")
    previous_version: str = Field(description="the version it replaced")
    load_s: float = Field(description="seconds from the request to the new weights ready beside the old")
    swap_ms: float = Field(description="the pause between two forwards while the weights were swapped")


class ErrorDetail(BaseModel):
    type: str = Field(description="snake_case error kind, e.g. invalid_value")
    message: str = Field(description="one human sentence")
    param: str | None = Field(description="the offending field, e.g. sequences[3].input_ids[17]")


class ErrorResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "type": "invalid_value",
                        "message": "token id 300000 is outside the vocabulary [0, 248320).",
                        "param": "sequences[3].input_ids[17]",
                    }
                }
            ]
        }
    )

    error: ErrorDetail


class ParallelInfo(BaseModel):
    world_size: int
    dp: int
    sp: int
    fsdp: bool


class AwaitedWeights(BaseModel):
    path: str = Field(description="the checkpoint --weights-record names, relative to --weights-root")
    version: str = Field(description="the version it served under")
    reason: str = Field(description="why it cannot be served")


class ModelCard(BaseModel):
    id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    parallel: ParallelInfo
    kernels: dict[str, str]
    weights_version: str
    awaiting_weights: AwaitedWeights | None = Field(
        None, description="only while the model waits for a weight update (its --weights-record checkpoint could "
        "not be served at start): it scores nothing, and weights_version names weights loaded but not served")


class ModelList(BaseModel):
    data: list[ModelCard]


class Health(BaseModel):
    status: str = Field(examples=["ok"])


class Readiness(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str = Field(description="ready, or why not: loading, awaiting_weights, warming_up, worker_down, restart_failed, stalled, draining, probe_failed, ...")
