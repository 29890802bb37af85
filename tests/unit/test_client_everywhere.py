"""``update_weights_everywhere``: one weight update sent to every address of a name (the pods of a
headless Service), each answer kept, any failure or any version mismatch raised naming the addresses."""

import asyncio
import http.server
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
import threading

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError, UpdateEverywhereError
from packscore_client.everywhere import addresses

NAME = "scorer-pods.rl.svc"
REAL_GETADDRINFO = socket.getaddrinfo


def _resolving(monkeypatch, *ips: str) -> None:
    """``NAME`` resolves to ``ips`` (each once per socket type, as a resolver answers); other names as usual."""
    def fake(host, port, *args, **kw):
        if host != NAME:
            return REAL_GETADDRINFO(host, port, *args, **kw)
        out = []
        for ip in ips:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            sockaddr = (ip, port, 0, 0) if family == socket.AF_INET6 else (ip, port)
            out += [(family, socket.SOCK_STREAM, 6, "", sockaddr), (family, socket.SOCK_DGRAM, 17, "", sockaddr)]
        return out
    monkeypatch.setattr(socket, "getaddrinfo", fake)


class Pods:
    """A MockTransport of several pods, by address: each answers /v1/weights as the server does."""

    def __init__(self, answers: dict[str, tuple[int, dict]]):
        self.answers, self.seen = answers, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.host, request.headers["host"], request.extensions.get("sni_hostname"),
                          request.headers.get("authorization"), json.loads(request.content)))
        status, body = self.answers[request.url.host]
        return httpx.Response(status, json=body)


def ok(version: str) -> tuple[int, dict]:
    return 200, {"model": "policy", "weights_version": version, "previous_version": "v0", "load_s": 0.1, "swap_ms": 1.0}


REFUSED = (422, {"error": {"type": "invalid_value", "message": "path is no directory", "param": "path"}})


def test_every_address_gets_the_update_once_with_the_names_host_and_tls_name(monkeypatch):
    _resolving(monkeypatch, "10.0.0.7", "10.0.0.8", "10.0.0.7", "fd00::9")
    pods = Pods({"10.0.0.7": ok("step-1"), "10.0.0.8": ok("step-1"), "fd00::9": ok("step-1")})
    with ScoreClient(f"https://{NAME}:8000", admin_key="adm", transport=httpx.MockTransport(pods)) as client:
        got = client.update_weights_everywhere("policy", "step-000001", version="step-1")
    assert list(got) == ["10.0.0.7", "10.0.0.8", "fd00::9"]  # resolution order, each address once
    assert {u.weights_version for u in got.values()} == {"step-1"}
    assert sorted(h for h, *_ in pods.seen) == ["10.0.0.7", "10.0.0.8", "fd00::9"]
    for _, host, sni, auth, body in pods.seen:
        assert (host, sni, auth) == (f"{NAME}:8000", NAME, "Bearer adm")
        assert body == {"model": "policy", "path": "step-000001", "version": "step-1"}


def test_a_failed_address_is_named_with_why_and_the_successes_are_kept(monkeypatch):
    _resolving(monkeypatch, "10.0.0.7", "10.0.0.8")
    pods = Pods({"10.0.0.7": ok("step-2"), "10.0.0.8": REFUSED})
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods)) as client:
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere("policy", "step-000002", version="step-2")
    e = caught.value
    assert isinstance(e, ScoreError) and (e.status, e.type) == (422, "update_incomplete")
    assert list(e.updated) == ["10.0.0.7"] and e.updated["10.0.0.7"].weights_version == "step-2"
    assert list(e.failed) == ["10.0.0.8"] and e.failed["10.0.0.8"].type == "invalid_value"
    assert "10.0.0.8: 422 invalid_value: path is no directory" in str(e), e
    assert "10.0.0.7 serves 'step-2'" in str(e), e


def test_addresses_left_on_different_versions_are_an_error(monkeypatch):
    _resolving(monkeypatch, "10.0.0.7", "10.0.0.8")
    pods = Pods({"10.0.0.7": ok("xxh3-aaaaaaaaaaaa"), "10.0.0.8": ok("xxh3-bbbbbbbbbbbb")})
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods)) as client:
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere("policy", "step-000003")
    e = caught.value
    assert (e.status, e.type, e.failed) == (409, "weights_version_differs", {}), e
    assert set(e.updated) == {"10.0.0.7", "10.0.0.8"}
    assert "different versions" in str(e) and "xxh3-bbbbbbbbbbbb" in str(e), e


