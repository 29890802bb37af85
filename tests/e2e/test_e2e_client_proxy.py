"""``update_weights_everywhere`` posts to each pod's address itself, whatever HTTP_PROXY says: with an
egress proxy in the environment (a real one on 127.0.0.1 that records what it receives and answers
502, as a proxy that cannot reach a pod does), the update reaches the real server and the proxy sees
none of it, while the client's own requests to the name still go through the proxy, as httpx sends them."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading

import httpx
import numpy as np
import pytest

from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
from tests.e2e.helpers import fake_server, served_version
from tests.resolving import resolving

NAME = "scorer-pods.rl.svc"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("proxy")
    for step in (1, 2):
        (root / f"step-{step}").mkdir()  # FakeBackend takes any directory as a checkpoint
    server = fake_server(root, "--weights-root", str(root))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A forward proxy that reaches nothing: it notes each request line and answers its own 502 page."""

    def _refuse(self):
        self.server.seen.append(f"{self.command} {self.path}")
        page = b"<html>502 Bad Gateway</html>"
        self.send_response(502)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    do_GET = do_POST = do_CONNECT = _refuse

    def log_message(self, *args):
        pass


@pytest.fixture
def proxy(monkeypatch):
    """An egress proxy in the environment, as HTTP_PROXY holds it in a cluster, with no NO_PROXY."""
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    proxy.seen = []
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    monkeypatch.setenv("http_proxy", url)
    monkeypatch.setenv("HTTP_PROXY", url)
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_the_per_address_requests_of_an_update_everywhere_bypass_the_environments_proxy(server, proxy, monkeypatch):
    resolving(monkeypatch, NAME, "127.0.0.1")  # the name of a headless Service of one pod
    url = f"http://{NAME}:{server.port}"
    with ScoreClient(url, connect_retry_s=0.5) as client:
        got = client.update_weights_everywhere(None, "step-1", version="step-1")
        assert {a: u.weights_version for a, u in got.items()} == {"127.0.0.1": "step-1"}, proxy.seen
        assert served_version(server.url) == "step-1" and proxy.seen == [], proxy.seen
        with pytest.raises(ScoreError):  # the client's own request: the proxy's 502 page, for connect_retry_s
            client.models()
    # the environment's proxy was in force
    assert proxy.seen and set(proxy.seen) == {f"GET {url}/v1/models"}, proxy.seen
    seen = len(proxy.seen)

    async def main():
        async with AsyncScoreClient(url, connect_retry_s=0.5) as client:
            return await client.update_weights_everywhere(None, "step-2", version="step-2")

    assert {a: u.weights_version for a, u in asyncio.run(main()).items()} == {"127.0.0.1": "step-2"}, proxy.seen
    assert served_version(server.url) == "step-2" and len(proxy.seen) == seen, proxy.seen


class _BodyLimitProxy(http.server.BaseHTTPRequestHandler):
    """A reverse proxy with nginx-ingress's kind of body limit: a larger body gets its own HTML 413,
    a smaller one goes on to the server."""

    protocol_version = "HTTP/1.1"

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if len(body) > self.server.limit:
            self.server.refused.append(len(body))
            status, headers, page = 413, {"Content-Type": "text/html"}, b"<html>413 Request Entity Too Large</html>"
        else:
            sent = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            answer = httpx.request(self.command, self.server.upstream + self.path, content=body, headers=sent, timeout=60)
            status, page = answer.status_code, answer.content
            headers = {k: v for k, v in answer.headers.items() if k.lower() == "content-type" or k.lower().startswith("x-")}
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    do_GET = do_POST = _forward

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_a_proxys_own_413_is_sent_again_in_parts_and_later_calls_stay_under_it(server, encoding, caplog):
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BodyLimitProxy)
    proxy.upstream, proxy.limit, proxy.refused = server.url, 20_000, []
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    rng = np.random.default_rng(0)
    batch = [{"input_ids": rng.integers(1, 200, int(n)).tolist(), "score_from": 1} for n in rng.integers(200, 900, 24)]
    try:
        with ScoreClient(server.url, encoding=encoding) as direct:
            expected = [s.logprobs.tolist() for s in direct.score(batch)]
        with ScoreClient(f"http://127.0.0.1:{proxy.server_address[1]}", encoding=encoding) as client:
            with caplog.at_level(logging.WARNING, logger="packscore_client"):
                got = client.score(batch)
            assert [s.logprobs.tolist() for s in got] == expected  # every sequence, in order
            assert proxy.refused, "the batch should have been over the proxy's limit"
            assert any("413 page of its own" in r.getMessage() for r in caplog.records), caplog.text
            refused = len(proxy.refused)
            assert [s.logprobs.tolist() for s in client.score(batch)] == expected
            assert len(proxy.refused) == refused, proxy.refused  # the next call stays under the limit from the start
    finally:
        proxy.shutdown()
        proxy.server_close()
