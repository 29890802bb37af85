"""``ScoreClient`` (blocking, thread-safe) and ``AsyncScoreClient`` (asyncio): the same arguments
and results; each only drives ``Protocol.exchange`` with its own kind of I/O."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from contextlib import asynccontextmanager, contextmanager
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Generator, Iterable

import httpx

from packscore_client import everywhere
from packscore_client.answers import models_answer, readiness_answer
from packscore_client.base import UPDATE_TIMEOUT_S, _Base, _known
from packscore_client.padded import PaddedScores, by_one_version
from packscore_client.protocol import Post, ScoredSequence, ScoreError, WeightsUpdate

__all__ = ["AsyncScoreClient", "ScoreClient", "UPDATE_TIMEOUT_S"]  # UPDATE_TIMEOUT_S: base.py's, named here too

_DISCOVERY_TIMEOUT_S = 5.0


def _left_s(deadline: float | None) -> float | None:
    """What is left of a call's deadline, in seconds a lock's or a wait's timeout can hold (a deadline_ms
    of centuries is legal and overflows them)."""
    return None if deadline is None else min(threading.TIMEOUT_MAX, max(0.0, deadline - time.monotonic()))


def _discovery_s(deadline: float | None) -> float:
    """How long GET /readyz for the limits is waited for: what is left of the call's deadline_ms, if less."""
    return _DISCOVERY_TIMEOUT_S if deadline is None else min(_DISCOVERY_TIMEOUT_S, _left_s(deadline))


def _queued_past_deadline() -> ScoreError:
    return ScoreError(504, "deadline_exceeded", "deadline_ms passed while part of the call waited to be sent (the "
                      "client's max_concurrency requests were busy with its other calls).", "deadline_ms")


