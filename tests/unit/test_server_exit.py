"""What ``run_server`` leaves to the interpreter's exit once uvicorn has returned."""

import gc

from service.http import server
from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend


def test_the_served_heap_is_frozen_before_the_interpreter_s_last_collections(monkeypatch):
    """Those collections walk every object the model and its libraries made, the longest part of a
    real model's exit; frozen objects are not walked (nothing in them is left to write)."""
    monkeypatch.setattr(server.DrainingServer, "run", lambda self, sockets=None: None)  # served and drained
    settings = Settings(host="127.0.0.1", port=1)
    try:
        assert server.run_server(create_app(settings, FakeBackend()), settings) == 0
        assert gc.get_freeze_count() > 0, "the heap was left for the interpreter's exit to walk"
    finally:
        gc.unfreeze()  # the rest of this test process collects as before