def test_the_async_twin_does_the_same(monkeypatch):
    _resolving(monkeypatch, "10.0.0.7", "10.0.0.8")
    pods = Echoing({"10.0.0.7": ok("step-1"), "10.0.0.8": REFUSED})

    async def main():
        async with AsyncScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods)) as client:
            with pytest.raises(UpdateEverywhereError) as caught:
                await client.update_weights_everywhere("policy", "step-000001", version="step-1")
            first_ids = list(pods.ids)
            pods.answers["10.0.0.8"] = ok("step-1")
            return caught.value, first_ids, await client.update_weights_everywhere("policy", "step-000001",
                                                                                   version="step-1")

    e, first_ids, got = asyncio.run(main())
    assert list(e.failed) == ["10.0.0.8"] and list(e.updated) == ["10.0.0.7"]
    # one request id for every address, as the sync client sends
    assert len(first_ids) == 2 and set(first_ids) == {e.request_id} and e.request_id is not None, (first_ids, e)
    assert e.failed["10.0.0.8"].request_id == e.updated["10.0.0.7"].request_id == e.request_id
    assert {a: u.weights_version for a, u in got.items()} == {"10.0.0.7": "step-1", "10.0.0.8": "step-1"}
    assert all(sni is None and host == f"{NAME}:8000" for _, host, sni, *_ in pods.seen)  # plain HTTP: no TLS name


def test_a_name_that_does_not_resolve_is_a_connection_error(monkeypatch):
    def fail(*args, **kw):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(ScoreError) as caught:
        addresses(f"http://{NAME}:8000")
    assert (caught.value.status, caught.value.type) == (0, "connection_error") and NAME in str(caught.value)


class _WeightsHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        body = json.dumps(ok("step-1")[1]).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_checks_each_address_against_the_names_certificate(monkeypatch, tmp_path):
    """Connecting to the address, the TLS server name stays the URL's name, so its certificate verifies."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", f"/CN={NAME}", "-addext", f"subjectAltName=DNS:{NAME}"],
                   check=True, capture_output=True, timeout=60)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WeightsHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx trusts it as the CA
    _resolving(monkeypatch, "127.0.0.1")
    try:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # the address alone fails the check
            httpx.post(f"https://127.0.0.1:{port}/v1/weights", content=b"{}")
        with ScoreClient(f"https://{NAME}:{port}") as client:
            got = client.update_weights_everywhere("policy", "step-000001", version="step-1")
        assert {a: u.weights_version for a, u in got.items()} == {"127.0.0.1": "step-1"}
    finally:
        server.shutdown()
        server.server_close()


def test_both_clients_take_the_same_arguments():
    import inspect
    blocking, awaited = (inspect.signature(c.update_weights_everywhere) for c in (ScoreClient, AsyncScoreClient))
    assert blocking == awaited


class Closable(httpx.MockTransport):
    """A caller's transport that notes its close (httpx's own pool closes the connections of requests on the wire)."""

    closed = False

    def close(self):
        self.closed = True

    async def aclose(self):
        self.closed = True


def _pods_and_models(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "policy", "weights_version": "step-1"}]})
    status, body = ok("step-1")
    return httpx.Response(status, json=body)


def test_the_callers_transport_stays_open_through_an_update_everywhere(monkeypatch):
    # each per-address client closed the caller's transport, under the caller's own client and its requests
    _resolving(monkeypatch, "10.0.0.7", "10.0.0.8")
    transport = Closable(_pods_and_models)
    with ScoreClient(f"http://{NAME}:8000", transport=transport) as client:
        assert set(client.update_weights_everywhere("policy", "step-000001")) == {"10.0.0.7", "10.0.0.8"}
        assert not transport.closed
        assert client.models()[0]["weights_version"] == "step-1"
    assert transport.closed  # the caller's client still closes it

    async def main():
        transport = Closable(_pods_and_models)
        async with AsyncScoreClient(f"http://{NAME}:8000", transport=transport) as client:
            assert set(await client.update_weights_everywhere("policy", "step-000001")) == {"10.0.0.7", "10.0.0.8"}
            assert not transport.closed
            assert (await client.models())[0]["weights_version"] == "step-1"
        assert transport.closed

    asyncio.run(main())


class Echoing(Pods):
    """Pods that answer with the request's X-Request-Id, as the server does; ``down`` refuses connections."""

    def __init__(self, answers, down=()):
        super().__init__(answers)
        self.ids, self.down = [], set(down)

    def __call__(self, request):
        self.ids.append(request.headers.get("x-request-id"))
        if request.url.host in self.down:
            raise httpx.ConnectError("Connection refused", request=request)
        response = super().__call__(request)
        response.headers["x-request-id"] = request.headers["x-request-id"]
        return response


