"""What ``ScoreClient`` and ``AsyncScoreClient`` share before any I/O: their knobs, checked once when a
client is built, the per-address clients of an update everywhere, and a call's plan."""

from __future__ import annotations

import inspect
import numbers
import time
from typing import Any

import httpx

from packscore_client import everywhere
from packscore_client.inputs import as_seqs, bearer_key, options, seconds
from packscore_client.padded import PaddedBatch
from packscore_client.protocol import Limits, Protocol

UPDATE_TIMEOUT_S = 1800.0  # a checkpoint load may take minutes: the weights calls' floor, whatever timeout_s is


class _Base:
    """Construction and the request plan both clients share.

    ``retry_timeout_s`` bounds the retries of 429 / 503 (after their Retry-After) from the start of a
    call; ``connect_retry_s`` bounds how long an unreachable server is retried (a log line each), within
    the call's ``retry_timeout_s``, before ``ScoreError(0, "connection_error", ...)``. ``update_timeout_s``
    bounds the wait for the answer of POST /v1/weights (a checkpoint load) instead of ``timeout_s``.
    ``transport`` replaces the network (tests); the client closes it on close (an async one also as each
    loop it ran on ends), ``update_weights_everywhere``'s per-address clients never do.
    """

    _http_class: type = httpx.Client
    _direct_class: type = httpx.HTTPTransport  # an explicit transport: httpx reads no proxy from the environment

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        encoding: str = "msgpack",
        timeout_s: float = 600.0,
        retry_timeout_s: float = 300.0,
        connect_retry_s: float = 5.0,
        max_concurrency: int = 4,
        max_sequences_per_request: int | None = None,
        max_request_tokens: int | None = None,
        max_request_bytes: int | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        admin_key: str | None = None,
        update_timeout_s: float | None = None,
        _host: tuple[str, str] | None = None,
        _request_id: str | None = None,
    ):
        # checked here: httpx and the retry loops would take a NaN, a string or a negative bound and fail later, or never
        timeout_s = seconds(timeout_s, "timeout_s")
        retry_timeout_s, connect_retry_s = (seconds(retry_timeout_s, "retry_timeout_s", zero=True),
                                            seconds(connect_retry_s, "connect_retry_s", zero=True))
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, numbers.Integral) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int of at least 1, got {max_concurrency!r}")
        max_concurrency = int(max_concurrency)
        self._knobs = dict(api_key=api_key, encoding=encoding, timeout_s=timeout_s, retry_timeout_s=retry_timeout_s,
                           connect_retry_s=connect_retry_s, max_sequences_per_request=max_sequences_per_request,
                           max_request_tokens=max_request_tokens, max_request_bytes=max_request_bytes,
                           transport=transport, admin_key=admin_key)
        self._update_timeout_s = (max(timeout_s, UPDATE_TIMEOUT_S) if update_timeout_s is None
                                  else seconds(update_timeout_s, "update_timeout_s"))
        self._knobs["update_timeout_s"] = self._update_timeout_s
        self._p = Protocol(base_url, api_key, encoding, retry_timeout_s, max_sequences_per_request,
                           max_request_tokens, max_request_bytes, connect_retry_s)
        self._p.admin_key = bearer_key(admin_key, "admin_key")  # POST /v1/weights sends it instead of the API key
        self._max_concurrency = max_concurrency
        # A host that never answers must fail within the connect budget, not after timeout_s.
        timeout = httpx.Timeout(timeout_s, connect=max(1.0, min(timeout_s, connect_retry_s)))
        self._timeout = timeout
        headers = self._p.headers
        self._extensions: dict | None = None
        if _host is not None:  # base_url holds one address of a name: Host and TLS checks stay the name's
            headers = {**headers, "Host": _host[0]}
            if httpx.URL(self._p.base_url).scheme == "https":  # the certificate is checked against the name
                self._extensions = {"sni_hostname": _host[1]}
        if _request_id is not None:  # one update_weights_everywhere call: every pod logs it under one id
            headers = {**headers, "X-Request-Id": _request_id}
        self._http_kw = dict(base_url=self._p.base_url, timeout=timeout, headers=headers, transport=transport)
        self._http = self._http_class(**self._http_kw)

    _closed = False

    @property
    def limits(self) -> Limits:
        """What one request of this client may hold (sequences, tokens, bytes), which ``score`` splits a
        batch by: the server's limits capped by the knobs of the same names. Learned from GET /readyz
        by the first call (or ``ready()``, ``wait_ready()``) and from every answer's X-Packscore-Max-*
        headers; until then the ``Limits`` defaults, capped by the knobs."""
        return self._p.limits

    def _at(self, address: str, request_id: str):
        """A client of the same class and knobs for one address of this client's host, one request at a
        time, each sent with ``request_id``; it borrows this client's transport, which it leaves open.
        Without one it connects to the address itself, whatever HTTP(S)_PROXY says: a pod's address
        resolved from in-cluster DNS, which an egress proxy is not for and NO_PROXY rarely names."""
        url, host, server_name = everywhere.at_address(self._p.base_url, address)
        knobs = dict(self._knobs)
        if knobs["transport"] is not None:
            knobs["transport"] = everywhere.Borrowed(knobs["transport"])
        else:
            knobs["transport"] = self._direct_class()
        return type(self)(url, **knobs, max_concurrency=1, _host=(host, server_name), _request_id=request_id)

    def _update_timeout(self, timeout_s: float | None) -> httpx.Timeout:
        """The timeouts of one POST /v1/weights: the answer waited for ``timeout_s`` (the call's), else
        ``update_timeout_s``; connecting and sending as every request."""
        read = self._update_timeout_s if timeout_s is None else seconds(timeout_s, "timeout_s")
        return httpx.Timeout(self._timeout.write, connect=self._timeout.connect, read=read)

    def _within(self, within_s: float | None) -> httpx.Timeout | Any:
        """The timeouts of one request whose answer is due within ``within_s`` (what is left of a call's
        deadline_ms): each of the client's, no longer than that; None, the client's."""
        if within_s is None:
            return httpx.USE_CLIENT_DEFAULT
        t = self._timeout
        return httpx.Timeout(connect=min(t.connect, within_s), read=min(t.read, within_s),
                             write=min(t.write, within_s), pool=min(t.pool, within_s))

    def _check_open(self) -> None:
        if self._closed:  # else a thread pool's or httpx's RuntimeError, which does not say why
            raise RuntimeError(f"this {type(self).__name__} is closed: create a new one to send requests")

    # No defaults: the public methods' signatures hold them (tests/unit/test_client_options.py keeps them alike)
    def _plan(self, sequences, *, temperature, return_entropy, top_k, model, deadline_ms, weights_version):
        self._check_open()
        seqs = as_seqs(sequences)
        opts = options(temperature, return_entropy, top_k, model, deadline_ms, weights_version)
        now = time.monotonic()
        # deadline_ms bounds the whole call, its retries included; 0 or less goes to the server as
        # given, which answers 504 (0: no result is ready after 0 ms) or 422 (negative)
        if deadline_ms is not None and deadline_ms <= 0:
            return seqs, opts, now, None  # one attempt: no time is left for a retry
        deadline = None if deadline_ms is None else now + deadline_ms / 1000.0
        return seqs, opts, now + self._p.retry_timeout_s, deadline

    @staticmethod
    def _padded_plan(input_ids, attention_mask, response_mask, *, temperature, return_entropy, model, deadline_ms,
                     weights_version) -> tuple[PaddedBatch, dict, float | None]:
        """``score_padded``'s batch, the options of each of its ``score`` calls and when its rescoring must end."""
        batch = PaddedBatch.from_arrays(input_ids, attention_mask, response_mask)
        options(temperature, return_entropy, 0, model, deadline_ms, weights_version)  # refused now, sent or not
        kw = dict(temperature=temperature, return_entropy=return_entropy, model=model)
        end = time.monotonic() + deadline_ms / 1000.0 if deadline_ms is not None and deadline_ms > 0 else None
        return batch, kw, end


def _known(cls: type, knobs: dict) -> dict:
    """``knobs`` unchanged; a misspelt one raises naming the class built, not the private ``_Base``."""
    if unknown := sorted(knobs.keys() - _KNOBS):
        raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}")
    return knobs


_KNOBS = frozenset(inspect.signature(_Base.__init__).parameters) - {"self", "base_url", "api_key"}
