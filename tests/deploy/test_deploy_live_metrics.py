"""The Grafana dashboard and the chart's alerts read series and labels that a real server's GET /metrics
carries (two models, --weights-root, --weights-record, an update served and one refused), not only
what service/http/metrics.py declares."""

from __future__ import annotations

import json
import operator
import re

import promql_parser
import pytest

from deploy_helpers import vector_selectors
from test_deploy_alerts import TARGET_LABELS, VARIANTS, alerts, matchers
from test_deploy_grafana import DASHBOARD, SCRAPE_LABELS, queries
from test_deploy_grafana import selectors as dashboard_selectors
from tests.live_metrics import exercise, full_server, scrape

GROUPING = re.compile(r"\b(?:by|on|ignoring) \(([^)]*)\)")
# Series Prometheus writes itself, with the labels it gives them.
PROMETHEUS_SERIES = {"up": set()}
# Label values the expressions pick, whose absence from every live sample means a query that finds nothing.
VALUE_LABELS = ("route", "outcome", "reason")


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory):
    """GET /metrics of a fresh pod (ready, nothing asked of it yet), and once exercised."""
    server = full_server(tmp_path_factory.mktemp("live-metrics"))
    try:
        server.wait_ready(timeout=240)
        at_start = scrape(server.url)
        exercise(server.url)
        yield at_start, scrape(server.url)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live(scrapes):
    return scrapes[1]


def _check(where: str, expr: str, found: list, live, outside: set[str]) -> None:
    series = {**live.series(), **PROMETHEUS_SERIES}
    samples = [(s.name, s.labels) for f in live.families() for s in f.samples]
    assert found, f"{where}: no series in {expr}"
    for s in found:
        assert s.name in series, f"{where}: {s.name} is not on a live server's /metrics"
        named = set(matchers(s)) - {"__name__"} - outside
        assert named <= series[s.name], f"{where}: {sorted(named - series[s.name])} not labels of {s.name}"
        for m in s.matchers.matchers:
            if m.name in VALUE_LABELS and str(m.op) in ("MatchOp.Equal", "MatchOp.Re"):
                hit = any(name == s.name and re.fullmatch(m.value, labels.get(m.name, "")) for name, labels in samples)
                assert hit, f"{where}: no live {s.name} has {m.name} matching {m.value!r}"
    available = set().union(*(series[s.name] for s in found)) | outside
    for group in GROUPING.findall(expr):
        labels = {label.strip() for label in group.split(",")} - {"le"}
        assert labels <= available, f"{where}: {sorted(labels - available)} not on {[s.name for s in found]}"


def test_every_dashboard_query_reads_what_a_live_server_exports(live):
    dashboard = json.loads(DASHBOARD.read_text())
    for title, expr in queries(dashboard):
        _check(title, expr, dashboard_selectors(expr), live, SCRAPE_LABELS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_alert_reads_what_a_live_server_exports(live, variant):
    values = VARIANTS[variant]
    custom = set(re.findall(r"(\w+)=", values["prometheusRule"].get("selector", "")))
    for name, rule in alerts(values).items():
        _check(name, rule["expr"], vector_selectors(promql_parser.parse(rule["expr"])), live, TARGET_LABELS | custom)


_COMPARISONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
                "!=": operator.ne}
_MATCHES = {"MatchOp.Equal": lambda v, m: v == m, "MatchOp.NotEqual": lambda v, m: v != m,
            "MatchOp.Re": lambda v, m: re.fullmatch(m, v) is not None,
            "MatchOp.NotRe": lambda v, m: re.fullmatch(m, v) is None}


def _picked(node, scrape, outside: set[str]) -> list[tuple[str, dict, float]]:
    """The samples of a pod's scrape an instant selector, or one compared with a number, keeps
    (the labels Prometheus adds, ``outside``, match any value)."""
    node = getattr(node, "expr", node) if isinstance(node, promql_parser.ParenExpr) else node
    if isinstance(node, promql_parser.BinaryExpr) and str(node.op) in _COMPARISONS \
            and isinstance(node.rhs, promql_parser.NumberLiteral):
        keep = _COMPARISONS[str(node.op)]
        return [s for s in _picked(node.lhs, scrape, outside) if keep(s[2], node.rhs.val)]
    assert isinstance(node, promql_parser.VectorSelector), f"cannot evaluate {node} on one scrape"
    wanted = [m for m in node.matchers.matchers if m.name not in outside | {"__name__"}]
    return [(s.name, s.labels, s.value) for f in scrape.families() for s in f.samples if s.name == node.name
            and all(_MATCHES[str(m.op)](s.labels.get(m.name, ""), m.value) for m in wanted)]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_alert_fires_on_a_fresh_pods_series_at_zero(scrapes, variant):
    """``A unless B offset window`` fires for every series of A on a pod younger than the window (B
    has no sample then): A must leave out the series the server writes at 0 from the start."""
    at_start, _ = scrapes
    values = VARIANTS[variant]
    custom = set(re.findall(r"(\w+)=", values["prometheusRule"].get("selector", "")))
    for name, rule in alerts(values).items():
        terms = []

        def visit(node, *_):
            if isinstance(node, promql_parser.BinaryExpr) and str(node.op) == "unless":
                terms.append(node.lhs)

        promql_parser.walk(promql_parser.parse(rule["expr"]), visit)
        for term in terms:
            fired = _picked(term, at_start, TARGET_LABELS | custom)
            assert not fired, f"{name} fires on a fresh pod that did nothing: {fired[:5]}"
