import os

import pytest
import torch

from model_runtime.pool.procs import WorkerWorld
from service.local_server import LocalServer
from tests import warm_start
from tests.checkpoints import KINDS, save_checkpoint

# Two cores here and in CI, shared by the pytest-xdist workers: OpenMP threads that outnumber the
# cores spin at every barrier, so each worker takes its share of the cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Test servers and pool workers skip their ten seconds of imports (cold, as users start them, with
# TESTS_COLD_START=1 or CUDA: tests/warm_start.py).
LocalServer.spawn = staticmethod(warm_start.popen)
WorkerWorld.spawn = staticmethod(warm_start.popen)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """Returns a function kind -> path of a tiny saved checkpoint (built once per session)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = save_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param
