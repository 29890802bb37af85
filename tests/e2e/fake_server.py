"""``packscore serve`` with FakeBackend in place of a model, for end-to-end tests that need a
slow forward; the real app, uvicorn and protocol otherwise.

    python -m tests.e2e.fake_server serve [serve options]    # FAKE_SECONDS_PER_TOKEN=0.01 slows forwards
"""

from __future__ import annotations

import os
import sys

from service.cli import parse_settings
from service.http.app import create_app
from service.http.request_id import configure_logging
from service.http.server import run_server
from service.testing import FakeBackend


def main() -> int:
    _, settings = parse_settings(sys.argv[1:])
    configure_logging(settings.log_level)
    backend = FakeBackend(seconds_per_token=float(os.environ.get("FAKE_SECONDS_PER_TOKEN", "0")))
    return run_server(create_app(settings, backend), settings)


if __name__ == "__main__":
    sys.exit(main())
