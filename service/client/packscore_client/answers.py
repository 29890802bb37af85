"""Reading the answers of the GET routes a client polls: ``/v1/models`` and ``/readyz``."""

from __future__ import annotations

import httpx

from packscore_client.errors import GATEWAY_STATUSES, NOT_THE_CONTRACT, ScoreError, describe, not_packscore, response_error

# /readyz answers of a server on its way up (503), or of a gateway in front of one not up yet
NOT_READY_STATUSES = (503, *GATEWAY_STATUSES)
# Readiness the server does not leave by itself: waiting longer cannot help
GIVEN_UP = ("failed", "restart_failed")


def models_answer(outcome: httpx.Response | Exception) -> list[dict]:
    """``GET /v1/models``' list of served models, from its response or the error that replaced it."""
    if isinstance(outcome, Exception):
        raise ScoreError(0, "connection_error", f"GET /v1/models failed: {describe(outcome)}") from outcome
    if outcome.status_code != 200:
        raise response_error(outcome)
    try:
        data = outcome.json()["data"]
        if isinstance(data, list):
            return data
        raise TypeError(f"data is a {type(data).__name__}, not a list")
    except NOT_THE_CONTRACT as exc:
        raise not_packscore(outcome, "GET /v1/models", exc) from exc


def readiness_answer(outcome: httpx.Response | Exception) -> dict:
    """``GET /readyz``'s body, ready or not: ``status`` is ``"ready"`` or the reason it is not
    (``http_<code>`` for an answer that is not the server's JSON, a proxy's page, say)."""
    if isinstance(outcome, Exception):
        raise ScoreError(0, "connection_error", f"GET /readyz failed: {describe(outcome)}") from outcome
    if outcome.status_code != 200 and outcome.status_code not in NOT_READY_STATUSES:
        raise response_error(outcome)
    try:
        body = outcome.json()
    except ValueError:
        body = None
    return body if isinstance(body, dict) and "status" in body else {"status": f"http_{outcome.status_code}"}
