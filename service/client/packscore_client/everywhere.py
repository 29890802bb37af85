"""One weight update sent to every address a host name resolves to: the pods behind a headless
Service (the Helm chart's ``<fullname>-pods``), each of which serves only the updates it receives.

The clients' ``update_weights_everywhere`` resolve the name (A and AAAA), post the update to each
address in parallel (``MAX_CONCURRENCY`` at a time unless told otherwise) with ``update_weights``' own
retries, all under one ``X-Request-Id``, and return
``{address: WeightsUpdate}``; any failure, or pods left serving different versions, raises
``UpdateEverywhereError``."""

from __future__ import annotations

import dataclasses
import numbers
import socket
import uuid

import httpx

from packscore_client.errors import ScoreError, UpdateEverywhereError
from packscore_client.protocol import WeightsUpdate


# Addresses updated at a time: one thread (or task) and connection each, whatever a Service's size.
MAX_CONCURRENCY = 32


def concurrency(max_concurrency: int) -> int:
    """``max_concurrency`` checked: an int of at least 1."""
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, numbers.Integral) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an int of at least 1, got {max_concurrency!r}")
    return int(max_concurrency)  # a numpy int too, as the clients' own knob


def addresses(base_url: str) -> list[str]:
    """Every distinct IPv4 and IPv6 address ``base_url``'s host resolves to, in resolution order; a
    link-local IPv6 one with its zone (``fe80::1%eth0``), without which it cannot be connected to."""
    url = httpx.URL(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ScoreError(0, "connection_error", f"could not resolve {url.host!r} to the addresses of its pods: {exc}") from exc
    found = list(dict.fromkeys(_with_zone(info[4]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)))
    if not found:
        raise ScoreError(0, "connection_error", f"{url.host!r} resolves to no IPv4 or IPv6 address")
    return found


def _with_zone(sockaddr: tuple) -> str:
    """The address of a ``getaddrinfo`` sockaddr; an IPv6 one's scope id, which the string leaves out,
    as its zone: the interface's name where it has one (httpx hands ``fe80::1%eth0`` to the resolver as is)."""
    address = str(sockaddr[0])
    scope = sockaddr[3] if len(sockaddr) == 4 else 0
    if not scope or "%" in address:
        return address
    try:
        return f"{address}%{socket.if_indextoname(scope)}"
    except (OSError, AttributeError):  # no such interface here, or a platform without the call
        return f"{address}%{scope}"


def at_address(base_url: str, address: str) -> tuple[str, str, str]:
    """``base_url`` with its host replaced by ``address``; the Host header (the name and any port)
    and the TLS server name (the name) that keep the request what it was sent to the name."""
    url = httpx.URL(base_url)
    return str(url.copy_with(host=address)), url.netloc.decode("ascii"), url.host


def new_request_id() -> str:
    """One call's ``X-Request-Id``, shaped as the server's own (32 hex digits), which it keeps."""
    return uuid.uuid4().hex


class Borrowed(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """The caller's ``transport=`` as a per-address client uses it: its requests go through it, and
    closing that client leaves it open, to the caller's client and its requests on the wire."""

    def __init__(self, transport: httpx.BaseTransport | httpx.AsyncBaseTransport):
        self._transport = transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._transport.handle_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transport.handle_async_request(request)

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def named(address: str, exc: Exception, request_id: str) -> ScoreError:
    """The failure of an address that could not be sent to at all (a zone or address httpx refuses)."""
    return ScoreError(0, "connection_error", f"could not send the update to {address!r}: "
                      f"{type(exc).__name__}: {exc}", request_id=request_id)


def with_id(result: WeightsUpdate | ScoreError, request_id: str) -> WeightsUpdate | ScoreError:
    """``result`` naming the call's request id where its answer did not (none came, or a proxy's page)."""
    if result.request_id is not None:
        return result
    if isinstance(result, WeightsUpdate):
        return dataclasses.replace(result, request_id=request_id)
    return ScoreError(result.status, result.type, result.message, result.param, request_id)


def outcome(base_url: str, results: dict[str, WeightsUpdate | ScoreError], request_id: str) -> dict[str, WeightsUpdate]:
    """``{address: WeightsUpdate}`` when every address serves the update under one version; else
    ``UpdateEverywhereError`` naming each failed address and why, and which ones serve what."""
    results = {a: with_id(r, request_id) for a, r in results.items()}
    updated = {a: r for a, r in results.items() if isinstance(r, WeightsUpdate)}
    failed = {a: r for a, r in results.items() if isinstance(r, ScoreError)}
    host = httpx.URL(base_url).host
    serving = "; ".join(f"{a} serves {u.weights_version!r}" for a, u in updated.items()) or "none updated"
    if failed:
        # each failure's own id only where it differs from the call's, which the error names once
        why = "; ".join(f"{a}: {e.text() if e.request_id == request_id else e}" for a, e in failed.items())
        first = next(iter(failed.values()))
        raise UpdateEverywhereError(first.status, "update_incomplete",
                                    f"the weight update failed on {len(failed)} of {len(results)} addresses of "
                                    f"{host!r}: {why} (updated: {serving}); the others keep their old version",
                                    updated, failed, request_id)
    if len({u.weights_version for u in updated.values()}) > 1:
        raise UpdateEverywhereError(409, "weights_version_differs",
                                    f"every address of {host!r} took the update, but they serve different versions "
                                    f"({serving}): the pods hold different files at that path; name a version or "
                                    "check the checkpoint volume", updated, {}, request_id)
    return updated
