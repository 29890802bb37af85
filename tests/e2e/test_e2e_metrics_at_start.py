"""Series a real server exports at 0 before their first event (``rate()`` and ``increase()`` miss the
first event of a series that appears with it): a model's scoring series from when it is loaded, not
from its warm-up, and every weight-update outcome."""

from __future__ import annotations

import json
import time

import httpx

from service.http.metrics import UNNAMED_UPDATE_OUTCOMES, UPDATE_OUTCOMES
from service.local_server import LocalServer
from tests.e2e.helpers import fake_server
from tests.live_metrics import Scrape

SCORING_SERIES = ("packscore_tokens_scored_total", "packscore_prefix_tokens_saved_total",
                  "packscore_queue_wait_seconds_count", "packscore_forward_seconds_count",
                  "packscore_batch_tokens_count", "packscore_batch_fill_ratio_count")


def _scrape(server: LocalServer) -> Scrape:
    answer = httpx.get(server.url + "/metrics", timeout=30)
    assert answer.status_code == 200, answer.text
    return Scrape(answer.text)


def test_a_model_awaiting_weights_has_its_scoring_and_update_series_at_zero(tmp_path):
    """Its recorded checkpoint is gone: the server waits for an update, never warms up, and a
    dashboard or rate() must still find the model's series (and every outcome of its update)."""
    (tmp_path / "root").mkdir()
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"format": 1, "models": {"fake-model": {
        "model": "tiny", "path": "gone", "version": "v-gone", "files": []}}}))
    server = fake_server(tmp_path, "--weights-root", str(tmp_path / "root"), "--weights-record", str(record))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.proc.poll() is None, server.log()
            try:
                if httpx.get(server.url + "/readyz", timeout=5).json().get("status") == "awaiting_weights":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, f"/readyz never said awaiting_weights:\n{server.log()}"
            time.sleep(0.1)
        at_start = _scrape(server)
    finally:
        server.stop()
    assert at_start.value("packscore_weights_awaited", model="fake-model") == 1.0, at_start.text
    absent = [name for name in SCORING_SERIES if at_start.value(name, model="fake-model") != 0.0]
    assert not absent, f"not at 0 for a loaded model before its warm-up: {absent}"
    absent = [o for o in UPDATE_OUTCOMES if at_start.value("packscore_weights_updates_total", model="fake-model",
                                                           outcome=o) != 0.0]
    absent += [f'model="" {o}' for o in UNNAMED_UPDATE_OUTCOMES
               if at_start.value("packscore_weights_updates_total", model="", outcome=o) != 0.0]
    assert not absent, f"weight-update outcomes not at 0 from the start: {absent}"
