"""One weight update to every pod of a headless Service, with real servers: two pods on 127.0.0.1 and
127.0.0.2 (one port, as pods share their container port), reached through one name that resolves to
both, as ``<fullname>-pods.<namespace>.svc`` does (chart README, Weight updates)."""

import shutil

import pytest

from packscore_client import ScoreClient, UpdateEverywhereError
from tests.checkpoints import save_checkpoint
from tests.e2e.helpers import API_KEY, AUTH, ServerProcess, served_version
from tests.resolving import resolving

NAME = "scorer-pods.rl.svc"


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """Two servers of one policy on one port; pod b's weights root lacks step-2."""
    tmp = tmp_path_factory.mktemp("pods")
    root_a, root_b = tmp / "a", tmp / "b"
    for step in range(3):
        save_checkpoint("qwen3_5", root_a / f"step-{step}", seed=step)
    for step in range(2):
        shutil.copytree(root_a / f"step-{step}", root_b / f"step-{step}")
    common = ("--max-batch-tokens", "256", "--max-wait-ms", "2")
    a = ServerProcess(tmp, "--model", str(root_a / "step-0"), "--weights-root", str(root_a), *common)
    servers = [a]
    try:
        # a's port is final once it is ready (a port taken before its bind is given up for another): b's then
        a.wait_ready(timeout=240)
        b = ServerProcess(tmp, "--model", str(root_b / "step-0"), "--weights-root", str(root_b), *common,
                          "--host", "127.0.0.2", "--port", str(a.port))  # the last --host/--port win
        servers.append(b)
        b.url = f"http://127.0.0.2:{a.port}"
        b.wait_ready(timeout=240)
        yield a, b
    finally:
        codes = [server.stop() for server in servers]
        assert codes == [0] * len(servers), "".join(server.log() for server in servers)


def test_every_pod_serves_the_update_and_a_failed_one_is_named(pods, monkeypatch):
    a, b = pods
    port = a.port
    resolving(monkeypatch, NAME, "127.0.0.1", "127.0.0.2")
    with ScoreClient(f"http://{NAME}:{port}", API_KEY, connect_retry_s=0.5) as client:
        got = client.update_weights_everywhere(None, "step-1", version="step-1")
        assert {addr: u.weights_version for addr, u in got.items()} == {"127.0.0.1": "step-1", "127.0.0.2": "step-1"}
        assert (served_version(a.url, AUTH), served_version(b.url, AUTH)) == ("step-1", "step-1")
        # one request id, which each pod answered with and logged the update under
        (rid,) = {u.request_id for u in got.values()}
        assert rid is not None and all(f"request_id={rid}" in pod.log() for pod in (a, b)), (rid, a.log(), b.log())

        # b has no step-2, and nothing listens on 127.0.0.3: both named, a's success kept.
        resolving(monkeypatch, NAME, "127.0.0.1", "127.0.0.2", "127.0.0.3")
        with pytest.raises(UpdateEverywhereError) as caught:
            client.update_weights_everywhere(None, "step-2", version="step-2")
    e = caught.value
    assert e.type == "update_incomplete" and list(e.updated) == ["127.0.0.1"], e
    assert e.updated["127.0.0.1"].weights_version == "step-2"
    assert list(e.failed) == ["127.0.0.2", "127.0.0.3"], e
    assert e.failed["127.0.0.2"].status == 422 and e.failed["127.0.0.2"].param == "path", e.failed
    assert (e.failed["127.0.0.3"].status, e.failed["127.0.0.3"].type) == (0, "connection_error"), e.failed
    assert "127.0.0.2: 422" in str(e) and "127.0.0.3: 0 connection_error" in str(e), e
    assert "127.0.0.1 serves 'step-2'" in str(e), e
    assert (served_version(a.url, AUTH), served_version(b.url, AUTH)) == ("step-2", "step-1")  # a failed update changes nothing on b
    assert e.request_id not in (None, rid) and str(e).endswith(f"(request_id: {e.request_id})"), e
    assert {f.request_id for f in e.failed.values()} == {e.request_id} and len(e.failed) == 2, e.failed
    assert e.updated["127.0.0.1"].request_id == e.request_id and f"request_id={e.request_id}" in a.log(), e.updated
