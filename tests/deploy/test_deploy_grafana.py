"""The Grafana dashboard: generated from its script, valid PromQL, only the documented packscore_ metrics."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest

from deploy_helpers import REPO, exported_series, load_module, vector_selectors

DASHBOARD = REPO / "deploy" / "grafana" / "packscore-dashboard.json"
builder = load_module(REPO / "deploy" / "grafana" / "build_dashboard.py")

# The server process's own series (CPU, memory, descriptors): the alerts read its start time; no panel needs them.
NOT_PANELLED = {"packscore_process_"}
# Labels every series gets from the scrape, not from the service.
SCRAPE_LABELS = {"job", "instance"}
# Grafana substitutes these before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "3h"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def parse(expr: str) -> promql_parser.Expr:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return promql_parser.parse(expr)


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    return vector_selectors(parse(expr))


def test_committed_json_is_the_generator_output():
    assert DASHBOARD.read_text() == builder.render(), "run: python deploy/grafana/build_dashboard.py"


def test_every_query_is_valid_promql(dashboard):
    assert len(queries(dashboard)) >= 20
    for title, expr in queries(dashboard):
        try:
            parse(expr)
        except ValueError as e:
            pytest.fail(f"{title}: {expr}: {e}")


def test_the_parser_rejects_broken_promql():
    """Guards the check above against passing vacuously."""
    with pytest.raises(ValueError, match="unclosed"):
        parse("sum(rate(packscore_requests_total[$__rate_interval])")


def _family(series: str, exported: dict) -> str:
    """A series' metric name as the service declares it: a histogram's without _bucket/_sum/_count."""
    base = series.rsplit("_", 1)[0]
    return base if series.endswith(("_bucket", "_sum", "_count")) and exported[series][0] == "histogram" else series


def test_every_metric_used_is_exported_and_every_exported_one_has_a_panel(dashboard):
    """Ties the dashboard (and the HPA metric) to service/http/metrics.py: a metric added there gets a panel."""
    exported = exported_series()
    used = {s.name for _, expr in queries(dashboard) for s in selectors(expr)}
    assert used <= set(exported), used - set(exported)
    assert exported["packscore_queued_tokens"][0] == "gauge"  # what the chart's HPA averages per pod
    families = {_family(name, exported) for name in exported if not name.startswith(tuple(NOT_PANELLED))}
    shown = {_family(name, exported) for name in used}
    assert families <= shown, f"no panel reads {sorted(families - shown)}"


def test_counters_and_histograms_are_read_as_rates(dashboard):
    exported = exported_series()
    cumulative = {n for n, (kind, _) in exported.items() if kind in ("counter", "histogram")}
    for title, expr in queries(dashboard):
        for s in selectors(expr):
            if s.name in cumulative:
                assert re.search(rf"\b(rate|increase)\({s.name}\{{", expr), f"{title}: {s.name} without rate(): {expr}"
        if "histogram_quantile(" in expr:
            assert re.search(r"by \(le\b", expr), f"{title}: quantile without le: {expr}"


def labels_of(metric: str) -> set[str]:
    return SCRAPE_LABELS | set(exported_series()[metric][1])


def test_labels_in_queries_exist_on_the_metrics(dashboard):
    by_clause = re.compile(r"by \(([^)]*)\)")
    for title, expr in queries(dashboard):
        metrics = [s.name for s in selectors(expr)]
        available = set().union(*map(labels_of, metrics))
        for group in by_clause.findall(expr):
            labels = {label.strip() for label in group.split(",")}
            assert labels <= available, f"{title}: {labels - available} not on {metrics}"
        for s in selectors(expr):
            names = {m.name for m in s.matchers.matchers} - {"__name__"}
            assert names <= labels_of(s.name), f"{title}: {names} on {s.name}"


def test_panels_are_laid_out_without_overlap(dashboard):
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_every_panel_uses_the_datasource_variable_and_filters(dashboard):
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p.get("description"), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])
    assert dashboard["uid"] == "packscore-overview"
