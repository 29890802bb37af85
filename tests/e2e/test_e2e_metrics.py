"""GET /metrics of a real server as an operator's Prometheus reads it: every name under ``packscore_``,
types and units in the names, every series documented in docs/deployment.md with its labels and every
documented one exported, the series ``rate()`` needs there before their first event, and no label
value a request can add."""

from __future__ import annotations

import math
import uuid

import httpx
import pytest

from service.http.metrics import (
    CONNECTION_CLOSE_REASONS,
    REJECTION_REASONS,
    UNNAMED_UPDATE_OUTCOMES,
    UPDATE_OUTCOMES,
    WEIGHTS_REJECTION_REASONS,
)
from tests.e2e.helpers import AUTH
from tests.live_metrics import SERVED, Scrape, documented, exercise, full_server, scrape


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The full server, scraped once right after it is ready (``at_start``) and once exercised (``after``)."""
    server = full_server(tmp_path_factory.mktemp("metrics"))
    try:
        server.wait_ready(timeout=240)
        at_start = scrape(server.url)
        exercise(server.url)
        yield server, at_start, scrape(server.url)
    finally:
        server.stop()


def test_every_name_is_packscores_and_says_its_type_and_unit(server):
    _, _, after = server
    for family in after.families():
        assert family.name.startswith("packscore_"), family.name
        for sample in family.samples:
            name = sample.name
            assert name.startswith("packscore_"), name
            assert name.endswith("_total") == (family.type == "counter"), f"{name} is a {family.type}"
            if family.type == "histogram":
                assert name.endswith(("_bucket", "_sum", "_count")), name
            # A time is in seconds and says so, a size in bytes likewise.
            unit = family.name.removesuffix("_total")
            if "seconds" in unit or "time" in family.documentation.lower().split()[:2]:
                assert unit.endswith("_seconds"), f"{family.name}: a time without _seconds"
            if "bytes" in unit or "in bytes" in family.documentation:
                assert unit.endswith("_bytes"), f"{family.name}: a size without _bytes"
            assert "_ms" not in name and "millis" not in name, name


def test_every_exported_series_is_documented_with_its_labels_and_type(server):
    _, _, after = server
    table = documented()
    live = after.series()
    expanded = {sample: (name, row) for name, row in table.items() for sample in row.sample_names(name)}
    undocumented = sorted(set(live) - set(expanded))
    assert not undocumented, f"exported, not in docs/deployment.md's metrics table: {undocumented}"
    missing = sorted(set(expanded) - set(live))
    assert not missing, f"in docs/deployment.md's metrics table, not on a live server's /metrics: {missing}"
    types = {s.name: f.type for f in after.families() for s in f.samples}
    for sample, (name, row) in expanded.items():
        want = row.labels | ({"le"} if sample.endswith("_bucket") else set())
        assert live[sample] == want, f"{sample}: documented labels {sorted(want)}, exported {sorted(live[sample])}"
        kind = "gauge" if row.kind == "info" else row.kind
        assert types[sample] == kind, f"{name}: documented as {row.kind}, exported as {types[sample]}"
        assert (row.kind == "info") == name.endswith("_info"), name


def test_the_series_rate_reads_are_there_before_their_first_event(server):
    _, at_start, _ = server
    for model in SERVED:
        for name in ("packscore_tokens_scored_total", "packscore_prefix_tokens_saved_total",
                     "packscore_forward_seconds_count", "packscore_queue_wait_seconds_count",
                     "packscore_rollout_k3_kl_count", "packscore_weights_load_seconds_count",
                     "packscore_weights_swap_seconds_count", "packscore_weights_record_failures_total"):
            assert at_start.value(name, model=model) is not None, f"{name}{{model={model!r}}} absent at start"
        for outcome in UPDATE_OUTCOMES:  # PackscoreWeightsUpdateFailed rates every outcome but ok
            assert at_start.value("packscore_weights_updates_total", model=model, outcome=outcome) == 0.0, (model, outcome)
        assert at_start.value("packscore_weights_awaited", model=model) == 0.0, model
    for reason in (*REJECTION_REASONS, *WEIGHTS_REJECTION_REASONS):  # the server serves POST /v1/weights
        assert at_start.value("packscore_rejections_total", reason=reason) == 0.0, reason
    for outcome in UNNAMED_UPDATE_OUTCOMES:
        assert at_start.value("packscore_weights_updates_total", model="", outcome=outcome) == 0.0, outcome
    assert at_start.value("packscore_send_timeouts_total") == 0.0
    for reason in CONNECTION_CLOSE_REASONS:
        assert at_start.value("packscore_connections_closed_total", reason=reason) == 0.0, reason
    # What PackscoreServerErrors and PackscoreRefusingRequests rate: their first answer counts too.
    for route in ("/score", "/v1/score", "/v1/weights", "/metrics", "/v1/models", "/readyz", "other"):
        assert at_start.value("packscore_requests_total", route=route, status="500") == 0.0, route
    for route in ("/score", "/v1/score"):
        for status in ("200", "429", "503", "504"):
            assert at_start.value("packscore_requests_total", route=route, status=status) is not None, (route, status)


def _hostile_round(url: str, tag: str) -> None:
    """Requests whose model names, paths, content types, methods and ids are the client's own text."""
    ids = {"X-Request-Id": f"rid-{tag}"}
    json_type = {**AUTH, **ids, "Content-Type": "application/json"}
    body = b'{"model": "m-%s", "sequences": [{"input_ids": [1, 2]}]}' % tag.encode()
    answers = [
        httpx.post(url + "/score", content=body, headers=json_type),
        httpx.post(url + "/v1/score", content=b"{}", headers={**AUTH, **ids, "Content-Type": f"application/x-{tag}"}),
        httpx.post(url + "/score", content=b"{}", headers={**json_type, "Content-Encoding": f"enc-{tag}"}),
        httpx.get(url + f"/score/{tag}", headers=AUTH),
        httpx.get(url + f"/{tag}?q={tag}", headers=AUTH),
        httpx.request(f"X{tag[:6].upper()}", url + "/score", headers=AUTH),
        httpx.post(url + "/score", content=body, headers={"Authorization": f"Bearer {tag}"}),
        httpx.post(url + "/v1/weights", json={"model": f"m-{tag}", "path": f"p-{tag}"}, headers=AUTH),
        httpx.post(url + "/v1/weights", json={"model": "policy", "path": f"p-{tag}", "version": f"v-{tag}"},
                   headers=AUTH),
        httpx.post(url + "/v1/weights", content=f"{tag}".encode(), headers={**AUTH, "Content-Type": f"text/{tag}"}),
    ]
    assert all(a.status_code >= 400 for a in answers), [(a.request.url, a.status_code) for a in answers]