def test_every_address_gets_one_request_id_and_the_answers_and_errors_name_it(monkeypatch):
    import pickle
    import re

    _resolving(monkeypatch, "10.0.0.7", "10.0.0.8")
    pods = Echoing({"10.0.0.7": ok("step-2"), "10.0.0.8": ok("step-2"), "10.0.0.9": REFUSED})
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods), connect_retry_s=0.1) as client:
        got = client.update_weights_everywhere("policy", "step-000002", version="step-2")
        assert len(pods.ids) == 2 and len(set(pods.ids)) == 1 and re.fullmatch("[0-9a-f]{32}", pods.ids[0]), pods.ids
        assert {u.request_id for u in got.values()} == {pods.ids[0]}, got

        _resolving(monkeypatch, "10.0.0.7", "10.0.0.8", "10.0.0.9", "10.0.0.10")
        pods.ids.clear()
        pods.down.add("10.0.0.10")
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere("policy", "step-000002", version="step-2")
    e, rid = caught.value, pods.ids[0]
    assert set(pods.ids) == {rid} and rid not in {u.request_id for u in got.values()}, pods.ids  # a new one per call
    assert e.request_id == rid and str(e).count(f"request_id: {rid}") == 1, e  # named once, at the end
    assert {a: f.request_id for a, f in e.failed.items()} == {"10.0.0.9": rid, "10.0.0.10": rid}, e.failed
    assert (e.failed["10.0.0.10"].type, e.failed["10.0.0.9"].type) == ("connection_error", "invalid_value"), e.failed
    assert {u.request_id for u in e.updated.values()} == {rid}, e.updated
    back = pickle.loads(pickle.dumps(e))
    assert (back.request_id, str(back), back.failed["10.0.0.10"].request_id) == (rid, str(e), rid), back


def _resolving_scoped(monkeypatch, *sockaddrs: tuple) -> None:
    """``NAME`` resolves to ``sockaddrs`` as getaddrinfo gives them: a link-local IPv6 address's zone
    in the scope id, not in the string."""
    def fake(host, port, *args, **kw):
        if host != NAME:
            return REAL_GETADDRINFO(host, port, *args, **kw)
        return [(socket.AF_INET6 if len(s) == 4 else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (s[0], port, *s[2:])) for s in sockaddrs]
    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_a_link_local_address_keeps_its_zone_and_one_httpx_refuses_fails_alone(monkeypatch):
    index, interface = socket.if_nameindex()[0]
    # the scope id must stay: a link-local address without its zone cannot be connected to (EINVAL)
    _resolving_scoped(monkeypatch, ("fe80::1", 0, 0, index), ("10.0.0.7", 0))
    zoned = f"fe80::1%{interface}"
    pods = Pods({zoned: ok("step-1"), "10.0.0.7": ok("step-1")})
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods)) as client:
        got = client.update_weights_everywhere("policy", "step-000001", version="step-1")
        assert list(got) == [zoned, "10.0.0.7"], got
        assert sorted(h for h, *_ in pods.seen) == sorted([zoned, "10.0.0.7"]), pods.seen

        # a zone no URL can hold: that address's failure, named, not a raw InvalidURL for the whole call
        _resolving_scoped(monkeypatch, ("fe80::1%a/b", 0, 0, 0), ("10.0.0.7", 0))
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere("policy", "step-000001", version="step-1")
    e = caught.value
    assert list(e.updated) == ["10.0.0.7"] and list(e.failed) == ["fe80::1%a/b"], e
    assert e.failed["fe80::1%a/b"].type == "connection_error" and "'fe80::1%a/b'" in str(e), e

    async def main():
        async with AsyncScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods)) as client:
            with pytest.raises(UpdateEverywhereError) as caught:
                await client.update_weights_everywhere("policy", "step-000001", version="step-1")
        return caught.value

    e = asyncio.run(main())
    assert list(e.updated) == ["10.0.0.7"] and list(e.failed) == ["fe80::1%a/b"], e


def _link_local() -> tuple[str, str] | None:
    """A link-local IPv6 address of this machine and its interface, if it has one (Linux)."""
    try:
        with open("/proc/net/if_inet6") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hexaddr, _, _, scope, _, name = line.split()
        if scope == "20":  # link scope
            return str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))), name
    return None


