"""The weight-update series an operator alerts and graphs on: at zero from the start (``rate()`` and
``increase()`` miss the first event of a series that appears with it), and every answer of
POST /v1/weights past the key check counted in ``packscore_weights_updates_total``."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.http.app import create_app
from service.settings import Settings
from service.testing import running_app
from tests.unit.trainer_service import KEY, make_weights_root, two_models

pytestmark = pytest.mark.usefixtures("no_packscore_env")


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _metrics_at_start(settings: Settings) -> dict[tuple, float]:
    async def main():
        async with running_app(create_app(settings, two_models())) as client:
            return (await client.get("/metrics")).text

    return _samples(asyncio.run(main()))


def test_update_series_are_at_zero_from_the_start_for_every_model(tmp_path):
    settings = Settings(weights_root=make_weights_root(tmp_path), weights_record=tmp_path / "record.json")
    got = _metrics_at_start(settings)
    for model in ("policy", "ref"):
        m = (("model", model),)
        for name, labels in (("packscore_weights_updates_total", (("model", model), ("outcome", "ok"))),
                             ("packscore_weights_record_failures_total", m),
                             ("packscore_weights_load_seconds_count", m), ("packscore_weights_swap_seconds_count", m)):
            assert got.get((name, labels)) == 0.0, f"{name}{dict(labels)} not at 0 at start"


def test_no_record_failure_series_without_a_record_and_no_update_series_without_a_root(tmp_path):
    names = {name for name, _ in _metrics_at_start(Settings(weights_root=make_weights_root(tmp_path)))}
    assert "packscore_weights_updates_total" in names
    assert "packscore_weights_record_failures_total" not in names  # nothing can fail to be written
    names = {name for name, _ in _metrics_at_start(Settings())}
    assert not {n for n in names if n.startswith("packscore_weights_") and n != "packscore_weights_awaited"}, names


def test_every_refusal_of_the_weights_route_past_the_key_is_counted(tmp_path):
    settings = Settings(weights_root=make_weights_root(tmp_path), api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    sent = [  # (headers, body): the route's own refusals, before and after its body names a model
        ({**auth, "Content-Type": "application/json"}, b"{not json"),
        ({**auth, "Content-Type": "text/x-weird"}, b"{}"),
        ({**auth, "Content-Type": "application/json"}, b'{"path": "' + b"x" * (2 << 20) + b'"}'),
        ({**auth, "Content-Type": "application/json"}, b'{"model": "policy", "path": "../up"}'),
        ({**auth, "Content-Type": "application/json"}, b'{"model": "nope", "path": "step-1"}'),
        ({"Content-Type": "application/json"}, b'{"model": "policy", "path": "step-1"}'),  # no key: the gate's 401
    ]

    async def main():
        async with running_app(create_app(settings, two_models())) as client:
            answers = [await client.post("/v1/weights", content=body, headers=headers) for headers, body in sent]
            return answers, (await client.get("/metrics", headers=auth)).text

    answers, text = asyncio.run(main())
    types = [a.json()["error"]["type"] for a in answers]
    assert types == ["malformed_body", "unsupported_content_type", "body_too_large", "forbidden_path",
                     "model_not_found", "unauthorized"], types
    counted = {dict(labels)["outcome"]: (dict(labels)["model"], value) for (name, labels), value in _samples(text).items()
               if name == "packscore_weights_updates_total" and value}
    assert counted == {"malformed_body": ("", 1.0), "unsupported_content_type": ("", 1.0), "body_too_large": ("", 1.0),
                       "forbidden_path": ("policy", 1.0), "model_not_found": ("", 1.0)}, counted


def test_every_checkpoint_refusal_is_an_outcome_at_zero_from_the_start():
    """A checkpoint refused by an update is counted under ``<kind>_checkpoint``: every kind packscore
    raises is one the metrics write at 0 (UPDATE_OUTCOMES), so the outcome list stays closed."""
    import re
    from pathlib import Path

    from model_runtime.scoring.checkpoint_error import KINDS, CheckpointError
    from service.http.metrics import UPDATE_OUTCOMES
    from service.http.weights import checkpoint_refused

    root = Path(__file__).resolve().parents[2]
    raised = {kind for path in (root / "model_runtime").rglob("*.py")
              for kind in re.findall(r'CheckpointError\(\s*"(\w+)"', path.read_text())}
    raised |= set(re.findall(r'kind: str = "(\w+)"', (root / "model_runtime/scoring/checkpoint_config.py").read_text()))
    assert raised and raised <= set(KINDS), f"kinds raised but not in KINDS: {sorted(raised - set(KINDS))}"
    outcomes = {checkpoint_refused(CheckpointError(kind, "x")).type for kind in KINDS}
    assert outcomes <= set(UPDATE_OUTCOMES), f"not written at 0 from the start: {sorted(outcomes - set(UPDATE_OUTCOMES))}"
