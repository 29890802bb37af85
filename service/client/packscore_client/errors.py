"""The error every failed call raises, and how it is read from the server's answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import msgpack

if TYPE_CHECKING:
    from packscore_client.protocol import WeightsUpdate


class ScoreError(Exception):
    """The server refused or failed a request, or could not be reached (status 0, type
    ``connection_error``); the fields are the contract's error body. ``request_id`` is the
    ``X-Request-Id`` of the answer that failed the call (the server's log lines for that request
    name it), None where no answer came; a call split into several requests names the one whose
    answer failed it."""

    def __init__(self, status: int, type: str, message: str, param: str | None = None, request_id: str | None = None):
        self.status, self.type, self.message, self.param = status, type, message, param
        self.request_id = request_id
        super().__init__(self.text() + (f" (request_id: {request_id})" if request_id else ""))

    def text(self) -> str:
        """``str(error)`` without its request id (where an enclosing error names that id once)."""
        return f"{self.status} {self.type}: {self.message}" + (f" (param: {self.param})" if self.param else "")

    def __reduce__(self):
        # Rebuilt from its fields, not from ``args`` (the formatted text): so it pickles, as a process
        # pool or a distributed trainer's workers hand a failed call's error back.
        return type(self), (self.status, self.type, self.message, self.param, self.request_id)

    def renamed(self, message: str, param: str | None) -> "ScoreError":
        """The same error of the same answer, its message and param in the caller's terms."""
        return ScoreError(self.status, self.type, message, param, self.request_id)


class UpdateEverywhereError(ScoreError):
    """``update_weights_everywhere`` did not leave every address serving one new version: ``updated``
    maps each address that took the update to its answer, ``failed`` each other one to its
    ScoreError (type ``update_incomplete``, the status of the first failure); every address took
    it but they serve different versions: type ``weights_version_differs``, 409, ``failed`` empty.
    ``request_id`` is the one ``X-Request-Id`` the call sent to every address, which each pod's log
    lines for the update name; every error in ``failed`` and answer in ``updated`` carries it too."""

    def __init__(self, status: int, type: str, message: str, updated: dict[str, "WeightsUpdate"],
                 failed: dict[str, ScoreError], request_id: str | None = None):
        super().__init__(status, type, message, request_id=request_id)
        self.updated, self.failed = updated, failed

    def __reduce__(self):
        return type(self), (self.status, self.type, self.message, self.updated, self.failed, self.request_id)


def response_error(response: httpx.Response) -> ScoreError:
    """The error of an answer other than 200: the contract's body, else its status and text (a proxy's page)."""
    request_id = response.headers.get("x-request-id")
    try:
        e = response.json()["error"]
        return ScoreError(response.status_code, e["type"], e["message"], e.get("param"), request_id)
    except Exception:
        return ScoreError(response.status_code, "http_error", response.text[:200] or response.reason_phrase, request_id=request_id)


# What reading an answer that is not the contract's raises (JSON, msgpack, a missing field, a wrong shape)
NOT_THE_CONTRACT = (ValueError, KeyError, TypeError, IndexError, AttributeError, msgpack.exceptions.UnpackException)


def not_packscore(response: httpx.Response, route: str, exc: Exception, consequence: str = "") -> ScoreError:
    """The error of a 200 whose body is not the contract's answer (a proxy's or another server's page)."""
    return ScoreError(response.status_code, "invalid_response", f"{route} was answered {response.status_code} with "
                      f"a body that is not packscore's ({describe(exc)}){consequence}",
                      request_id=response.headers.get("x-request-id"))


def describe(exc: BaseException) -> str:
    """``exc`` for a message: its type, and its text where it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# A gateway's answers for a server behind it that it could not reach or that did not answer
GATEWAY_STATUSES = (502, 504)


def gateway_error(response: httpx.Response) -> ScoreError | None:
    """The error of a 502 or 504 that is not the server's JSON (the server's own 504 is
    ``deadline_exceeded``): a gateway's page; else None."""
    if response.status_code not in GATEWAY_STATUSES:
        return None
    error = response_error(response)
    return error if error.type == "http_error" else None
