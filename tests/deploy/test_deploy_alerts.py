"""The chart's PrometheusRule: off by default, the Prometheus Operator's shape, valid PromQL built only
on series and labels the server exports, and every value reaching its rule."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import promql_parser
import pytest
import yaml

from deploy_helpers import CHART, NAMESPACE, exported_series, manifests, one, render_chart, vector_selectors
from service.http.app import SCORE_ROUTES

RULE_SCHEMA = json.loads(Path(__file__).with_name("prometheusrule.schema.json").read_text())
ON = {"prometheusRule": {"enabled": True}}
ALERT_KEYS = sorted(yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["alerts"])
# Prometheus writes `up` for every target itself; the service exports the rest.
SCRAPE_SERIES = {"up": frozenset()}
# Labels every series gets from the scrape (job, instance) and the Prometheus Operator (namespace).
TARGET_LABELS = {"job", "instance", "namespace"}
DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")


def rule_object(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return one(manifests(values or ON), "PrometheusRule")


def rules(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [r for g in rule_object(values)["spec"]["groups"] for r in g["rules"]]


def alerts(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    found = [r for r in rules(values) if "alert" in r]
    names = [r["alert"] for r in found]
    assert len(names) == len(set(names)), names
    return {r["alert"]: r for r in found}


def on(**section: Any) -> dict[str, Any]:
    return {"prometheusRule": {"enabled": True, **section}}


def with_alert(key: str, **fields: Any) -> dict[str, Any]:
    return on(alerts={key: fields})


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    return vector_selectors(promql_parser.parse(expr))


def matchers(s: promql_parser.VectorSelector) -> dict[str, str]:
    return {m.name: m.value for m in s.matchers.matchers}


# Value sets under which every expression must still be valid and honest.
VARIANTS = {
    "defaults": ON,
    "custom": on(selector='job="scorer",cluster="gpu-a"', rateWindow="10m", alerts={
        "workersDown": {"expected": 16}, "restarting": {"restarts": 5, "window": "2h"},
        "serverErrors": {"ratio": 0}, "refusing": {"ratio": 0.2},
        "queueWaitHigh": {"quantile": 0.5, "seconds": 0.25}, "weightsUpdateFailed": {"window": "1h"},
        "weightsRecordFailed": {"window": "2h"}}),
}


def test_off_by_default_and_every_alert_on_when_enabled():
    assert [d for d in manifests() if d["kind"] == "PrometheusRule"] == []
    assert len(alerts()) == len(ALERT_KEYS) == 12


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rule_has_the_prometheus_operator_shape(variant):
    jsonschema.validate(rule_object(VARIANTS[variant]), RULE_SCHEMA)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_expression_is_valid_promql(variant):
    for name, rule in alerts(VARIANTS[variant]).items():
        try:
            promql_parser.parse(rule["expr"])
        except ValueError as e:
            pytest.fail(f"{name}: {rule['expr']}: {e}")


def test_the_parser_refuses_what_a_bad_template_would_write():
    """Guards the check above: braces twice (a selector given with its braces), a rate of a gauge
    read without a range, grouping on a set operator."""
    for expr in ('up{{job="x"}} == 0', "rate(packscore_ready) > 0", "up and on (job) group_left up"):
        with pytest.raises(ValueError):
            promql_parser.parse(expr)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_only_series_and_labels_the_server_exports(variant):
    exported = {name: labels for name, (_, labels) in exported_series().items()} | SCRAPE_SERIES
    grouping = re.compile(r"\b(?:by|on|ignoring) \(([^)]*)\)")
    custom = set(matchers(selectors(f"up{{{VARIANTS[variant]['prometheusRule'].get('selector', '')}}}")[0]))
    for name, rule in alerts(VARIANTS[variant]).items():
        found = selectors(rule["expr"])
        assert found, name
        for s in found:
            assert s.name in exported, f"{name}: {s.name} is not a series of GET /metrics"
            extra = set(matchers(s)) - exported[s.name] - TARGET_LABELS - custom - {"__name__"}
            assert not extra, f"{name}: {extra} not labels of {s.name}"
        available = set().union(*(exported[s.name] for s in found)) | TARGET_LABELS
        for group in grouping.findall(rule["expr"]):
            labels = {label.strip() for label in group.split(",")}
            assert labels <= available, f"{name}: {labels - available} not on {[s.name for s in found]}"


def test_label_values_are_the_ones_the_server_writes():
    exprs = {name: r["expr"] for name, r in alerts().items()}
    routes = {matchers(s)["route"] for e in exprs.values() for s in selectors(e) if "route" in matchers(s)}
    assert routes == {"|".join(SCORE_ROUTES)}, routes
    assert all(re.fullmatch(r, route) for r in routes for route in SCORE_ROUTES)
    assert "packscore_weights_updates_total" in exprs["PackscoreWeightsUpdateFailed"]
    assert 'outcome!="ok"' in exprs["PackscoreWeightsUpdateFailed"]  # service/http/weights.py counts success as "ok"
    assert "increase(packscore_weights_record_failures_total{" in exprs["PackscoreWeightsRecordFailed"]
    assert "packscore_weights_awaited{" in exprs["PackscoreAwaitingWeights"]  # 1 while withheld (service/runtime.py)
    assert 'status=~"5..",status!~"503|504"' in exprs["PackscoreServerErrors"]  # API.md: any other 5xx is a bug


# Reads a failure counter as is, on purpose: a series that is new has failed once, and increase() sees no rise.
RAW_COUNTER_READS = {"PackscoreWeightsUpdateFailed": 2}


def test_counters_and_histograms_are_read_over_a_window():
    cumulative = {n for n, (kind, _) in exported_series().items() if kind in ("counter", "histogram")}
    for name, rule in alerts().items():
        expr = rule["expr"]
        reads = sum(expr.count(f"{c}{{") for c in cumulative)
        windowed = len(re.findall(r"\b(?:rate|increase)\((" + "|".join(cumulative) + r")\{[^}]*\}\[", expr))
        assert reads - windowed == RAW_COUNTER_READS.get(name, 0), f"{name}: a counter read without rate(): {expr}"


def test_every_selector_picks_the_service_monitors_series():
    svc = one(manifests(ON), "Service")["metadata"]["name"]
    for name, rule in alerts().items():
        for s in selectors(rule["expr"]):
            assert matchers(s).items() >= {"job": svc, "namespace": NAMESPACE}.items(), f"{name}: {s}"
    for name, rule in alerts(VARIANTS["custom"]).items():
        for s in selectors(rule["expr"]):
            assert matchers(s).items() >= {"job": "scorer", "cluster": "gpu-a"}.items(), f"{name}: {s}"
            assert "namespace" not in matchers(s), f"{name}: {s}"


def test_every_alert_says_what_it_is_and_what_to_do():
    for name, rule in alerts().items():
        assert name.startswith("Packscore"), name
        assert DURATION.match(rule["for"]), (name, rule["for"])
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert set(rule["annotations"]) == {"summary", "description"}, name
        assert len(rule["annotations"]["description"]) > 100, name
        # Helm must leave Prometheus's own templates for Prometheus to fill in.
        assert "{{ $labels." in rule["annotations"]["summary"] + rule["annotations"]["description"] \
            or name == "PackscoreTargetMissing", name


def test_chart_readme_documents_every_alert():
    readme = (CHART / "README.md").read_text()
    for name in alerts():
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("key", ALERT_KEYS)
def test_each_alert_can_be_switched_off(key):
    every = set(alerts())
    left = set(alerts(with_alert(key, enabled=False)))
    assert len(every - left) == 1, every - left


def test_severity_and_for_reach_each_alert():
    for key in ALERT_KEYS:
        got = alerts(with_alert(key, severity="page", **{"for": "42m"}))
        changed = [r for r in got.values() if r["labels"]["severity"] == "page"]
        assert len(changed) == 1 and changed[0]["for"] == "42m", (key, changed)


def test_thresholds_reach_the_expressions():
    got = {name: r["expr"] for name, r in alerts(VARIANTS["custom"]).items()}
    assert "< 16" in got["PackscoreWorkersDown"]
    assert "[2h]) >= 5" in got["PackscoreRestarting"]
    assert got["PackscoreServerErrors"].rstrip().endswith("> 0")
    assert got["PackscoreRefusingRequests"].rstrip().endswith("> 0.2")
    assert got["PackscoreQueueWaitHigh"].startswith("histogram_quantile(0.5,")
    assert got["PackscoreQueueWaitHigh"].rstrip().endswith("> 0.25")
    assert got["PackscoreWeightsUpdateFailed"].count("1h") == 2
    assert "[2h]) > 0" in got["PackscoreWeightsRecordFailed"]
    for name in ("PackscoreStalled", "PackscoreServerErrors", "PackscoreRefusingRequests", "PackscoreQueueWaitHigh"):
        assert "[10m]" in got[name] and "[5m]" not in got[name], name


@pytest.mark.parametrize(("values", "expected"), [
    pytest.param({}, 8, id="one-per-gpu"),
    pytest.param({"gpus": 4}, 4, id="four-gpus"),
    pytest.param({"gpus": 8, "parallel": {"worldSize": 2, "sp": 1, "fsdp": False}}, 2, id="world-size"),
])
def test_workers_threshold_is_the_pods_world_size(values, expected):
    expr = alerts({**values, **ON})["PackscoreWorkersDown"]["expr"]
    assert f"packscore_workers_alive{{job=\"ps-packscore\",namespace=\"rl\"}} < {expected}\n" in expr, expr


def test_not_ready_and_workers_wait_out_what_the_startup_probe_allows():
    startup = {"path": "/readyz", "periodSeconds": 20, "failureThreshold": 90, "timeoutSeconds": 5}
    got = alerts({**ON, "probes": {"startup": startup}})
    for name in ("PackscoreNotReady", "PackscoreWorkersDown"):
        assert "packscore_process_start_time_seconds" in got[name]["expr"]
        assert got[name]["expr"].rstrip().endswith("> 1800"), got[name]["expr"]
    startup["failureThreshold"] = 30
    assert alerts({**ON, "probes": {"startup": startup}})["PackscoreNotReady"]["expr"].rstrip().endswith("> 600")


def test_labels_alert_labels_and_extra_rules():
    extra = [{"alert": "ScorerSlowKernel", "expr": "max(packscore_slow_kernel_fallback) > 0", "for": "1h",
              "labels": {"severity": "info"}}]
    values = on(labels={"release": "prom"}, alertLabels={"team": "rl", "severity": "ignored"}, extraRules=extra)
    obj = rule_object(values)
    assert obj["metadata"]["labels"]["release"] == "prom"
    assert obj["metadata"]["namespace"] == NAMESPACE
    got = alerts(values)
    assert got["ScorerSlowKernel"] == extra[0]
    assert [r["alert"] for r in rules(values)][-1] == "ScorerSlowKernel"
    for name, rule in got.items():
        if name.startswith("Packscore"):
            assert rule["labels"]["team"] == "rl", name
            assert rule["labels"]["severity"] != "ignored", name  # the alert's own severity wins
    jsonschema.validate(obj, RULE_SCHEMA)


@pytest.mark.parametrize(("values", "where"), [
    pytest.param(on(enabled="yes"), "/prometheusRule/enabled", id="enabled-not-bool"),
    pytest.param(with_alert("notReady", **{"for": "ten minutes"}), "/prometheusRule/alerts/notReady/for", id="bad-for"),
    pytest.param(on(rateWindow="0m"), "/prometheusRule/rateWindow", id="zero-window"),
    pytest.param(with_alert("refusing", ratio=1.5), "/prometheusRule/alerts/refusing/ratio", id="ratio-above-one"),
    pytest.param(with_alert("serverErrors", ratio=-0.1), "/prometheusRule/alerts/serverErrors/ratio", id="negative-ratio"),
    pytest.param(with_alert("queueWaitHigh", quantile=1), "/prometheusRule/alerts/queueWaitHigh/quantile", id="quantile-one"),
    pytest.param(with_alert("queueWaitHigh", seconds=0), "/prometheusRule/alerts/queueWaitHigh/seconds", id="zero-seconds"),
    pytest.param(with_alert("workersDown", expected=0), "/prometheusRule/alerts/workersDown/expected", id="no-workers"),
    pytest.param(with_alert("restarting", restarts=0), "/prometheusRule/alerts/restarting/restarts", id="zero-restarts"),
    pytest.param(with_alert("targetDown", severity="very bad"), "/prometheusRule/alerts/targetDown/severity",
                 id="severity-with-space"),
    pytest.param(on(alerts={"targetdown": {"enabled": False}}), "additional properties 'targetdown'", id="typo-alert"),
    pytest.param(with_alert("stalled", threshold=3), "additional properties 'threshold'", id="typo-field"),
    pytest.param(on(selector='{job="x"}'), "/prometheusRule/selector", id="selector-with-braces"),
    pytest.param(on(extraRules=[{"alert": "X"}]), "/prometheusRule/extraRules/0", id="extra-rule-without-expr"),
    pytest.param(on(extraRules=[{"alert": "X", "record": "x:y", "expr": "up"}]), "/prometheusRule/extraRules/0",
                 id="extra-rule-both-alert-and-record"),
    pytest.param(on(extraRules=[{"alert": "X", "expr": "up", "anotations": {}}]), "additional properties 'anotations'",
                 id="extra-rule-typo"),
])
def test_schema_rejects_bad_values(values, where):
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(values)
    assert where in str(err.value)


def test_the_queue_wait_alert_warns_before_the_admission_bound_refuses():
    """The queue wait includes the wait for room, which ends in a 429 at --max-admission-wait-s (the
    chart leaves it at the server's default): a threshold there would fire only once requests fail."""
    from service.settings import Settings

    threshold = float(alerts()["PackscoreQueueWaitHigh"]["expr"].rstrip().rsplit(">", 1)[1])
    assert threshold < Settings().max_admission_wait_s, threshold


def test_the_stalled_alert_reads_forwards_ended_not_tokens_scored():
    """Tokens count only where an answer goes out: requests that all time out (504) or whose clients
    all leave (499) score none while forwards run fine, which is no hung GPU."""
    expr = alerts()["PackscoreStalled"]["expr"]
    assert "rate(packscore_forward_seconds_count{" in expr and "tokens_scored" not in expr, expr


def test_a_refused_update_that_named_no_model_reads_as_a_sentence():
    # The server counts such refusals under model="": "of {{ $labels.model }}" alone would end "update of ".
    summary = alerts()["PackscoreWeightsUpdateFailed"]["annotations"]["summary"]
    assert "{{ if $labels.model }}of {{ $labels.model }}{{ else }}" in summary, summary
