"""A call the server throttles (429 queue_full, an update's 409 update_in_progress) is waited out with
an INFO line on the ``packscore_client`` logger for each retry, against a real server: a trainer whose
calls slow down sees why in its log."""

from __future__ import annotations

import logging
import re
import time

import pytest

from packscore_client import ScoreClient, ScoreError
from tests.e2e.helpers import fake_server, post_in_background, queued_sequences

QUEUED = 100  # --max-queued-tokens: one request of as many tokens fills the queue
SECONDS_PER_TOKEN = 0.02  # its forward: 2 s, for a call made meanwhile to meet its 429s
LOAD_S = 1.5  # each weight update's load


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("throttled")
    (root / "step-1").mkdir()  # FakeBackend takes any directory as a checkpoint
    server = fake_server(root, "--max-queued-tokens", str(QUEUED), "--max-admission-wait-s", "0",
                         "--weights-root", str(root),
                         env={"FAKE_SECONDS_PER_TOKEN": str(SECONDS_PER_TOKEN), "FAKE_LOAD_SECONDS": str(LOAD_S)})
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _retries(caplog, said: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "packscore_client" and said in r.getMessage()]


def test_each_429_waited_out_is_an_info_line_naming_the_status_the_request_and_the_wait(server, caplog):
    sender, answers = post_in_background(server.url, {"sequences": [{"input_ids": list(range(1, QUEUED + 1))}]})
    end = time.monotonic() + 30
    while queued_sequences(server.url) < 1:  # admitted: the queue is full until its forward ends
        assert time.monotonic() < end and not answers, answers
        time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="packscore_client"), ScoreClient(server.url) as client:
        assert len(client.score([[1, 2, 3]])) == 1
    sender.join(timeout=30)
    assert answers["answer"].status_code == 200, answers["answer"].text
    lines = _retries(caplog, "answered 429 queue_full")
    assert lines, [r.getMessage() for r in caplog.records]
    said = re.compile(rf"packscore: POST /score to {re.escape(server.url)} answered 429 queue_full, retrying in "
                      r"\d+\.\ds \(retry (\d+), request_id [0-9a-f]{32}; gives up 300s after the call started: "
                      r"retry_timeout_s\): The admission queue is full \(")
    for n, record in enumerate(lines, 1):  # one line a retry, numbered
        assert record.levelno == logging.INFO, record.getMessage()
        match = said.match(record.getMessage())
        assert match and match.group(1) == str(n), record.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


def test_an_update_waiting_for_another_to_load_says_so_at_info(server, caplog):
    with ScoreClient(server.url, update_timeout_s=0.3) as impatient, ScoreClient(server.url) as client:
        with pytest.raises(ScoreError, match="may have run"):  # gave up on its answer: the load goes on
            impatient.update_weights(None, "step-1", version="v-1")
        with caplog.at_level(logging.INFO, logger="packscore_client"):
            assert client.update_weights(None, "step-1", version="v-1").weights_version == "v-1"
    lines = _retries(caplog, "answered 409 update_in_progress")
    assert lines, [r.getMessage() for r in caplog.records]
    message = lines[0].getMessage()
    assert lines[0].levelno == logging.INFO, message
    assert message.startswith(f"packscore: POST /v1/weights to {server.url} answered 409 update_in_progress, "
                              "retrying in "), message
    assert "(retry 1, request_id " in message and message.endswith("retry once it is done."), message
