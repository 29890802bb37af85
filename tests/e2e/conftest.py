"""Real server processes (``python -m service.cli serve``) on 127.0.0.1 with the tiny model."""

import pytest

from tests.e2e.helpers import ServerProcess


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """The tiny preset with an API key; shared by the tests that do not stop or overload it."""
    server = ServerProcess(tmp_path_factory.mktemp("tiny"), "--max-batch-tokens", "2048", "--max-wait-ms", "2")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def weights_root_server(tmp_path_factory):
    """The tiny preset with an API key and ``--weights-root`` an empty directory; one a module."""
    tmp = tmp_path_factory.mktemp("weights-root")
    (tmp / "weights").mkdir()
    server = ServerProcess(tmp, "--weights-root", str(tmp / "weights"))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_scorer():
    """The same model in this process: what every answer is compared with."""
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    return Scorer(load_model("tiny"), max_batch_tokens=8192)
