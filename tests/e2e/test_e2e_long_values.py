"""A client's long string, wherever it is sent (the route, the method, a header, /v1/weights' path),
comes back cut in the error that names it (60 characters, a path 200), on a real server, as a long
model name or unknown key already does: an error is one sentence, not the client's 500 KB again.
A checkpoint path of a usual depth is still shown whole."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import AUTH

LONGEST_MESSAGE = 400  # the sentence around a path shown at 200 characters
DEEP_PATH = "grpo-qwen3.5-9b-math-lr1e-6-kl1e-3-group16/global_step_001200/actor/huggingface"


@pytest.fixture(scope="module")
def server(weights_root_server):
    return weights_root_server


def _refusals(url: str) -> dict[str, httpx.Response]:
    body = {"sequences": [{"input_ids": [1, 2]}]}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        return {
            "route": client.get("/" + "r" * 60_000),
            "method": client.request("M" * 300, "/score"),
            "content-type": client.post("/score", content=b"{}", headers={"Content-Type": "text/" + "t" * 50_000}),
            "content-encoding": client.post("/score", json=body, headers={"Content-Encoding": "e" * 50_000}),
            "absolute-path": client.post("/v1/weights", json={"path": "/" + "a" * 500_000}),
            "climbing-path": client.post("/v1/weights", json={"path": "../" + "c" * 100_000}),
            "missing-path": client.post("/v1/weights", json={"path": "m/" * 500}),
            "deep-path": client.post("/v1/weights", json={"path": DEEP_PATH}),
        }


WANT = {  # status, type, param
    "route": (404, "not_found", None),
    "method": (405, "method_not_allowed", None),
    "content-type": (400, "unsupported_content_type", "Content-Type"),
    "content-encoding": (400, "unsupported_content_encoding", "Content-Encoding"),
    "absolute-path": (403, "forbidden_path", "path"),
    "climbing-path": (403, "forbidden_path", "path"),
    "missing-path": (422, "invalid_value", "path"),
    "deep-path": (422, "invalid_value", "path"),
}


def test_a_long_route_method_header_or_weights_path_is_not_echoed_whole(server):
    answers = _refusals(server.url)
    for case, answer in answers.items():
        error = answer.json()["error"]
        assert (answer.status_code, error["type"], error["param"]) == WANT[case], (case, answer.text[:300])
        assert len(error["message"]) < LONGEST_MESSAGE, (case, len(error["message"]), error["message"][:300])
        assert error["message"].endswith("."), (case, error["message"][-100:])
    assert repr(DEEP_PATH) in answers["deep-path"].json()["error"]["message"], answers["deep-path"].text
