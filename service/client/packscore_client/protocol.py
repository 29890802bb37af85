"""What the blocking and the asyncio clients share, with no I/O: request bodies, splitting a batch
under the server's limits, answers, errors, and the retry and split decisions of one exchange.

``exchange`` is a generator that yields what it needs done (a body to POST, or a ``Post`` of one
with the seconds its answer may take, a ``(path, timeout)`` to GET, seconds to sleep) and receives
the outcome; each client drives it with its own kind of I/O, so the retry logic exists once.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import random
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Generator, Sequence

import httpx
import msgpack
import numpy as np

from packscore_client.answers import GIVEN_UP, readiness_answer
from packscore_client.errors import (NOT_THE_CONTRACT, ScoreError, describe, gateway_error, not_packscore,
                                    response_error)
from packscore_client.inputs import MAX_DEADLINE_MS, Seq, as_seq, as_seqs, bearer_key, options, seconds

# the input checks of inputs.py are importable from here too, as the names this module's callers use
__all__ = ["DEADLINE_GRACE_S", "Limits", "Post", "Protocol", "READY_POLL_S", "ScoreError", "ScoredSequence", "Seq",
           "WeightsUpdate", "as_seq", "as_seqs", "bearer_key", "options", "renumbered", "retry_after", "seconds"]

log = logging.getLogger("packscore_client")

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
    weights_version: str  # the version of the weights that scored it
    mismatch: dict[str, float] | None = None  # against rollout_logprobs, when the sequence sent them


@dataclass(frozen=True)
class WeightsUpdate:
    """The server's answer to ``update_weights``: the new version serves."""

    model: str
    weights_version: str
    previous_version: str
    load_s: float
    swap_ms: float
    request_id: str | None = None  # the answer's X-Request-Id, which the server's log lines for the update name


@dataclass(frozen=True)
class Post:
    """A body to POST whose answer is waited for ``within_s`` at most (what is left of the call's
    deadline_ms, and a grace for the server's own 504), else for the client's timeouts."""

    body: bytes
    within_s: float | None


@dataclass(frozen=True)
class Limits:
    """What one request may hold. The client's knobs cap what the server reports."""

    max_sequences_per_request: int = 256
    max_request_tokens: int = 65536
    max_request_bytes: int = 8 << 20


