"""Python client of the packscore HTTP API (API.md). Imports numpy, httpx and msgpack only, no torch.

    >>> client = ScoreClient("http://127.0.0.1:8000", api_key=None)
    >>> out = client.score([{"input_ids": [1, 2, 3, 4], "score_from": 2}], top_k=5)
    >>> out[0].logprobs.shape, out[0].top_k_ids.shape
    ((2,), (2, 5))

- msgpack by default (raw int32 ids out, raw float32 arrays back), JSON with ``encoding="json"``.
- 429 and 503 are retried after their ``Retry-After``, and connection errors after a short
  back-off, until ``retry_timeout_s`` has passed since the call started.
- A batch larger than the server accepts in one request is split under its limits (read from the
  ``X-Packscore-Max-*`` headers of every answer, from /readyz before the first call, or given as
  knobs); the parts are sent concurrently and the results come back in input order.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import httpx
import msgpack
import numpy as np

_INT32_MAX = 2**31 - 1
_RETRY_STATUSES = (429, 503)
_SPLITTABLE = ("too_many_sequences", "request_too_large", "body_too_large")  # 413 types that splitting fixes
_HEADER = "x-packscore-max-"


@dataclass
class ScoredSequence:
    """One sequence's scores; arrays cover positions score_from .. L-1."""

    id: str | None
    logprobs: np.ndarray  # float32 [n_scored]
    entropy: np.ndarray | None  # float32 [n_scored], when return_entropy
    top_k_ids: np.ndarray | None  # int32 [n_scored, k], when top_k > 0
    top_k_logprobs: np.ndarray | None  # float32 [n_scored, k]
    model: str
    weights_version: str


class ScoreError(Exception):
    """The server refused or failed a request; fields are the contract's error body."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None):
        super().__init__(f"{status} {type}: {message}" + (f" (param: {param})" if param else ""))
        self.status, self.type, self.message, self.param = status, type, message, param


@dataclass(frozen=True)
class Limits:
    """What one request may hold. The client's knobs cap what the server reports."""

    max_sequences_per_request: int = 256
    max_request_tokens: int = 65536
    max_request_bytes: int = 8 << 20


@dataclass
class _Seq:
    ids: np.ndarray  # int64 [L]
    score_from: int
    id: str | None


def _as_seq(item: Any) -> _Seq:
    if isinstance(item, dict):
        ids, score_from, seq_id = item["input_ids"], item.get("score_from", 1), item.get("id")
    else:
        ids, score_from, seq_id = item, 1, None
    if isinstance(ids, (bytes, bytearray)):
        raise TypeError("input_ids must be a sequence of ints or a numpy array, not bytes")
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"input_ids must be a 1-D sequence of ints, got dtype {arr.dtype} and shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):
        # msgpack sends int32; a silent wrap-around could turn a bad id into a valid one.
        raise ValueError(f"token ids must be in [0, 2**31), got {int(arr.min())} .. {int(arr.max())}")
    return _Seq(arr, int(score_from), seq_id)