class ScoreClient(_Base):
    """Blocking client; thread-safe. Use as a context manager or call ``close()``."""

    def __init__(self, base_url: str, api_key: str | None = None, **knobs: Any):
        super().__init__(base_url, api_key, **_known(type(self), knobs))
        self._pool = ThreadPoolExecutor(max_workers=self._max_concurrency, thread_name_prefix="packscore-client")
        self._in_use_lock = threading.Lock()
        self._in_use = 0  # requests on the wire: the connection pool closes once none is
        self._learning = threading.Lock()
        self._readyz_tries = 0  # GET /readyz sent to learn the limits: concurrent first calls share one
        weakref.finalize(self, self._http.close)  # dropped unclosed: its sockets close, not left to warn at collection

    def __enter__(self) -> "ScoreClient":
        self._check_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """No new request is sent. A request already on the wire (a failed call's other parts, or
        a call on another thread) ends with its answer, and the connections close after the last:
        a socket closed under a thread waiting on it can be reused by another connection's
        descriptor, and that thread then waits out ``timeout_s`` or reads another's answer."""
        with self._in_use_lock:
            self._closed = True
            idle = self._in_use == 0
        self._pool.shutdown(wait=False, cancel_futures=True)
        if idle:
            self._http.close()

    @contextmanager
    def _http_in_use(self):
        with self._in_use_lock:
            self._check_open()
            self._in_use += 1
        try:
            yield self._http
        finally:
            with self._in_use_lock:
                self._in_use -= 1
                last = self._closed and self._in_use == 0
            if last:
                self._http.close()

    def score(
        self,
        sequences: Iterable[Any],
        *,
        temperature: float = 1.0,
        return_entropy: bool = True,
        top_k: int = 0,
        model: str | None = None,
        deadline_ms: int | None = None,
        weights_version: str | None = None,
    ) -> list[ScoredSequence]:
        """Scores ``sequences`` (dicts with input_ids / score_from / id and optionally
        rollout_logprobs, or unpadded 1-D id lists or arrays); one result per sequence, in order,
        each naming the weights version that scored it. ``weights_version`` pins the version: the
        server answers 409 (raised as ScoreError) when it serves another. No sequences: [] with no
        request scored."""
        seqs, opts, give_up, deadline = self._plan(sequences, temperature=temperature, return_entropy=return_entropy, top_k=top_k,
                                         model=model, deadline_ms=deadline_ms, weights_version=weights_version)
        self._learn_limits(deadline)
        parts = self._p.chunks(seqs, self._max_concurrency)
        stop = threading.Event()  # set once the call has failed: its other parts send nothing more
        futures = [self._pool.submit(self._drive, self._p.exchange([seqs[i] for i in part], opts, give_up, part,
                                                                   deadline), stop=stop) for part in parts]
        try:
            # a part still queued behind other calls' requests at its deadline raises then, not once it is sent
            done, _ = wait(futures, timeout=_left_s(deadline), return_when=FIRST_EXCEPTION)
            if len(done) < len(futures) and not any(f.exception() for f in done) and any([f.cancel() for f in futures]):
                raise _queued_past_deadline()
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)  # the first failure in time, not in order
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
            return [r for f in futures for r in f.result()]
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            raise

    def score_padded(self, input_ids: Any, attention_mask: Any, response_mask: Any, *, temperature: float = 1.0,
                     return_entropy: bool = True, model: str | None = None,
                     deadline_ms: int | None = None, weights_version: str | None = None) -> PaddedScores:
        """A trainer's padded batch ([B, T] ids and attention mask, [B, R] response mask over the last R
        columns) -> [B, R] float32 log-probs and entropy aligned with the response mask; pads are
        never sent. See ``packscore_client.padded``. Every row is scored by one weights version:
        ``weights_version`` pins it (ScoreError 409 when another serves); without it, rows whose
        part met a weight update are scored again by the version served after it."""
        batch, kw, end = self._padded_plan(input_ids, attention_mask, response_mask, temperature=temperature,
                                           return_entropy=return_entropy, model=model, deadline_ms=deadline_ms,
                                           weights_version=weights_version)
        try:
            results = (self.score(batch.sequences, weights_version=weights_version, deadline_ms=deadline_ms, **kw)
                       if batch.sequences else [])
            steps = by_one_version(results, batch.sequences, end)
            ask = next(steps)
            while True:
                if ask[0] == "models":
                    ask = steps.send(self._models(end))
                    continue
                try:
                    got = self.score(ask[1], weights_version=ask[2], deadline_ms=ask[3], **kw)
                except ScoreError as error:
                    got = error
                ask = steps.send(got)
        except StopIteration as done:
            return batch.scores(done.value, return_entropy)
        except ScoreError as error:  # the first pass's or a rescoring's: named by the rows' places in the arrays
            raise batch.named_by_place(error) from error

    def models(self) -> list[dict]:
        """GET /v1/models: the served models, each with its ``weights_version`` (API.md); a 429, a 503 (the
        server loading or draining) and a server not reached are waited out as ``score`` waits them out."""
        return self._models()

    def _models(self, deadline: float | None = None) -> list[dict]:
        return models_answer(self._drive(self._p.get_exchange("/v1/models", time.monotonic() + self._p.retry_timeout_s,
                                                              _DISCOVERY_TIMEOUT_S, deadline)))

    def ready(self) -> dict:
        """GET /readyz's body: ``status`` is ``"ready"`` (with the served models and their limits) or
        the reason the server is not (``loading``, ``draining``, ...). An unreachable server raises
        ``ScoreError`` 0 ``connection_error`` at once (``wait_ready`` waits for one)."""
        answer = readiness_answer(outcome := self._get("/readyz"))
        self._p.learn_from_readyz(outcome)
        return answer

    def wait_ready(self, timeout_s: float = 600.0) -> dict:
        """Polls /readyz once a second until the server is ready, and returns its body. No server
        yet, a 503 or a gateway's 502/504 is not ready yet; ``failed`` or ``restart_failed`` (wanting
        an operator) raises ``ScoreError`` 503 at once; after ``timeout_s``, ``ScoreError`` 0 ``not_ready``."""
        return self._drive(self._p.readiness_wait(timeout_s, _DISCOVERY_TIMEOUT_S))

    def update_weights(self, model: str | None, path: str, version: str | None = None, *,
                       timeout_s: float | None = None) -> WeightsUpdate:
        """Asks the server to serve the checkpoint at ``path`` (relative to its --weights-root) for
        ``model``; returns once the new version serves. ``version`` defaults to a content hash. The
        answer is waited for ``timeout_s`` (default: the client's ``update_timeout_s``)."""
        timeout = self._update_timeout(timeout_s)
        steps = self._p.weights_exchange(model, path, version, time.monotonic() + self._p.retry_timeout_s)
        return self._drive(steps, "/v1/weights", self._p.weights_headers(), timeout=timeout)

    def update_weights_everywhere(self, model: str | None, path: str, version: str | None = None, *,
                                  max_concurrency: int = everywhere.MAX_CONCURRENCY,
                                  timeout_s: float | None = None) -> dict[str, WeightsUpdate]:
        """``update_weights`` sent to every address the URL's host resolves to (the pods behind a
        headless Service), ``max_concurrency`` at a time, each with its own retries; returns
        ``{address: WeightsUpdate}``. Raises ``UpdateEverywhereError`` (a ScoreError) naming every
        address that failed and why, with ``updated`` and ``failed``, or when the addresses serve
        different versions afterwards. Every address gets one new ``X-Request-Id``, which each
        answer, error and that error carry as ``request_id``. Each address's answer is waited for
        ``timeout_s`` (default: the client's ``update_timeout_s``)."""
        self._check_open()
        bound = everywhere.concurrency(max_concurrency)
        wait_s = self._update_timeout(timeout_s).read
        found = everywhere.addresses(self._p.base_url)
        request_id = everywhere.new_request_id()

        def one(address: str) -> WeightsUpdate | ScoreError:
            try:
                pod = self._at(address, request_id)
            except (ValueError, httpx.InvalidURL) as exc:  # no URL can hold this address: its failure alone
                return everywhere.named(address, exc, request_id)
            with pod:
                try:
                    return pod.update_weights(model, path, version, timeout_s=wait_s)
                except ScoreError as error:
                    return error

        with ThreadPoolExecutor(max_workers=min(len(found), bound), thread_name_prefix="packscore-client-pods") as pool:
            results = dict(zip(found, pool.map(one, found)))
        return everywhere.outcome(self._p.base_url, results, request_id)

    def _learn_limits(self, deadline: float | None = None) -> None:
        """GET /readyz for the limits while they are unknown, one for the calls that wait on it meanwhile:
        they take its outcome, learned or not, rather than each sending one more in turn after a failure.
        A call's ``deadline`` (from deadline_ms) bounds its wait here too; past it, the exchange raises 504."""
        tried = self._readyz_tries
        if self._p.limits_known or not self._learning.acquire(timeout=-1 if deadline is None else _left_s(deadline)):
            return
        try:
            if not self._p.limits_known and self._readyz_tries == tried and (wait_s := _discovery_s(deadline)) > 0:
                self._p.learn_from_readyz(self._get("/readyz", wait_s))
                self._readyz_tries += 1
        finally:
            self._learning.release()

    def _get(self, path: str, timeout_s: float = _DISCOVERY_TIMEOUT_S) -> httpx.Response | Exception:
        try:
            with self._http_in_use() as http:
                return http.get(path, timeout=timeout_s, extensions=self._extensions)
        except httpx.HTTPError as exc:
            return exc

    def _drive(self, steps: Generator, route: str = "/score", headers: dict | None = None,
               stop: threading.Event | None = None, timeout: Any = httpx.USE_CLIENT_DEFAULT) -> Any:
        self._check_open()
        try:
            step = next(steps)
            while True:
                if stop is not None and stop.is_set():  # the call failed elsewhere: nothing more is sent
                    steps.close()
                    return None
                if isinstance(step, float):
                    if stop is not None:
                        stop.wait(step)
                    else:
                        time.sleep(step)
                    step = steps.send(None)
                    continue
                if isinstance(step, tuple):  # (path, timeout): a GET
                    step = steps.send(self._get(*step))
                    continue
                body, wait_s = (step.body, self._within(step.within_s)) if isinstance(step, Post) else (step, timeout)
                try:
                    with self._http_in_use() as http:
                        outcome: Any = http.post(route, content=body, headers=headers, timeout=wait_s,
                                                 extensions=self._extensions)
                except httpx.RequestError as exc:  # a body it cannot decode too: the exchange judges it
                    outcome = exc
                if stop is not None and stop.is_set():  # the call failed elsewhere: this answer is dropped unjudged
                    steps.close()
                    return None
                step = steps.send(outcome)
        except StopIteration as done:
            return done.value
        except BaseException:
            if stop is not None:  # the other parts stop now, not once the caller's thread wakes to raise
                stop.set()
            raise


