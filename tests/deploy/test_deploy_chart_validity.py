"""Every rendered manifest is a valid Kubernetes object, and Helm's own lint is clean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from deploy_helpers import CHART, VALUE_SETS, manifests

# The chart's floor (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate ships.
MIN_KUBE = "1.26.0"
KUBE_VERSIONS = [MIN_KUBE, kv_utils.latest_version()]
SERVICE_MONITOR_SCHEMA = json.loads((Path(__file__).with_name("servicemonitor.schema.json")).read_text())
PROMETHEUS_RULE_SCHEMA = json.loads((Path(__file__).with_name("prometheusrule.schema.json")).read_text())
# Prometheus Operator kinds: no schema in kubernetes-validate, so each has one written here.
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}
WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error


def test_chart_floor_matches_the_validated_versions():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={MIN_KUBE}-0"
    assert MIN_KUBE in kv_utils.all_versions()


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_manifests_match_the_kubernetes_schemas(name, kube):
    docs = manifests(VALUE_SETS[name])
    assert docs, name
    for doc in docs:
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']} on Kubernetes {kube}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.absolute_path))}")


def test_all_value_sets_cover_every_template():
    kinds = {d["kind"] for values in VALUE_SETS.values() for d in manifests(values)}
    assert kinds == {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "ServiceMonitor",
                     "PrometheusRule", "HorizontalPodAutoscaler", "NetworkPolicy"}
    templates = sorted(p.name for p in (CHART / "templates").glob("*.yaml"))
    assert len(templates) == len(kinds), templates  # one object kind per template file


def test_the_validators_catch_broken_manifests():
    """Guards the check above against passing vacuously."""
    dep = next(d for d in manifests() if d["kind"] == "Deployment")
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kv_utils.latest_version(), strict=True)
    bad = json.loads(json.dumps(dep))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "ninety"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kv_utils.latest_version(), strict=True)
    sm = next(d for d in manifests({"serviceMonitor": {"enabled": True}}) if d["kind"] == "ServiceMonitor")
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)
    rule = next(d for d in manifests({"prometheusRule": {"enabled": True}}) if d["kind"] == "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["anotations"] = {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, PROMETHEUS_RULE_SCHEMA)


def _lint_findings(report: dict) -> list[str]:
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= WARNING] + report["errors"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_is_clean(name):
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace="rl", kube_version=f"v{MIN_KUBE}")
    assert report["total_charts_linted"] == 1
    assert _lint_findings(report) == []


def test_helm_lint_reports_a_broken_template(tmp_path):
    """Guards the lint check against passing vacuously."""
    broken = tmp_path / "packscore"
    shutil.copytree(CHART, broken)
    service = broken / "templates" / "service.yaml"
    service.write_text(service.read_text().replace("{{ .Values.service.type }}", "{{ .Values.service.type "))
    assert _lint_findings(helm.lint(broken, strict=True)) != []
