"""POST /v1/weights: a `version` that breaks the naming rule is a 422 whose message states the rule
in words (API.md: "message": one human sentence), not pydantic's regex or its "items"."""

import asyncio

import pytest

from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app


@pytest.mark.parametrize("version", ["", " v", "v ", "a\nb", "\x00", "x" * 257], ids=["empty", "leading-space",
                         "trailing-space", "newline", "nul", "too-long"])
def test_a_version_breaking_the_rule_is_told_the_rule(tmp_path, version):
    root = tmp_path / "root"
    (root / "step-1").mkdir(parents=True)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend())) as client:
            return await client.post("/v1/weights", json={"path": "step-1", "version": version})

    answer = asyncio.run(main())
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_value" and error["param"] == "version", error
    message = error["message"]
    for leaked in ("pattern", "\\x1f", "items", "after validation"):
        assert leaked not in message, f"{leaked!r} in {message!r}"
    assert "1 to 256 characters" in message and "control character" in message and "space" in message, message


def test_a_version_of_another_type_keeps_its_own_message(tmp_path):
    root = tmp_path / "root"
    (root / "step-1").mkdir(parents=True)

    async def main():
        async with running_app(create_app(Settings(weights_root=root), FakeBackend())) as client:
            return await client.post("/v1/weights", json={"path": "step-1", "version": 5})

    error = asyncio.run(main()).json()["error"]
    assert error["param"] == "version" and "valid string" in error["message"], error