class Protocol:
    """One client's configuration and what it has learned of the server's limits."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        encoding: str,
        retry_timeout_s: float,
        max_sequences_per_request: int | None,
        max_request_tokens: int | None,
        max_request_bytes: int | None,
        connect_retry_s: float = 5.0,
    ):
        if encoding not in ("msgpack", "json"):
            raise ValueError(f"encoding must be 'msgpack' or 'json', got {encoding!r}")
        self.base_url = base_url.rstrip("/")
        self.encoding = encoding
        self.retry_timeout_s = retry_timeout_s
        self.connect_retry_s = connect_retry_s
        api_key = bearer_key(api_key, "api_key")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.admin_key: str | None = None  # POST /v1/weights: the admin key, when the server has one
        media = "application/msgpack" if encoding == "msgpack" else "application/json"
        self.headers |= {"Content-Type": media, "Accept": media}
        self.knobs = {
            "max_sequences_per_request": max_sequences_per_request,
            "max_request_tokens": max_request_tokens,
            "max_request_bytes": max_request_bytes,
        }
        for name, value in self.knobs.items():  # else 0 meant no cap, -1 or True one sequence a request, 2.5 three
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"{name} must be an int of at least 1 or None, got {value!r}")
            self.knobs[name] = None if value is None else int(value)
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

    def proxy_refused(self, size: int) -> None:
        """A proxy in front of the server answered its own 413 to a body of ``size`` bytes: every later
        body of this client stays below that, as with a lower ``max_request_bytes``."""
        cap = max(1024, size - 1)
        with self._lock:
            if cap >= self.limits.max_request_bytes:
                return
            self.knobs["max_request_bytes"] = cap
            self.limits = self._capped(self.limits)
        log.warning("packscore: %s answered a request body of %d bytes with a 413 page of its own (a proxy's body "
                    "limit, not the server's): this client now sends bodies under that, in more requests; raise the "
                    "proxy's limit (nginx-ingress: proxy-body-size) or set max_request_bytes to say so from the start",
                    self.base_url, size)

    def learn_from_readyz(self, response: httpx.Response | Exception) -> None:
        """The discovery answer, if any; without one the defaults and the first answer's headers do."""
        if isinstance(response, httpx.Response) and response.status_code == 200:
            try:
                self.learn(response.json().get("limits", {}))
            except (ValueError, AttributeError):  # not JSON, or not the contract's object (another server's)
                pass

    def chunks(self, seqs: Sequence[Seq], parallel: int) -> list[list[int]]:
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
            # rollout log-probs: 4 bytes each in msgpack, up to about 20 as JSON text
            n = s.ids.size
            b = n * per_token + (0 if s.rollout is None else s.rollout.size * (4 if per_token == 4 else 24)) + 96
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

    def body(self, seqs: Sequence[Seq], options: dict) -> bytes:
        if self.encoding == "msgpack":
            items = [{"id": s.id, "input_ids": s.ids.astype("<i4").tobytes(), "score_from": s.score_from} for s in seqs]
            for item, s in zip(items, seqs):
                if s.rollout is not None:
                    item["rollout_logprobs"] = s.rollout.astype("<f4").tobytes()
            return msgpack.packb({**options, "sequences": items}, use_bin_type=True)
        items = [{"id": s.id, "input_ids": s.ids.tolist(), "score_from": s.score_from} for s in seqs]
        for item, s in zip(items, seqs):
            if s.rollout is not None:
                item["rollout_logprobs"] = s.rollout.tolist()
        return json.dumps({**options, "sequences": items}, separators=(",", ":")).encode()

    def weights_request(self, model: str | None, path: str, version: str | None) -> tuple[bytes, dict]:
        """The body and headers of POST /v1/weights (JSON; the admin key when one was given)."""
        return json.dumps({"model": model, "path": str(path), "version": version}).encode(), self.weights_headers()

    def weights_headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        return headers

    def weights_exchange(self, model: str | None, path: str, version: str | None,
                         give_up: float) -> Generator[bytes | float, Any, WeightsUpdate]:
        """POST /v1/weights until answered, as ``exchange`` drives /score: 429, 503 and 409
        ``update_in_progress`` (an update refused for now changes nothing) are retried after their
        Retry-After until ``give_up``; a server not reached is retried for ``connect_retry_s``; one
        never sent (``_NOT_SENT``) raises saying so. One that may have reached the server (a write or
        read timeout) is not sent again."""
        body, _ = self.weights_request(model, path, version)
        attempt, unreachable_since = 0, None
        while True:
            outcome = yield body
            if isinstance(outcome, httpx.Response):
                if outcome.status_code not in _RETRY_STATUSES and not _update_in_progress(outcome):
                    return self.weights_answer(outcome)
                wait = retry_after(outcome, attempt)
                if time.monotonic() + wait > give_up:
                    raise response_error(outcome)
                self._waiting_out("POST /v1/weights", response_error(outcome), wait, attempt)
            elif isinstance(outcome, (httpx.ConnectError, httpx.ConnectTimeout)):
                wait, unreachable_since = self._unreachable(outcome, attempt, unreachable_since, give_up,
                                                            _UPDATE_NOT_SENT)
            elif isinstance(outcome, _NOT_SENT):
                raise self.not_sent("POST /v1/weights", outcome, _UPDATE_NOT_SENT) from outcome
            else:
                late = (": no answer within update_timeout_s or the call's timeout_s"
                        if isinstance(outcome, httpx.ReadTimeout) else "")
                raise ScoreError(0, "connection_error", f"POST /v1/weights to {self.base_url} failed after it was "
                                 f"sent ({describe(outcome)}{late}){_MAY_HAVE_RUN}") from outcome
            yield wait
            attempt += 1

    def get_exchange(self, route: str, give_up: float, timeout_s: float, deadline: float | None = None
                     ) -> Generator[tuple[str, float] | float, Any, httpx.Response | Exception]:
        """GET ``route`` (``/v1/models``) with ``exchange``'s retries: 429 and 503 after their Retry-After
        until ``give_up``, a server not reached (a gateway's 502/504 page too) for ``connect_retry_s``, a
        connection lost before the answer once more. Returns the last answer, or the exception that
        replaced it, for the caller to read; ``deadline`` bounds it all as it bounds ``exchange``."""
        attempt, unreachable_since, resent = 0, None, False
        while True:
            wait_s = timeout_s
            if deadline is not None:
                if (left := deadline - time.monotonic()) <= 0:
                    raise ScoreError(504, "deadline_exceeded", f"deadline_ms passed before GET {route} was answered.",
                                     "deadline_ms")
                wait_s = min(timeout_s, left + DEADLINE_GRACE_S)
            outcome = yield (route, wait_s)
            if isinstance(outcome, httpx.Response) and (gateway := gateway_error(outcome)) is not None:
                wait, unreachable_since = self._unreachable(gateway, attempt, unreachable_since, give_up,
                                                            deadline=deadline)
            elif isinstance(outcome, httpx.Response):
                wait = retry_after(outcome, attempt)
                if outcome.status_code not in _RETRY_STATUSES or time.monotonic() + wait > give_up:
                    return outcome
                error = response_error(outcome)
                if deadline is not None and time.monotonic() + wait >= deadline:
                    raise ScoreError(504, "deadline_exceeded", f"deadline_ms would pass before a retry of GET {route} "
                                     f"could be answered (the server said {error.status} {error.type}).", "deadline_ms",
                                     error.request_id)
                self._waiting_out(f"GET {route}", error, wait, attempt)
            elif isinstance(outcome, _NOT_SENT_WHOLE):
                wait, unreachable_since = self._unreachable(outcome, attempt, unreachable_since, give_up,
                                                            deadline=deadline)
            elif isinstance(outcome, (httpx.RemoteProtocolError, httpx.ReadError)) and not resent:
                resent, wait = True, _RESEND_WAIT_S  # a kept-alive connection the server closed: a GET changes nothing
            elif isinstance(outcome, httpx.TimeoutException) and deadline is not None and time.monotonic() >= deadline:
                raise ScoreError(504, "deadline_exceeded", f"no answer to GET {route} from {self.base_url} by "
                                 f"deadline_ms ({describe(outcome)})", "deadline_ms") from outcome
            else:
                return outcome
            yield wait
            attempt += 1

    def readiness_wait(self, timeout_s: float, request_timeout_s: float) -> Generator[tuple[str, float] | float, Any, dict]:
        """GET /readyz until ready, as ``exchange`` drives /score: yields ``("/readyz", timeout)``
        for a GET (send back its response, or the exception that replaced it) and a float to sleep,
        once a second. Not ready yet: no server, a 503, a gateway's 502 or 504. A status that wants an
        operator (``failed``; ``restart_failed``, which the server retries but seldom heals) raises
        ScoreError 503 at once; ``timeout_s`` passed, ScoreError 0 ``not_ready`` naming the last
        status. Returns the ready body, whose limits the protocol learns."""
        end = time.monotonic() + seconds(timeout_s, "timeout_s", zero=True)  # a NaN never ended, a str failed obscurely
        while True:
            outcome = yield ("/readyz", max(0.1, min(request_timeout_s, end - time.monotonic())))
            if isinstance(outcome, Exception):
                last = describe(outcome)
            else:
                body = readiness_answer(outcome)
                if body["status"] == "ready":
                    self.learn_from_readyz(outcome)
                    return body
                last = str(body["status"])
                if last in GIVEN_UP:
                    raise ScoreError(503, "not_ready", f"{self.base_url} is not ready and wants an operator: {last}")
            left = end - time.monotonic()
            if left <= 0:
                raise ScoreError(0, "not_ready", f"{self.base_url} was not ready after {timeout_s:g}s (last: {last})")
            yield min(READY_POLL_S, left)

    @staticmethod
    def weights_answer(response: httpx.Response) -> WeightsUpdate:
        if (gateway := gateway_error(response)) is not None:  # a proxy gave up on the server, which may go on
            raise gateway.renamed(f"{gateway.message} (a gateway's page, not the server's){_MAY_HAVE_RUN}", None)
        if response.status_code != 200:
            raise response_error(response)
        try:
            body = response.json()
            return WeightsUpdate(body["model"], body["weights_version"], body["previous_version"], body["load_s"],
                                 body["swap_ms"], response.headers.get("x-request-id"))
        except NOT_THE_CONTRACT as exc:
            raise not_packscore(response, "POST /v1/weights", exc, _MAY_HAVE_RUN) from exc

    def parse(self, response: httpx.Response, top_k: int, seqs: Sequence[Seq]) -> list[ScoredSequence]:
        self.learn(response.headers)
        media = response.headers.get("content-type", "").split(";")[0].strip()
        try:
            body = msgpack.unpackb(response.content, raw=False) if "msgpack" in media else response.json()
            model, version = body["model"], body["weights_version"]
            results = [_result(r, top_k, model, version) for r in body["results"]]
        except NOT_THE_CONTRACT as exc:
            raise not_packscore(response, "POST /score", exc) from exc
        # results out of step with the sequences would pair one trajectory's scores with another's
        if len(results) != len(seqs):
            raise not_packscore(response, "POST /score", ValueError(
                f"{len(results)} results for {len(seqs)} sequences"))
        for i, (seq, result) in enumerate(zip(seqs, results)):
            if result.logprobs.size != seq.ids.size - seq.score_from:
                raise not_packscore(response, "POST /score", ValueError(
                    f"result {i} holds {result.logprobs.size} log-probs for {seq.ids.size - seq.score_from} "
                    "scored positions"))
        return results

    def exchange(self, seqs: list[Seq], options: dict, give_up: float, indices: Sequence[int] | None = None,
                 deadline: float | None = None) -> Generator[bytes | float, Any, list[ScoredSequence]]:
        """The results of ``seqs`` in one request, or split under the limits a 413 names (else in halves).
        ``indices``: where each of ``seqs`` stands in the caller's list, which an error names (the
        server numbers the sequences of the request it got).

        Yields a ``Post`` of a body (and receives the ``httpx.Response``, or the ``httpx.RequestError``
        raised instead) or seconds to sleep (and receives None). 429 and 503 are retried after their
        Retry-After until ``give_up`` (a ``time.monotonic()``); a server that cannot be reached is
        retried for ``connect_retry_s`` from the first failure in a row (until ``give_up`` at most), a log
        line each, then raised;
        a read timeout (the server has the request) raises ``read_timeout`` at once; a connection
        lost before any answer came is sent once more.
        ``deadline`` (a ``time.monotonic()``, from the call's ``deadline_ms``) bounds the retries too:
        each attempt asks the server for what is left of it, its answer is waited for until DEADLINE_GRACE_S
        past it (a ``Post``), then 504 ``deadline_exceeded``, and none is sent once it has passed.
        """
        attempt, unreachable_since, resent = 0, None, False
        # deadline_ms of 0 or less, sent once as given: the server answers it at once
        due = deadline if deadline is not None or options.get("deadline_ms") is None else time.monotonic()
        while True:
            within_s = None if due is None else DEADLINE_GRACE_S
            if deadline is not None:
                # a float's rounding may put a deadline_ms near the server's bound past it: never sent past it
                left_ms = min(MAX_DEADLINE_MS, math.ceil((deadline - time.monotonic()) * 1000.0))
                if left_ms <= 0:
                    raise ScoreError(504, "deadline_exceeded", "deadline_ms passed before the result was ready "
                                     "(before this part of the call was sent, or while it was retried).", "deadline_ms")
                options = {**options, "deadline_ms": left_ms}
                within_s += left_ms / 1000.0
            sent = self.body(seqs, options)
            outcome = yield Post(sent, within_s)
            if isinstance(outcome, httpx.Response) and (gateway := gateway_error(outcome)) is not None:
                # a proxy's own 502/504 (a restart, a pod not ready behind it): the server was not
                # reached, and is waited for as one that refuses connections
                wait, unreachable_since = self._unreachable(gateway, attempt, unreachable_since, give_up,
                                                            deadline=deadline)
            elif isinstance(outcome, httpx.Response):
                unreachable_since, resent = None, False  # a loss after an answer is a first one again
                if outcome.status_code == 200:
                    return self.parse(outcome, options["top_k"], seqs)
                error = response_error(outcome)
                parts = None
                halves = [list(range(len(seqs) // 2)), list(range(len(seqs) // 2, len(seqs)))]
                if outcome.status_code == 413 and error.type in _SPLITTABLE and len(seqs) > 1:
                    self.learn(outcome.headers)
                    parts = self.chunks(seqs, 1)  # under the limits just learned
                    parts = parts if len(parts) > 1 else halves  # they did not say how
                elif outcome.status_code == 413 and error.type == "http_error" and len(seqs) > 1:
                    # A proxy's own page (nginx-ingress refuses bodies over 1 MiB by default): the server
                    # never saw it; later requests stay under what was refused.
                    self.proxy_refused(len(sent))
                    parts = self.chunks(seqs, 1)
                    parts = parts if len(parts) > 1 else halves
                elif outcome.status_code == 408 and error.type == "request_timeout" and len(seqs) > 1:
                    # The body did not reach the server within its read timeout (a slow link): nothing
                    # was scored, and half the body arrives in half the time.
                    log.warning("packscore: %s did not receive a request of %d sequences within its read "
                                "timeout (408); sending it in halves", self.base_url, len(seqs))
                    parts = halves
                if parts is not None:
                    where = list(indices if indices is not None else range(len(seqs)))
                    out: list[ScoredSequence] = []
                    for part in parts:
                        out += yield from self.exchange([seqs[i] for i in part], options, give_up,
                                                        [where[i] for i in part], deadline)
                    return out
                wait = retry_after(outcome, attempt)
                if outcome.status_code not in _RETRY_STATUSES or time.monotonic() + wait > give_up:
                    if error.param is None and outcome.status_code == 413 and len(seqs) == 1:
                        # split down to one sequence still too large: the caller learns which one
                        error = error.renamed(error.message, "sequences[0]")
                    raise renumbered(error, indices)
                if deadline is not None and time.monotonic() + wait >= deadline:
                    raise ScoreError(504, "deadline_exceeded", f"deadline_ms would pass before a retry could "
                                     f"be answered (the server said {outcome.status_code} {error.type}).", "deadline_ms",
                                     error.request_id)
                self._waiting_out("POST /score", error, wait, attempt)
            elif isinstance(outcome, httpx.TimeoutException) and due is not None and time.monotonic() >= due:
                # The server was told the deadline and answers 504 itself at it: none came, even a grace later
                raise ScoreError(504, "deadline_exceeded", f"no answer from {self.base_url} by deadline_ms, nor "
                                 f"{DEADLINE_GRACE_S:g}s past it for the server's own 504 ({describe(outcome)}); the "
                                 "request was not sent again", "deadline_ms") from outcome
            elif isinstance(outcome, httpx.ReadTimeout):
                # The server has the request and is still scoring it: sent again, it would be scored twice
                # on a server already too slow, and the answer would come no sooner.
                raise ScoreError(0, "read_timeout", f"{self.base_url} sent no answer within timeout_s; the request "
                                 "was not sent again (raise timeout_s, or send less per call)") from outcome
            elif isinstance(outcome, _NOT_SENT):  # waited out for timeout_s already: not waited out again
                raise self.not_sent("POST /score", outcome, "; nothing was scored") from outcome
            elif isinstance(outcome, _NOT_SENT_WHOLE):  # the server cannot have scored it
                wait, unreachable_since = self._unreachable(outcome, attempt, unreachable_since, give_up,
                                                            deadline=deadline)
            elif isinstance(outcome, (httpx.RemoteProtocolError, httpx.ReadError)):
                # The connection lost before any answer: most often a kept-alive one the server closed
                # (idle, or restarting) as the request left, which it never read. Scoring has no side
                # effects, so one more try is safe; a second loss in a row is a server going down.
                if resent:
                    raise ScoreError(0, "connection_error", f"{self.base_url} closed the connection after the "
                                     f"request was sent, twice in a row ({describe(outcome)}); it was not sent "
                                     "a third time") from outcome
                resent, wait = True, _RESEND_WAIT_S
                log.warning("packscore: %s closed the connection before answering (%s); sending the request once "
                            "more", self.base_url, describe(outcome))
            else:
                raise ScoreError(0, "connection_error", f"the request to {self.base_url} failed "
                                 f"({describe(outcome)})") from outcome
            yield wait
            attempt += 1

    def _waiting_out(self, route: str, error: ScoreError, wait: float, attempt: int) -> None:
        """An INFO line for each answer waited out (429, 503, an update's 409): the server's own flow
        control, not a fault to warn of, but without it a throttled trainer sees only slowness."""
        said = "" if error.type == "http_error" else f": {error.message}"  # a proxy's page says nothing useful
        request_id = f", request_id {error.request_id}" if error.request_id else ""
        log.info("packscore: %s to %s answered %d %s, retrying in %.1fs (retry %d%s; gives up %gs after the call "
                 "started: retry_timeout_s)%s", route, self.base_url, error.status, error.type, wait, attempt + 1,
                 request_id, self.retry_timeout_s, said)

    def not_sent(self, route: str, error: Exception, consequence: str) -> ScoreError:
        """The error of a request that never left this client (``_NOT_SENT``): the server was not asked."""
        why = ("every connection of this client's pool stayed busy with its other requests for timeout_s (PoolTimeout; "
               "fewer calls at once on one client, or a larger timeout_s)" if isinstance(error, httpx.PoolTimeout) else "")
        return ScoreError(0, "connection_error", f"{route} to {self.base_url} was not sent: {why or describe(error)}"
                          f"{consequence}")

    def _unreachable(self, error: Exception, attempt: int, since: float | None, give_up: float,
                     consequence: str = "", deadline: float | None = None) -> tuple[float, float]:
        """``(seconds to wait, when the failures in a row began)`` before trying a server that was not
        reached again, with a log line; ScoreError ``connection_error`` (ending in ``consequence``) once
        ``connect_retry_s`` from the first failure, or ``give_up`` (the call's retry_timeout_s) if sooner,
        would pass; ScoreError 504 ``deadline_exceeded`` where the wait would reach ``deadline``."""
        now = time.monotonic()
        since = since or now
        bound = min(give_up, since + self.connect_retry_s)
        # the bound that ends the retries, named as it is: the call's budget may cut the connect window short
        ends = (f"{self.retry_timeout_s:g}s after the call started: retry_timeout_s"
                if give_up < since + self.connect_retry_s else
                f"{self.connect_retry_s:g}s after the first failure: connect_retry_s")
        # a write that failed reached the server: the request did not arrive whole
        what = "send the request whole to" if isinstance(error, (httpx.WriteError, httpx.WriteTimeout)) else "reach"
        if now >= bound:
            raise ScoreError(0, "connection_error", f"could not {what} {self.base_url} for "
                             f"{now - since:.1f}s: {describe(error)}{consequence}") from error
        wait = min(retry_after(None, attempt), bound - now)  # the last try at the bound itself
        if deadline is not None and now + wait >= deadline:  # raised now, as a 429 whose Retry-After is too long
            raise ScoreError(504, "deadline_exceeded", f"deadline_ms would pass before a retry could be answered "
                             f"(could not {what} {self.base_url}: {describe(error)}).", "deadline_ms") from error
        log.warning("packscore: cannot %s %s (%s); retrying in %.1fs (gives up %s)", what, self.base_url,
                    describe(error), wait, ends)
        return wait, since


# How long past a call's deadline_ms its request's answer is waited for: the server, told the deadline,
# answers 504 itself at it, which names the request (its request id) where a client's own 504 cannot.
DEADLINE_GRACE_S = 0.5

# Before the one resend after a lost connection: a server that died closed its other kept-alive
# connections too, and a resend at once could take one of them before its close is seen.
_RESEND_WAIT_S = 0.2

# Failures before the request reached the server whole: sending it again cannot score it twice.
_NOT_SENT_WHOLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.WriteTimeout)
# Never sent, and a retry soon would meet them again: no pooled connection free for timeout_s, a URL it cannot send to
_NOT_SENT = (httpx.PoolTimeout, httpx.UnsupportedProtocol)
_UPDATE_NOT_SENT = "; the update was not sent, so it did not run: sending it again is safe"
_MAY_HAVE_RUN = "; the update may have run: /v1/models names the version served"
READY_POLL_S = 1.0


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
    # float32 figures as Python floats: JSON prints them short, msgpack sends doubles; both read back alike
    mismatch = {name: float(np.float32(v)) for name, v in r["mismatch"].items()} if "mismatch" in r else None
    return ScoredSequence(r.get("id"), logprobs, entropy, ids, top, model, version, mismatch)


_REQUEST_INDEX = re.compile(r"\b(sequences\[|Sequence )(\d+)")


def renumbered(error: ScoreError, indices: Sequence[int] | None) -> ScoreError:
    """``error`` with the request's sequence numbers (``sequences[3]``, "Sequence 3") turned into
    the caller's."""
    if indices is None:
        return error

    def caller(match: re.Match) -> str:
        i = int(match.group(2))
        return f"{match.group(1)}{indices[i] if i < len(indices) else i}"

    param = _REQUEST_INDEX.sub(caller, error.param) if error.param else error.param
    return error.renamed(_REQUEST_INDEX.sub(caller, error.message), param)


def _update_in_progress(response: httpx.Response) -> bool:
    """A 409 ``update_in_progress``: another update of the model (often this one, sent before and
    given up on) still loads; the server asks to retry once it is done."""
    return response.status_code == 409 and response_error(response).type == "update_in_progress"


def retry_after(response: httpx.Response | None, attempt: int) -> float:
    """Seconds to wait: the server's Retry-After, else exponential back-off with jitter. A
    Retry-After of 0 (a proxy's) is floored by a back-off from 50 ms to 1 s, else the client would
    send thousands of requests a second to a server that is already refusing them."""
    if response is not None:
        value = response.headers.get("retry-after", "")
        try:
            seconds = float(value)
        except ValueError:  # absent, or an HTTP date
            seconds = math.nan
        if not math.isnan(seconds):
            return max(seconds, min(1.0, 0.05 * 2**attempt))
    return min(10.0, 0.25 * 2**attempt) * (0.5 + random.random() / 2)