def test_no_request_adds_a_label_value(server):
    """A second round of the same hostile requests, every string new, adds no series, and no label
    value anywhere holds a string a client sent."""
    srv, _, _ = server
    first, second = uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]
    _hostile_round(srv.url, first)
    before = scrape(srv.url)
    _hostile_round(srv.url, second)
    after = scrape(srv.url)
    new = {(name, labels) for name, labels in after.samples() - before.samples()}
    assert not new, f"series a request added: {sorted(new)[:10]}"
    for family in after.families():
        for sample in family.samples:
            for label, value in sample.labels.items():
                assert first not in value and second not in value, f"{sample.name}: {label}={value!r} from a request"
    models = {v for f in after.families() for s in f.samples for k, v in s.labels.items() if k == "model"}
    assert models == {*SERVED, ""}, models


def test_every_reason_a_request_met_was_at_zero_from_the_start(server):
    """rate() over a series that appears with its first event misses that event: the refusals met by
    the requests of these tests (a wrong path or method included) had their series from the start."""
    srv, at_start, _ = server
    _hostile_round(srv.url, uuid.uuid4().hex[:12])
    met = {s.labels["reason"] for f in scrape(srv.url).families() for s in f.samples
           if s.name == "packscore_rejections_total" and s.value > 0}
    there = {s.labels["reason"] for f in at_start.families() for s in f.samples if s.name == "packscore_rejections_total"}
    assert {"not_found", "method_not_allowed", "model_not_found"} <= met, met  # the round met them
    assert not met - there, f"no series at start for {sorted(met - there)}"


def test_every_weight_update_outcome_met_was_at_zero_from_the_start(server):
    """The updates of these tests, served and refused, for a model or before one is named, ended
    with outcomes whose series were there from the start: their first failure reaches increase()."""
    srv, at_start, _ = server
    _hostile_round(srv.url, uuid.uuid4().hex[:12])
    met = {(s.labels["model"], s.labels["outcome"]) for f in scrape(srv.url).families() for s in f.samples
           if s.name == "packscore_weights_updates_total" and s.value > 0}
    there = {(s.labels["model"], s.labels["outcome"]) for f in at_start.families() for s in f.samples
             if s.name == "packscore_weights_updates_total"}
    assert {("policy", "ok"), ("policy", "forbidden_path"), ("", "model_not_found"),
            ("", "unsupported_content_type")} <= met, met  # what the rounds and exercise() sent
    assert not met - there, f"no series at start for {sorted(met - there)}"


def test_an_update_sent_again_is_answered_as_before_and_counted_once(server):
    """A trainer that lost an update's answer sends it again (docs/weights.md): the same `path` and
    `version` get the first answer, and packscore_weights_updates_total counts one update, not two;
    packscore_requests_total counts both requests, and the log says it was a repeat."""
    srv, _, _ = server
    before = scrape(srv.url)
    again = httpx.post(srv.url + "/v1/weights", json={"model": "policy", "path": "step-1", "version": "s1"},
                       headers=AUTH, timeout=300)  # exercise()'s update, served since
    assert again.status_code == 200 and again.json()["weights_version"] == "s1", again.text
    after = scrape(srv.url)

    def added(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert added("packscore_requests_total", route="/v1/weights", status="200") == 1.0
    assert added("packscore_weights_load_seconds_count", model="policy") == 0.0, "the update sent again was loaded"
    ok = added("packscore_weights_updates_total", model="policy", outcome="ok")
    assert ok == 0.0, f"an update sent again counted as {ok:g} more update(s)"
    assert "weights update of policy to s1 repeated" in srv.log(), srv.log()


def _histograms(scrape_: Scrape) -> dict[tuple, dict]:
    """Each histogram series (name and labels but ``le``): its buckets as (le, count), its _sum and _count."""
    out: dict[tuple, dict] = {}
    for family in scrape_.families():
        if family.type != "histogram":
            continue
        for sample in family.samples:
            key = (family.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le")))
            series = out.setdefault(key, {"buckets": []})
            if sample.name.endswith("_bucket"):
                series["buckets"].append((float(sample.labels["le"]), sample.value))
            else:
                series[sample.name.removeprefix(family.name)] = sample.value
    return out


def test_histograms_agree_with_themselves_and_counters_never_went_down(server):
    """What histogram_quantile() and rate() assume of every series, on a server exercised by these
    tests (answers of every kind, a weight update, hostile requests): cumulative buckets ending at
    +Inf with _count, a finite _sum of non-negative observations, no counter or count lower than at
    start, and one latency sample per answer packscore_requests_total counts, route by route."""
    srv, at_start, _ = server
    _hostile_round(srv.url, uuid.uuid4().hex[:12])
    now = scrape(srv.url)
    histograms = _histograms(now)
    assert len(histograms) > 20, sorted(histograms)  # per model, per route, the weight updates' too
    for (name, labels), series in histograms.items():
        buckets = sorted(series["buckets"])
        counts = [count for _, count in buckets]
        assert buckets and buckets[-1][0] == math.inf, (name, labels, buckets)
        assert counts == sorted(counts), f"{name}{labels}: buckets not cumulative {buckets}"
        assert counts[-1] == series["_count"], f"{name}{labels}: +Inf {counts[-1]}, _count {series['_count']}"
        assert math.isfinite(series["_sum"]) and series["_sum"] >= 0, (name, labels, series["_sum"])
        assert series["_count"] > 0 or series["_sum"] == 0, (name, labels, series)
    kinds = {s.name: f.type for f in now.families() for s in f.samples}
    went_down = [(name, labels, at_start.value(name, **dict(labels)), now.value(name, **dict(labels)))
                 for name, labels in at_start.samples()
                 if kinds.get(name) == "counter" or (kinds.get(name) == "histogram" and not name.endswith("_sum"))
                 if (now.value(name, **dict(labels)) or 0.0) < at_start.value(name, **dict(labels))]
    assert not went_down, went_down
    answers: dict[str, float] = {}
    timed: dict[str, float] = {}
    for family in now.families():
        for sample in family.samples:
            if sample.name == "packscore_requests_total":
                answers[sample.labels["route"]] = answers.get(sample.labels["route"], 0.0) + sample.value
            elif sample.name == "packscore_request_latency_seconds_count":
                timed[sample.labels["route"]] = sample.value
    routes = {route for route, n in answers.items() if n} | set(timed)
    assert {route: (answers.get(route, 0.0), timed.get(route, 0.0)) for route in routes
            if answers.get(route, 0.0) != timed.get(route, 0.0)} == {}
