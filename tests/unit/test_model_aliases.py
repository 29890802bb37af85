"""The exact ``--model`` string names the model served from that directory only where the model has
no name of an operator's (``--served-model-name``, ``--model NAME=DIR``): then the request names
that name, and a path names nothing (docs/cli.md)."""

import asyncio

import pytest

from service.http.app import create_app
from service.settings import Settings
from service.testing import FakeBackend, running_app

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def _models_named(settings: Settings, backends, names: list[str]) -> dict[str, int | str]:
    """name -> the status of a /score naming it (its answer's model where 200)."""
    async def main():
        async with running_app(create_app(settings, backends)) as client:
            out = {}
            for name in names:
                answer = await client.post("/score", json={"model": name, "sequences": [{"input_ids": [1, 2, 3]}]})
                out[name] = answer.json()["model"] if answer.status_code == 200 else answer.status_code
            return out

    return asyncio.run(main())


def test_a_plain_directory_is_named_by_its_exact_argument_and_nothing_near_it(tmp_path):
    given = str(tmp_path)
    got = _models_named(Settings(model=given), FakeBackend(), [given, "fake-model", given + "/", tmp_path.name])
    assert got == {given: "fake-model", "fake-model": "fake-model", given + "/": 404, tmp_path.name: 404}, got


def test_a_model_the_operator_named_is_not_named_by_its_path(tmp_path):
    given = str(tmp_path)
    named = Settings(model=given, served_model_name="policy")
    assert _models_named(named, FakeBackend(), [given, "policy"]) == {given: 404, "policy": "policy"}
    several = Settings(model=f'["policy={given}", "ref={given}"]')
    backends = {"policy": FakeBackend(), "ref": FakeBackend()}
    assert _models_named(several, backends, [given, "ref"]) == {given: 404, "ref": "ref"}



def test_the_openapi_page_lists_every_name_a_request_may_give(tmp_path):
    """The request schema's ``model`` enum holds the exact ``--model`` directory beside the served name:
    a client that validates against /openapi.json must not refuse a name the server answers 200."""
    given = str(tmp_path)

    async def main():
        async with running_app(create_app(Settings(model=given), FakeBackend())) as client:
            return (await client.get("/openapi.json")).json()

    model = asyncio.run(main())["components"]["schemas"]["ScoreRequest"]["properties"]["model"]
    assert model["anyOf"][0]["enum"] == ["fake-model", given], model