@pytest.mark.skipif(_link_local() is None, reason="needs a link-local IPv6 address on this machine")
def test_a_real_link_local_pod_is_reached_through_its_zone(monkeypatch):
    address, interface = _link_local()

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6

    server = Server((address, 0, 0, socket.if_nametoindex(interface)), _WeightsHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    # the name resolves as a resolver answers for a link-local address: the zone in the scope id
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, p, *a, **kw: REAL_GETADDRINFO(
        f"{address}%{interface}" if host == NAME else host, p, *a, **kw))
    try:
        with ScoreClient(f"http://{NAME}:{port}", connect_retry_s=0.5) as client:
            got = client.update_weights_everywhere("policy", "step-000001", version="step-1")
        assert {a: u.weights_version for a, u in got.items()} == {f"{address}%{interface}": "step-1"}, got
    finally:
        server.shutdown()
        server.server_close()


# A request never waits longer than this for the others to come in: a bound, not a timing.
_GAUGE_BACKSTOP_S = 30.0


class Gauged:
    """``total`` pods that answer /v1/weights once ``bound + 1`` requests are in at once, or once as many are in
    as can be (``bound``, or every request not yet answered): counts the most in at once (a thread or task and a
    connection each on the client). No fixed wait: on a loaded machine the client's threads start late."""

    def __init__(self, bound: int, total: int):
        self.bound, self.total, self.inside, self.most, self.ids = bound, total, 0, 0, set()
        self.answered = 0
        self.changed = threading.Condition()

    def full(self) -> bool:
        return self.inside > self.bound or self.inside >= min(self.bound, self.total - self.answered)

    def enter(self, request: httpx.Request) -> None:
        with self.changed:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.ids.add(request.headers.get("x-request-id"))
            self.changed.notify_all()

    def leave(self) -> httpx.Response:
        with self.changed:
            self.inside -= 1
            self.answered += 1
            self.changed.notify_all()
        return httpx.Response(200, json=ok("step-1")[1])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.enter(request)
        with self.changed:
            self.changed.wait_for(self.full, timeout=_GAUGE_BACKSTOP_S)
        return self.leave()

    async def awaited(self, request: httpx.Request) -> httpx.Response:
        self.enter(request)
        end = asyncio.get_running_loop().time() + _GAUGE_BACKSTOP_S
        while not self.full() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.005)
        return self.leave()


def test_a_large_service_is_updated_a_bounded_number_of_addresses_at_a_time(monkeypatch):
    # one thread per address: a headless Service of hundreds of pods started hundreds at once
    ips = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(40)]
    _resolving(monkeypatch, *ips)
    pods = Gauged(32, len(ips))  # the default
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods)) as client:
        got = client.update_weights_everywhere("policy", "step-1", version="step-1")
    assert pods.most == 32, pods.most
    assert list(got) == ips and {u.weights_version for u in got.values()} == {"step-1"}
    assert len(pods.ids) == 1 and {u.request_id for u in got.values()} == pods.ids, pods.ids

    ips = ips[:12]
    _resolving(monkeypatch, *ips)
    few = Gauged(3, len(ips))
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(few)) as client:
        assert list(client.update_weights_everywhere("policy", "step-1", max_concurrency=3)) == ips
        with pytest.raises(ValueError, match="max_concurrency"):
            client.update_weights_everywhere("policy", "step-1", max_concurrency=0)
    assert few.most == 3, few.most

    async def main():
        pods = Gauged(3, len(ips))
        async with AsyncScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(pods.awaited)) as client:
            got = await client.update_weights_everywhere("policy", "step-1", version="step-1", max_concurrency=3)
        return pods, got

    pods, got = asyncio.run(main())
    assert pods.most == 3, pods.most
    assert list(got) == ips and len(pods.ids) == 1 and {u.request_id for u in got.values()} == pods.ids


def test_max_concurrency_takes_a_numpy_int_as_the_client_knob_does(monkeypatch):
    # client.md: "an int of at least 1"; a numpy int (read from a trainer's config) is one
    ips = [f"10.0.0.{i}" for i in range(1, 7)]
    _resolving(monkeypatch, *ips)
    few = Gauged(2, len(ips))
    with ScoreClient(f"http://{NAME}:8000", transport=httpx.MockTransport(few), max_concurrency=np.int64(2)) as client:
        assert list(client.update_weights_everywhere("policy", "step-1", max_concurrency=np.int64(2))) == ips
    assert few.most == 2, few.most
