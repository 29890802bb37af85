"""The names a request may give the model a real server serves from a checkpoint directory: its
served name (the directory's), and the exact ``--model`` string, as a trainer configured for vLLM
sends it (docs/cli.md); ``/v1/models`` lists the one id."""

from __future__ import annotations

import httpx

from tests.checkpoints import save_checkpoint
from tests.e2e.helpers import ServerProcess


def test_the_exact_model_argument_names_the_directory_served_in_score_and_weights(tmp_path):
    root = tmp_path / "root"
    served = save_checkpoint("qwen3_5", root / "step-0", seed=0)
    save_checkpoint("qwen3_5", root / "step-1", seed=1)
    given = str(served)  # absolute, as a trainer's config holds it
    server = ServerProcess(tmp_path, "--model", given, "--weights-root", str(root), api_key=None)
    try:
        server.wait_ready(timeout=240)
        url = server.url

        def score(model):
            return httpx.post(url + "/score", json={"model": model, "sequences": [{"input_ids": [5, 6, 7, 8]}]}, timeout=60)

        by_path, by_name, unknown = score(given), score("step-0"), score(given + "/")
        listed = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
        updated = httpx.post(url + "/v1/weights", json={"model": given, "path": "step-1", "version": "step-1"}, timeout=120)
        after = score(given)
    finally:
        assert server.stop() == 0, server.log()
    assert by_path.status_code == 200 and by_path.json()["model"] == "step-0", by_path.text
    assert by_path.json()["results"] == by_name.json()["results"], (by_path.text, by_name.text)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found", unknown.text  # exact only
    assert listed == ["step-0"], listed
    assert updated.status_code == 200 and updated.json()["model"] == "step-0", updated.text
    assert after.status_code == 200 and after.json()["weights_version"] == "step-1", after.text
