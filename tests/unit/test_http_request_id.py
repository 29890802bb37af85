"""Request ids in the app: the rule for an incoming ``X-Request-Id``, the 500 of an unhandled error,
and the log lines written for a request (service/http/request_id.py)."""

import asyncio
import logging

import httpx
import pytest

from service.http import request_id
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

BASE = "http://packscore.test"


@pytest.mark.parametrize("given, kept", [
    (b"abc", True), (b"!", True), (b"~" * 128, True), (b"trainer-7/step:3,{x}", True),
    (b"", False), (b"a" * 129, False), (b"has space", False), (b"tab\tin", False), (b"caf\xc3\xa9", False),
    (b"del\x7f", False),
], ids=lambda v: v if isinstance(v, bool) else repr(v[:20]))
def test_an_incoming_id_is_kept_only_when_it_is_1_to_128_visible_ascii_characters(given, kept):
    got = request_id.from_headers([(b"accept", b"*/*"), (b"x-request-id", given), (b"x-request-id", b"second")])
    if kept:
        assert got == given.decode(), got
    else:
        assert len(got) == 32 and int(got, 16) >= 0 and got.encode() != given, got
    assert len(request_id.from_headers([])) == 32


class _Lines(logging.Handler):
    """The log lines as the server writes them (LOG_FORMAT, each naming its request)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.addFilter(request_id.RequestIdFilter())
        self.setFormatter(logging.Formatter(request_id.LOG_FORMAT))
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))

    def __enter__(self):
        root = logging.getLogger()
        self.level_was = root.level
        root.addHandler(self)
        root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)
        logging.getLogger().setLevel(self.level_was)


def _named(lines: list[str], text: str, rid: str) -> bool:
    return any(text in line and f"request_id={rid}" in line for line in lines)


def test_an_unhandled_error_is_a_json_500_with_the_id_and_its_traceback_names_it(monkeypatch):
    async def broken(request, service):
        raise RuntimeError("a bug")

    monkeypatch.setattr("service.http.app.score_request", broken)

    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:
                return await client.post("/score", json={"sequences": [{"input_ids": [1, 2]}]},
                                         headers={"X-Request-Id": "bug-1"})

    with _Lines() as log:
        answer = asyncio.run(main())
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "internal_error", answer.text
    assert answer.headers["x-request-id"] == "bug-1"
    assert _named(log.lines, "unhandled error on POST /score", "bug-1"), log.lines
    assert any("RuntimeError: a bug" in line for line in log.lines), log.lines


def test_the_non_finite_warning_and_a_sequences_scheduler_warning_name_their_request(monkeypatch):
    monkeypatch.setattr("service.http.scoring.non_finite_score", lambda scores: "logprobs[0]")

    async def main():
        app = create_app(Settings(max_batch_tokens=64), FakeBackend(oom_above_tokens=20))
        async with running_app(app) as client:
            nan = await client.post("/score", json={"sequences": [{"input_ids": [1, 2]}]}, headers={"X-Request-Id": "nan-1"})
            big = await client.post("/score", json={"sequences": [{"input_ids": [1] * 30}]}, headers={"X-Request-Id": "oom-1"})
            return nan, big

    with _Lines() as log:
        nan, big = asyncio.run(main())
    assert (nan.status_code, nan.headers["x-request-id"]) == (422, "nan-1"), nan.text
    assert (big.status_code, big.headers["x-request-id"]) == (413, "oom-1"), big.text
    assert _named(log.lines, "with non-finite numbers at logprobs[0]", "nan-1"), log.lines
    # written by the scheduler's task, outside the request's: named through its ticket
    assert _named(log.lines, "does not fit in memory alone", "oom-1"), log.lines
    # lines that are no request's name none
    started = [line for line in log.lines if "ready: serving" in line]
    assert started and not any("request_id=" in line for line in started), log.lines


def test_a_line_about_a_whole_row_names_every_request_in_it():
    # A row's failure answers each of its requests (503 here): the operator greps any of their ids.
    backend = FakeBackend()

    async def main():
        app = create_app(Settings(max_wait_ms=200), backend)
        async with running_app(app) as client:
            backend.unavailable = True
            return await asyncio.gather(*(
                client.post("/score", json={"sequences": [{"input_ids": [1, 2, 3]}]}, headers={"X-Request-Id": f"row-{i}"})
                for i in range(3)))

    with _Lines() as log:
        answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [503] * 3, [a.text for a in answers]
    lines = [line for line in log.lines if "backend unavailable for a row" in line]
    assert lines and all(any(f"row-{i}" in line for line in lines) for i in range(3)), log.lines


def test_many_ids_are_listed_up_to_a_bound():
    assert request_id.of_many(["a", None, "b", "a"]) == "a, b"
    assert request_id.of_many([str(i) for i in range(11)], most=8) == "0, 1, 2, 3, 4, 5, 6, 7 and 3 more"


def test_a_row_line_names_the_readiness_pass_not_an_empty_list():
    """A worker lost under the readiness pass's row logged 'backend unavailable for a row of 1 sequence
    (requests ): ...': the pass has no request id."""
    from types import SimpleNamespace

    from service.scheduling.forward_failures import row_requests

    def item(rid, probe=False):
        return SimpleNamespace(ticket=SimpleNamespace(request_id=rid, probe=probe))

    assert row_requests([item(None, probe=True)]) == "the readiness pass"
    assert row_requests([item("a"), item(None, probe=True), item("b")]) == "requests a, b and the readiness pass"
    assert row_requests([item("a"), item("a")]) == "requests a"
    assert row_requests([item(None)]) == "no request id"  # offline scoring's rows


