"""The HPA's derived target and what the render cannot see behind it: envFrom's ConfigMaps and Secrets
(chart README, Monitoring and autoscaling)."""

from __future__ import annotations

import pytest

from deploy_helpers import container, manifests, one, render_chart
from service.cli import parse_settings

ENV_FROM = [{"configMapRef": {"name": "packscore-extra"}}]


def notes(values: dict) -> str:
    return render_chart(values)["packscore/templates/NOTES.txt"]


def target(values: dict) -> int:
    return int(one(manifests(values), "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["target"]["averageValue"])


def test_notes_show_the_hpa_target_and_what_it_was_derived_from():
    values = {"gpus": 4, "autoscaling": {"enabled": True}}
    assert target(values) == 65536
    assert "1..4 (HPA on packscore_queued_tokens, target 65536 a pod: --max-batch-tokens 16384 x world size 4)" \
        in notes(values)
    values["autoscaling"]["targetQueuedTokens"] = 50_000
    assert "target 50000 a pod: autoscaling.targetQueuedTokens)" in notes(values)
    assert "HPA" not in notes({})


def test_a_max_batch_tokens_from_env_from_moves_the_servers_rows_but_not_the_derived_target(monkeypatch):
    """The server reads PACKSCORE_MAX_BATCH_TOKENS where the command line leaves it: the target assumed 16384."""
    values = {"gpus": 1, "autoscaling": {"enabled": True}, "envFrom": ENV_FROM}
    monkeypatch.setenv("PACKSCORE_MAX_BATCH_TOKENS", "65536")  # what the ConfigMap would give the container
    assert parse_settings(["serve", *container(values)["args"]])[1].max_batch_tokens == 65536
    assert target(values) == 16384
    text = notes(values)
    assert "WARNING: the render cannot read envFrom's ConfigMaps and Secrets: a PACKSCORE_MAX_BATCH_TOKENS there " \
           "would change --max-batch-tokens but not that target, which assumes 16384; " \
           "a PACKSCORE_MAX_QUEUED_TOKENS there would cap the pods' queue unchecked" in text, text
    assert "set server.maxBatchTokens and server.maxQueuedTokens instead" in text, text
    # Set in values, both reach the command line, which wins over the variable: nothing left unseen.
    values["server"] = {"maxBatchTokens": 32768, "maxQueuedTokens": 4_000_000}
    assert parse_settings(["serve", *container(values)["args"]])[1].max_batch_tokens == 32768
    assert target(values) == 32768
    assert "WARNING" not in notes(values)


@pytest.mark.parametrize(("values", "named"), [
    ({"autoscaling": {"enabled": True, "targetQueuedTokens": 50_000}}, ["server.maxQueuedTokens"]),
    ({"autoscaling": {"enabled": True}, "server": {"maxQueuedTokens": 4_000_000}}, ["server.maxBatchTokens"]),
    ({"autoscaling": {"enabled": True, "targetQueuedTokens": 50_000}, "server": {"maxQueuedTokens": 4_000_000}}, []),
    ({"autoscaling": {"enabled": False}}, []),
])
def test_the_warning_names_only_what_the_target_depends_on_and_values_leave_to_the_server(values, named):
    text = notes({**values, "envFrom": ENV_FROM})
    if named:
        assert f"set {' and '.join(named)} instead (the command line wins over envFrom)" in text, text
    else:
        assert "WARNING" not in text, text
    assert "WARNING" not in notes(values)  # no envFrom: env itself is checked (the render fails)
