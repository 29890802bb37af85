"""``packscore serve`` with FakeBackend in place of a model, for end-to-end tests that need a
slow forward; the real app, uvicorn and protocol otherwise.

    python -m tests.e2e.fake_server serve [serve options]    # FAKE_SECONDS_PER_TOKEN=0.01 slows forwards

``FAKE_LOAD_SECONDS=2`` makes every weight update (POST /v1/weights) load for that long before its swap.

With ``FAKE_BUGS=1``, POST /score with ``X-Fake-Bug: before-answer`` raises an unhandled error before
its answer starts, and with ``X-Fake-Bug: mid-answer`` after its first bytes: a bug, as the server meets one.
"""

from __future__ import annotations

import os
import sys
import time

from starlette.responses import StreamingResponse

import service.http.app
from service.cli import parse_settings
from service.http.app import create_app
from service.http.request_id import configure_logging
from service.http.server import run_server
from service.testing import FakeBackend


def _with_bugs() -> None:
    """The score route raises where a request asks for it (``X-Fake-Bug``)."""
    score_request = service.http.app.score_request

    async def buggy(request, service):
        bug = request.headers.get("x-fake-bug")
        if bug == "before-answer":
            raise RuntimeError("a fake bug before the answer")
        if bug == "mid-answer":
            async def body():
                yield b'{"results": ['
                raise RuntimeError("a fake bug in the middle of the answer")

            return StreamingResponse(body(), media_type="application/json")
        return await score_request(request, service)

    service.http.app.score_request = buggy


def main() -> int:
    _, settings = parse_settings(sys.argv[1:])
    configure_logging(settings.log_level)
    if os.environ.get("FAKE_BUGS") == "1":
        _with_bugs()
    load_s = float(os.environ.get("FAKE_LOAD_SECONDS", "0"))
    backend = FakeBackend(seconds_per_token=float(os.environ.get("FAKE_SECONDS_PER_TOKEN", "0")),
                          check_checkpoint=(lambda path: time.sleep(load_s)) if load_s else None)
    return run_server(create_app(settings, backend), settings)


if __name__ == "__main__":
    sys.exit(main())