async def _closed_with_loop(http: httpx.AsyncClient):
    """Suspended while ``http``'s loop runs, which closes it as it shuts down (asyncio.run's
    ``shutdown_asyncgens``) or once the client holding it is dropped: after the loop has closed,
    nothing can close its sockets, and they warn at collection."""
    try:
        yield
    finally:
        await http.aclose()


class AsyncScoreClient(_Base):
    """The asyncio twin of ScoreClient, with the same arguments and results."""

    _http_class = httpx.AsyncClient
    _direct_class = httpx.AsyncHTTPTransport

    def __init__(self, base_url: str, api_key: str | None = None, **knobs: Any):
        super().__init__(base_url, api_key, **_known(type(self), knobs))

    async def __aenter__(self) -> "AsyncScoreClient":
        self._check_open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    _loop: asyncio.AbstractEventLoop | None = None
    _in_use = 0  # requests on the wire: the connections close once none is

    async def aclose(self) -> None:
        """As ``ScoreClient.close()``: nothing new is sent, a request on the wire (a call in another
        task) ends with its answer, and the connections close after the last one."""
        if not self._closed:
            http = await self._client()
            self._closed = True
            if self._in_use == 0:
                await http.aclose()

    @asynccontextmanager
    async def _http_in_use(self):
        http = await self._client()
        self._in_use += 1
        try:
            yield http
        finally:
            self._in_use -= 1
            if self._closed and self._in_use == 0:
                await http.aclose()

    async def _client(self) -> httpx.AsyncClient:
        """The HTTP client, a new one once the loop it was used on has closed (one ``asyncio.run`` per
        call): its kept-alive connections belong to that loop and fail on this one. Each is closed as
        its loop shuts down or once this client is dropped (``_closed_with_loop``)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is None or self._loop.is_closed():
                if self._loop is not None:
                    self._http = self._http_class(**self._http_kw)
                self._with_loop = _closed_with_loop(self._http)
                await anext(self._with_loop)
            self._loop = loop
            # max_concurrency bounds the client's /score requests, every call's together, as ScoreClient's pool does
            self._gate = asyncio.Semaphore(self._max_concurrency)
            self._readyz: asyncio.Future | None = None  # the GET /readyz for the limits, while one is out
        return self._http

    async def score(
        self,
        sequences: Iterable[Any],
        *,
        temperature: float = 1.0,
        return_entropy: bool = True,
        top_k: int = 0,
        model: str | None = None,
        deadline_ms: int | None = None,
        weights_version: str | None = None,
    ) -> list[ScoredSequence]:
        """``ScoreClient.score``, awaited: the same keyword arguments and the same results."""
        seqs, opts, give_up, deadline = self._plan(sequences, temperature=temperature, return_entropy=return_entropy,
                                                   top_k=top_k, model=model, deadline_ms=deadline_ms,
                                                   weights_version=weights_version)
        await self._client()
        gate = self._gate
        if not self._p.limits_known:  # as ScoreClient._learn_limits: one GET /readyz for the tasks waiting meanwhile,
            if self._readyz is None or self._readyz.done():  # a task of its own: a caller cancelled leaves it to them
                self._readyz = asyncio.ensure_future(self._learn_limits(deadline))
            try:  # deadline_ms bounds this wait too: past it, the exchange raises 504
                await asyncio.wait_for(asyncio.shield(self._readyz), _left_s(deadline))
            except asyncio.TimeoutError:
                pass

        async def send(part: list[int]) -> list[ScoredSequence]:
            try:  # queued behind other calls' requests: the deadline bounds that wait too
                await asyncio.wait_for(gate.acquire(), _left_s(deadline))
            except asyncio.TimeoutError:
                raise _queued_past_deadline() from None
            try:
                return await self._drive(self._p.exchange([seqs[i] for i in part], opts, give_up, part, deadline))
            finally:
                gate.release()

        tasks = [asyncio.ensure_future(send(part)) for part in self._p.chunks(seqs, self._max_concurrency)]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:  # the call failed: its other parts send nothing more
            for task in tasks:
                task.cancel()
            raise
        return [r for part in parts for r in part]

    async def score_padded(self, input_ids: Any, attention_mask: Any, response_mask: Any, *, temperature: float = 1.0,
                           return_entropy: bool = True, model: str | None = None,
                           deadline_ms: int | None = None, weights_version: str | None = None) -> PaddedScores:
        """As ``ScoreClient.score_padded``."""
        batch, kw, end = self._padded_plan(input_ids, attention_mask, response_mask, temperature=temperature,
                                           return_entropy=return_entropy, model=model, deadline_ms=deadline_ms,
                                           weights_version=weights_version)
        try:
            results = (await self.score(batch.sequences, weights_version=weights_version, deadline_ms=deadline_ms, **kw)
                       if batch.sequences else [])
            steps = by_one_version(results, batch.sequences, end)
            ask = next(steps)
            while True:
                if ask[0] == "models":
                    ask = steps.send(await self._models(end))
                    continue
                try:
                    got = await self.score(ask[1], weights_version=ask[2], deadline_ms=ask[3], **kw)
                except ScoreError as error:
                    got = error
                ask = steps.send(got)
        except StopIteration as done:
            return batch.scores(done.value, return_entropy)
        except ScoreError as error:  # the first pass's or a rescoring's: named by the rows' places in the arrays
            raise batch.named_by_place(error) from error

    async def models(self) -> list[dict]:
        """As ``ScoreClient.models``."""
        return await self._models()

    async def _models(self, deadline: float | None = None) -> list[dict]:
        return models_answer(await self._drive(self._p.get_exchange(
            "/v1/models", time.monotonic() + self._p.retry_timeout_s, _DISCOVERY_TIMEOUT_S, deadline)))

    async def ready(self) -> dict:
        """As ``ScoreClient.ready``."""
        answer = readiness_answer(outcome := await self._get("/readyz"))
        self._p.learn_from_readyz(outcome)
        return answer

    async def wait_ready(self, timeout_s: float = 600.0) -> dict:
        """As ``ScoreClient.wait_ready``."""
        return await self._drive(self._p.readiness_wait(timeout_s, _DISCOVERY_TIMEOUT_S))

    async def update_weights(self, model: str | None, path: str, version: str | None = None, *,
                             timeout_s: float | None = None) -> WeightsUpdate:
        """As ``ScoreClient.update_weights``."""
        timeout = self._update_timeout(timeout_s)
        steps = self._p.weights_exchange(model, path, version, time.monotonic() + self._p.retry_timeout_s)
        return await self._drive(steps, "/v1/weights", self._p.weights_headers(), timeout)

    async def update_weights_everywhere(self, model: str | None, path: str, version: str | None = None, *,
                                        max_concurrency: int = everywhere.MAX_CONCURRENCY,
                                        timeout_s: float | None = None) -> dict[str, WeightsUpdate]:
        """As ``ScoreClient.update_weights_everywhere``."""
        self._check_open()
        gate = asyncio.Semaphore(everywhere.concurrency(max_concurrency))
        wait_s = self._update_timeout(timeout_s).read
        found = await asyncio.to_thread(everywhere.addresses, self._p.base_url)
        request_id = everywhere.new_request_id()

        async def one(address: str) -> WeightsUpdate | ScoreError:
            async with gate:  # a client (and its connection) for max_concurrency addresses at a time
                try:
                    pod = self._at(address, request_id)
                except (ValueError, httpx.InvalidURL) as exc:  # no URL can hold this address: its failure alone
                    return everywhere.named(address, exc, request_id)
                async with pod:
                    try:
                        return await pod.update_weights(model, path, version, timeout_s=wait_s)
                    except ScoreError as error:
                        return error

        results = await asyncio.gather(*(one(a) for a in found))
        return everywhere.outcome(self._p.base_url, dict(zip(found, results)), request_id)

    async def _learn_limits(self, deadline: float | None = None) -> None:
        if (wait_s := _discovery_s(deadline)) > 0:
            self._p.learn_from_readyz(await self._get("/readyz", wait_s))

    async def _get(self, path: str, timeout_s: float = _DISCOVERY_TIMEOUT_S) -> httpx.Response | Exception:
        try:
            async with self._http_in_use() as http:
                return await http.get(path, timeout=timeout_s, extensions=self._extensions)
        except httpx.HTTPError as exc:
            return exc

    async def _drive(self, steps: Generator, route: str = "/score", headers: dict | None = None,
                     timeout: Any = httpx.USE_CLIENT_DEFAULT) -> Any:
        self._check_open()
        try:
            step = next(steps)
            while True:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                    step = steps.send(None)
                    continue
                if isinstance(step, tuple):  # (path, timeout): a GET
                    step = steps.send(await self._get(*step))
                    continue
                body, wait_s = (step.body, self._within(step.within_s)) if isinstance(step, Post) else (step, timeout)
                try:
                    async with self._http_in_use() as http:
                        outcome: Any = await http.post(route, content=body, headers=headers, timeout=wait_s,
                                                       extensions=self._extensions)
                except httpx.RequestError as exc:  # a body it cannot decode too: the exchange judges it
                    outcome = exc
                step = steps.send(outcome)
        except StopIteration as done:
            return done.value