class _Protocol:
    """What the sync and async clients share: bodies, splitting, answers, limits. No I/O here."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        encoding: str,
        retry_timeout_s: float,
        max_sequences_per_request: int | None,
        max_request_tokens: int | None,
        max_request_bytes: int | None,
    ):
        if encoding not in ("msgpack", "json"):
            raise ValueError(f"encoding must be 'msgpack' or 'json', got {encoding!r}")
        self.base_url = base_url.rstrip("/")
        self.encoding = encoding
        self.retry_timeout_s = retry_timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        media = "application/msgpack" if encoding == "msgpack" else "application/json"
        self.headers |= {"Content-Type": media, "Accept": media}
        self.knobs = {
            "max_sequences_per_request": max_sequences_per_request,
            "max_request_tokens": max_request_tokens,
            "max_request_bytes": max_request_bytes,
        }
        self.limits = self._capped(Limits())
        self.limits_known = False
        self._lock = threading.Lock()

    def _capped(self, limits: Limits) -> Limits:
        return replace(limits, **{k: min(v, getattr(limits, k)) for k, v in self.knobs.items() if v})

    def learn(self, source: dict[str, Any] | httpx.Headers) -> None:
        """Limits from /readyz's ``limits`` or from X-Packscore-Max-* response headers."""
        found = {}
        for field in ("max_sequences_per_request", "max_request_tokens", "max_request_bytes"):
            key = _HEADER + field.removeprefix("max_").replace("_", "-") if isinstance(source, httpx.Headers) else field
            value = source.get(key)
            if value is not None and str(value).isdigit():
                found[field] = int(value)
        if found:
            with self._lock:
                self.limits = self._capped(replace(Limits(), **found))
                self.limits_known = True

    def chunks(self, seqs: Sequence[_Seq], parallel: int) -> list[list[int]]:
        """Indices of ``seqs`` grouped into requests that fit the limits, in order.

        Parts sent at the same time share the server's admission queue, so each gets a
        ``1 / parallel`` share of the token bound (a longer single sequence still goes alone).
        """
        lim = self.limits
        token_budget = max(1, lim.max_request_tokens // parallel)
        per_token = 4 if self.encoding == "msgpack" else 12  # bytes on the wire, generously
        byte_budget = int(lim.max_request_bytes * 0.9) - 256
        out: list[list[int]] = []
        current: list[int] = []
        tokens = size = 0
        for i, s in enumerate(seqs):
            n, b = s.ids.size, s.ids.size * per_token + 96
            if current and (len(current) >= lim.max_sequences_per_request or tokens + n > token_budget
                            or size + b > byte_budget):
                out.append(current)
                current, tokens, size = [], 0, 0
            current.append(i)
            tokens += n
            size += b
        if current:
            out.append(current)
        return out

    def body(self, seqs: Sequence[_Seq], options: dict) -> bytes:
        if self.encoding == "msgpack":
            items = [{"id": s.id, "input_ids": s.ids.astype("<i4").tobytes(), "score_from": s.score_from} for s in seqs]
            return msgpack.packb({**options, "sequences": items}, use_bin_type=True)
        import json

        items = [{"id": s.id, "input_ids": s.ids.tolist(), "score_from": s.score_from} for s in seqs]
        return json.dumps({**options, "sequences": items}, separators=(",", ":")).encode()

    def after_failure(self, response: httpx.Response | None, exc: Exception | None, n_seqs: int, attempt: int,
                      give_up: float) -> float | None:
        """What to do after a failed attempt (no answer: ``response`` None, ``exc`` the transport
        error): None to split the request in halves, else the seconds to wait before trying
        again. Raises the error when retrying would outlast ``give_up`` or cannot help."""
        if response is None:
            wait = _retry_after(None, attempt)
            if time.monotonic() + wait > give_up:
                raise ScoreError(0, "connection_error", f"could not reach {self.base_url}: {exc}") from exc
            return wait
        error = _error(response)
        if response.status_code == 413 and error.type in _SPLITTABLE and n_seqs > 1:
            self.learn(response.headers)
            return None
        wait = _retry_after(response, attempt)
        if response.status_code not in _RETRY_STATUSES or time.monotonic() + wait > give_up:
            raise error
        return wait

    def parse(self, response: httpx.Response, top_k: int) -> list[ScoredSequence]:
        self.learn(response.headers)
        media = response.headers.get("content-type", "").split(";")[0].strip()
        body = msgpack.unpackb(response.content, raw=False) if "msgpack" in media else response.json()
        model, version = body["model"], body["weights_version"]
        return [_result(r, top_k, model, version) for r in body["results"]]


def _array(value: Any, dtype: str) -> np.ndarray:
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(value, dtype=dtype).astype(dtype[1:], copy=True)
    try:
        return np.asarray(value, dtype=dtype[1:])
    except TypeError:  # JSON has no -inf / NaN: a server may send null for them
        return np.asarray([np.nan if v is None else v for v in value], dtype=dtype[1:])


def _result(r: dict, top_k: int, model: str, version: str) -> ScoredSequence:
    logprobs = _array(r["logprobs"], "<f4")
    entropy = _array(r["entropy"], "<f4") if "entropy" in r else None
    ids = top = None
    if "top_k_ids" in r:
        ids = _array(r["top_k_ids"], "<i4").reshape(-1, top_k) if top_k else None
        top = _array(r["top_k_logprobs"], "<f4").reshape(-1, top_k) if top_k else None
    return ScoredSequence(r.get("id"), logprobs, entropy, ids, top, model, version)


def _error(response: httpx.Response) -> ScoreError:
    try:
        e = response.json()["error"]
        return ScoreError(response.status_code, e["type"], e["message"], e.get("param"))
    except Exception:
        return ScoreError(response.status_code, "http_error", response.text[:200] or response.reason_phrase)


def _retry_after(response: httpx.Response | None, attempt: int) -> float:
    """Seconds to wait: the server's Retry-After, else exponential back-off with jitter."""
    if response is not None:
        value = response.headers.get("retry-after", "")
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
    return min(10.0, 0.25 * 2**attempt) * (0.5 + random.random() / 2)


def _options(temperature, return_entropy, top_k, model, deadline_ms) -> dict:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return {"model": model, "temperature": float(temperature), "return_entropy": bool(return_entropy),
            "top_k": int(top_k), "deadline_ms": deadline_ms}


class ScoreClient:
    """Blocking client; thread-safe. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        encoding: str = "msgpack",
        timeout_s: float = 600.0,
        retry_timeout_s: float = 300.0,
        max_concurrency: int = 4,
        max_sequences_per_request: int | None = None,
        max_request_tokens: int | None = None,
        max_request_bytes: int | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        self._p = _Protocol(base_url, api_key, encoding, retry_timeout_s, max_sequences_per_request,
                            max_request_tokens, max_request_bytes)
        self._http = httpx.Client(base_url=self._p.base_url, timeout=timeout_s, headers=self._p.headers,
                                  transport=transport)
        self._max_concurrency = max(1, max_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=self._max_concurrency, thread_name_prefix="packscore-client")

    def __enter__(self) -> "ScoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()

    @property
    def limits(self) -> Limits:
        return self._p.limits

    def score(
        self,
        sequences: Iterable[Any],
        *,
        temperature: float = 1.0,
        return_entropy: bool = True,
        top_k: int = 0,
        model: str | None = None,
        deadline_ms: int | None = None,
    ) -> list[ScoredSequence]:
        """Scores ``sequences`` (dicts with input_ids / score_from / id, or plain id lists / arrays)."""
        seqs = [_as_seq(s) for s in sequences]
        options = _options(temperature, return_entropy, top_k, model, deadline_ms)
        give_up = time.monotonic() + self._p.retry_timeout_s
        if not self._p.limits_known:
            self._discover()
        parts = self._p.chunks(seqs, self._max_concurrency)
        futures = [self._pool.submit(self._send, [seqs[i] for i in part], options, give_up) for part in parts]
        return [r for f in futures for r in f.result()]

    def _discover(self) -> None:
        try:
            response = self._http.get("/readyz", timeout=5.0)
            if response.status_code == 200:
                self._p.learn(response.json().get("limits", {}))
        except (httpx.HTTPError, ValueError):
            pass  # the defaults and the first answer's headers will do

    def _send(self, seqs: list[_Seq], options: dict, give_up: float) -> list[ScoredSequence]:
        attempt = 0
        while True:
            try:
                response = self._http.post("/score", content=self._p.body(seqs, options))
            except httpx.TransportError as exc:
                wait = self._p.after_failure(None, exc, len(seqs), attempt, give_up)
            else:
                if response.status_code == 200:
                    return self._p.parse(response, options["top_k"])
                wait = self._p.after_failure(response, None, len(seqs), attempt, give_up)
                if wait is None:
                    half = len(seqs) // 2
                    return self._send(seqs[:half], options, give_up) + self._send(seqs[half:], options, give_up)
            time.sleep(wait)
            attempt += 1


class AsyncScoreClient:
    """The asyncio variant of ScoreClient, with the same arguments and results."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        encoding: str = "msgpack",
        timeout_s: float = 600.0,
        retry_timeout_s: float = 300.0,
        max_concurrency: int = 4,
        max_sequences_per_request: int | None = None,
        max_request_tokens: int | None = None,
        max_request_bytes: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self._p = _Protocol(base_url, api_key, encoding, retry_timeout_s, max_sequences_per_request,
                            max_request_tokens, max_request_bytes)
        self._http = httpx.AsyncClient(base_url=self._p.base_url, timeout=timeout_s, headers=self._p.headers,
                                       transport=transport)
        self._max_concurrency = max(1, max_concurrency)

    async def __aenter__(self) -> "AsyncScoreClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def limits(self) -> Limits:
        return self._p.limits

    async def score(
        self,
        sequences: Iterable[Any],
        *,
        temperature: float = 1.0,
        return_entropy: bool = True,
        top_k: int = 0,
        model: str | None = None,
        deadline_ms: int | None = None,
    ) -> list[ScoredSequence]:
        seqs = [_as_seq(s) for s in sequences]
        options = _options(temperature, return_entropy, top_k, model, deadline_ms)
        give_up = time.monotonic() + self._p.retry_timeout_s
        if not self._p.limits_known:
            await self._discover()
        gate = asyncio.Semaphore(self._max_concurrency)

        async def send(part: list[int]) -> list[ScoredSequence]:
            async with gate:
                return await self._send([seqs[i] for i in part], options, give_up)

        parts = await asyncio.gather(*(send(part) for part in self._p.chunks(seqs, self._max_concurrency)))
        return [r for part in parts for r in part]

    async def _discover(self) -> None:
        try:
            response = await self._http.get("/readyz", timeout=5.0)
            if response.status_code == 200:
                self._p.learn(response.json().get("limits", {}))
        except (httpx.HTTPError, ValueError):
            pass

    async def _send(self, seqs: list[_Seq], options: dict, give_up: float) -> list[ScoredSequence]:
        attempt = 0
        while True:
            try:
                response = await self._http.post("/score", content=self._p.body(seqs, options))
            except httpx.TransportError as exc:
                wait = self._p.after_failure(None, exc, len(seqs), attempt, give_up)
            else:
                if response.status_code == 200:
                    return self._p.parse(response, options["top_k"])
                wait = self._p.after_failure(response, None, len(seqs), attempt, give_up)
                if wait is None:
                    half = len(seqs) // 2
                    first = await self._send(seqs[:half], options, give_up)
                    return first + await self._send(seqs[half:], options, give_up)
            await asyncio.sleep(wait)
            attempt += 1