def test_the_readiness_pass_a_readyz_starts_names_no_request():
    # The pass is shared by every /readyz that joins it and runs on after the one that started it.
    backend = FakeBackend()

    async def main():
        app = create_app(Settings(), backend)
        async with running_app(app) as client:
            backend.unavailable = True
            app.state.service._probe_ok = False  # the last proof is stale: /readyz runs a pass
            return await client.get("/readyz", headers={"X-Request-Id": "probe-asker"})

    with _Lines() as log:
        answer = asyncio.run(main())
    assert answer.status_code == 503 and answer.headers["x-request-id"] == "probe-asker", answer.text
    failed = [line for line in log.lines if "readiness pass of" in line or "for a row" in line]
    assert failed and not any("probe-asker" in line for line in failed), log.lines


def test_a_sigterm_handled_while_a_request_runs_drains_under_no_request_id(monkeypatch):
    # Python runs a signal handler in whatever task the main thread was running: a busy request's context.
    import signal

    from service.http.server import DrainingServer, uvicorn_config

    monkeypatch.setattr("service.http.server._exit_now", lambda status: None)  # the exit timer must not end pytest

    async def main():
        settings = Settings(drain_timeout_s=1)
        app = create_app(settings, FakeBackend())
        async with running_app(app):
            server = DrainingServer(uvicorn_config(app, settings), app.state.service)
            server._loop = asyncio.get_running_loop()
            token = request_id.current.set("busy-1")
            server.handle_exit(signal.SIGTERM, None)
            request_id.current.reset(token)
            while server._drain is None:
                await asyncio.sleep(0.01)
            await server._drain

    with _Lines() as log:
        asyncio.run(main())
    draining = [line for line in log.lines if "draining:" in line]
    assert draining and not any("request_id=" in line for line in draining), log.lines


def test_an_in_process_caller_gets_its_own_id_back_after_a_request():
    # httpx's ASGITransport runs the app in the caller's task: the request's id must not stay set there.
    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            seen = [request_id.current.get()]
            await client.post("/score", json={"sequences": [{"input_ids": [1, 2]}]}, headers={"X-Request-Id": "in-1"})
            seen.append(request_id.current.get())
            token = request_id.current.set("caller-1")  # a caller that is itself a request's work
            await client.get("/nowhere", headers={"X-Request-Id": "in-2"})
            seen.append(request_id.current.get())
            request_id.current.reset(token)
            return seen

    assert asyncio.run(main()) == [None, None, "caller-1"]


def test_uvicorns_line_about_a_cancelled_request_names_it_after_the_id_was_reset(monkeypatch):
    # uvicorn logs what left the app (a cancellation at shutdown) once the gate has reset the id.
    async def cancelled(request, service):
        raise asyncio.CancelledError()

    monkeypatch.setattr("service.http.app.score_request", cancelled)

    async def main():
        app = create_app(Settings(), FakeBackend())
        async with running_app(app) as client:
            try:
                await client.post("/score", json={"sequences": [{"input_ids": [1, 2]}]}, headers={"X-Request-Id": "cut-1"})
            except asyncio.CancelledError as exc:
                return exc, request_id.current.get()

    left, current = asyncio.run(main())
    with _Lines() as log:
        logging.getLogger(__name__).error("Exception in ASGI application", exc_info=left)  # as uvicorn.error does
    assert current is None and _named(log.lines, "Exception in ASGI application", "cut-1"), (current, log.lines)
