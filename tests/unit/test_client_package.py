"""The client installs alone: a fresh virtual environment, `pip install ./service/client`, no torch."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, sys
import numpy as np
from packscore_client import AsyncScoreClient, ScoreClient, ScoreError
for name in ("torch", "transformers", "fastapi", "service", "model_runtime"):
    assert importlib.util.find_spec(name) is None, name + " is importable in the client's environment"
client = ScoreClient("http://127.0.0.1:9", connect_retry_s=0)
try:
    client.score(np.ones((2, 3), dtype=np.int64))
except TypeError as exc:
    assert "score_padded" in str(exc)
print("ok", sys.prefix)
"""


@pytest.mark.slow  # 10-30 s: pip resolves numpy, httpx and msgpack from the package indexes
def test_the_client_installs_and_imports_in_a_fresh_venv_without_torch(tmp_path):
    source = shutil.copytree(ROOT / "service" / "client", tmp_path / "client",
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))  # pip builds in place
    venv = tmp_path / "venv"
    # No pip of its own (seconds saved): this environment's pip installs into it with --python.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                              "--disable-pip-version-check", str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    # Run from an empty directory: the repository's own packages must not be found by accident.
    out = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr
