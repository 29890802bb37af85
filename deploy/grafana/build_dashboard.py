"""Writes packscore-dashboard.json, the Grafana dashboard for the `packscore_` metrics.

The JSON is committed; tests/deploy checks that it equals this script's output, so
edit the panels here and run:

    python deploy/grafana/build_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("packscore-dashboard.json")

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
RATE = "$__rate_interval"


def _target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, table: bool = False) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
    if table:
        t["format"] = "table"
    return t


def _quantiles(metric: str, by: str = "", qs=(0.5, 0.9, 0.99)) -> list[dict]:
    """histogram_quantile targets over `<metric>_bucket`, one per quantile."""
    group = f"le{', ' + by if by else ''}"
    label = f"{{{{{by}}}}} " if by else ""
    return [
        _target(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"{label}p{round(q * 100)}",
            chr(ord("A") + i),
        )
        for i, q in enumerate(qs)
    ]


def _mean(metric: str, legend: str, ref: str, by: str = "") -> dict:
    group = f" by ({by})" if by else ""
    return _target(
        f"sum{group} (rate({metric}_sum{{{SEL}}}[{RATE}])) / sum{group} (rate({metric}_count{{{SEL}}}[{RATE}]))",
        legend,
        ref,
    )


class _Layout:
    """Assigns panel ids and grid positions: rows of panels 24 units wide."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "id": len(self.panels) + 1, "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel = {"id": len(self.panels) + 1, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
                 "datasource": DS, **panel}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        self.y += self.row_h
        self.x = 0
        self.row_h = 0


def _stat(title: str, expr: str, unit: str, description: str, thresholds=None) -> dict:
    steps = thresholds or [{"color": "green", "value": None}]
    return {
        "type": "stat", "title": title, "description": description,
        "targets": [_target(expr)],
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto"},
    }


def _series(title: str, targets: list[dict], unit: str, description: str, *, stack: bool = False) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 30,
              "showPoints": "never", "spanNulls": False}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": "timeseries", "title": title, "description": description, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _info_table(title: str, metric: str, labels: list[str], description: str) -> dict:
    keep = ["instance", *labels]
    return {
        "type": "table", "title": title, "description": description,
        "targets": [_target(f"max by (instance, {', '.join(labels)}) ({metric}{{{SEL}}})", instant=True, table=True)],
        "transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {name: i for i, name in enumerate(keep)},
        }}],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
    }


def build() -> dict:
    g = _Layout()

    g.row("Overview")
    g.add(_stat("Ready pods", f"sum(packscore_ready{{{SEL}}})", "none",
                "Pods whose /readyz passes: model loaded, workers alive, a real scoring pass succeeded.",
                [{"color": "red", "value": None}, {"color": "green", "value": 1}]), 4, 4)
    g.add(_stat("Workers alive", f"sum(packscore_workers_alive{{{SEL}}})", "none",
                "GPU worker processes alive, summed over pods."), 4, 4)
    g.add(_stat("Tokens scored / s", f"sum(rate(packscore_tokens_scored_total{{{SEL}}}[{RATE}]))", "short",
                "Tokens whose log-probability was returned, per second."), 4, 4)
    g.add(_stat("Requests / s", f"sum(rate(packscore_requests_total{{{SEL}}}[{RATE}]))", "reqps",
                "HTTP requests by route and status: every answer, and under 499 those whose client left before it."), 4, 4)
    g.add(_stat("5xx ratio",
                f'sum(rate(packscore_requests_total{{{SEL}, status=~"5.."}}[{RATE}])) '
                f"/ sum(rate(packscore_requests_total{{{SEL}}}[{RATE}]))",
                "percentunit",
                "Share of answers with a 5xx status. 503 (not ready, draining, too many connections) and "
                "504 (deadline) are expected in small numbers; any other 5xx is a bug.",
                [{"color": "green", "value": None}, {"color": "orange", "value": 0.01},
                 {"color": "red", "value": 0.05}]), 4, 4)
    g.add(_stat("Queued tokens", f"sum(packscore_queued_tokens{{{SEL}}})", "short",
                "Tokens admitted and not yet scored (waiting or in a forward), summed over pods (what the HPA "
                "scales on)."), 4, 4)

    g.row("Traffic")
    g.add(_series("Requests / s by route and status",
                  [_target(f"sum by (route, status) (rate(packscore_requests_total{{{SEL}}}[{RATE}]))",
                           "{{route}} {{status}}")],
                  "reqps", "HTTP answers per second, by route and status code."), 12, 8)
    g.add(_series("Tokens scored / s by pod",
                  [_target(f"sum by (instance) (rate(packscore_tokens_scored_total{{{SEL}}}[{RATE}]))",
                           "{{instance}}")],
                  "short", "Scoring throughput of each pod.", stack=True), 12, 8)
    g.add(_series("Rejections / s by reason", [
        _target(f"sum by (reason) (rate(packscore_rejections_total{{{SEL}}}[{RATE}]))", "{{reason}}", "A"),
        _target(f"sum(rate(packscore_send_timeouts_total{{{SEL}}}[{RATE}]))", "send timeout (connection dropped)", "B"),
        _target(f"sum by (reason) (rate(packscore_connections_closed_total{{{SEL}}}[{RATE}]))",
                "connection closed: {{reason}}", "C"),
    ], "reqps", "Requests refused or failed, by error type (queue full, too large, invalid, unauthorised, draining, "
                "deadline, client gone...), answers dropped because the client stopped reading (--send-timeout-s), "
                "and connections the HTTP layer closed itself: over --max-connections (refused or evicted), not valid "
                "HTTP/1.1, or too slow to arrive (--request-read-timeout-s).",
        stack=True), 12, 8)
    g.add(_series("Queue", [
        _target(f"sum by (instance) (packscore_queued_tokens{{{SEL}}})", "{{instance}} tokens", "A"),
        _target(f"sum by (instance) (packscore_queued_sequences{{{SEL}}})", "{{instance}} sequences", "B"),
    ], "short", "Admitted work not yet scored (waiting or in a forward), per pod. A queue that stays high means "
                "too few GPUs."), 12, 8)

    g.row("Latency")
    g.add(_series("Request latency by route", _quantiles("packscore_request_latency_seconds", "route"), "s",
                  "End-to-end HTTP latency (p50, p90, p99) per route."), 8, 8)
    g.add(_series("Queue wait", _quantiles("packscore_queue_wait_seconds"), "s",
                  "Time from a request asking for room (admission) until its sequence enters a forward."), 8, 8)
    g.add(_series("Forward time", _quantiles("packscore_forward_seconds"), "s",
                  "Time of one packed forward on the GPUs."), 8, 8)

    g.row("Batching")
    g.add(_series("Tokens per forward", [
        *_quantiles("packscore_batch_tokens", qs=(0.5, 0.9)),
        _mean("packscore_batch_tokens", "mean", "C"),
    ], "short", "Tokens one forward ran, a shared prefix once (the budget is --max-batch-tokens)."), 12, 8)
    g.add(_series("Batch fill ratio", [
        _mean("packscore_batch_fill_ratio", "mean", "A"),
        _target(f"histogram_quantile(0.1, sum by (le) (rate(packscore_batch_fill_ratio_bucket{{{SEL}}}[{RATE}])))",
                "p10", "B"),
    ], "percentunit", "Tokens a forward ran over its budget, --max-batch-tokens. Low fill at high load: raise "
                      "--max-wait-ms; low fill at low load is expected."), 12, 8)
    g.add(_series("Prefix tokens saved / s", [
        _target(f"sum by (model) (rate(packscore_prefix_tokens_saved_total{{{SEL}}}[{RATE}]))", "{{model}} saved", "A"),
        _target(f"sum by (model) (rate(packscore_tokens_scored_total{{{SEL}}}[{RATE}]))", "{{model}} scored", "B"),
    ], "short", "Tokens not run because sequences of a row shared them as a prefix (a GRPO group's prompt), "
                "beside the tokens scored."), 24, 8)

    g.row("Weights and rollout mismatch")
    g.add(_stat("Models awaiting weights", f"sum(packscore_weights_awaited{{{SEL}}})", "none",
                "Models whose --weights-record checkpoint could not be served at start: the pod scores nothing and "
                "stays not ready until a weight update of that model arrives (alert PackscoreAwaitingWeights).",
                [{"color": "green", "value": None}, {"color": "red", "value": 1}]), 4, 8)
    g.add(_stat("Record write failures", f"sum(increase(packscore_weights_record_failures_total{{{SEL}}}[$__range]))",
                "none", "Updates that serve but could not be written to --weights-record in the time range: a restart "
                "would serve the update recorded before (or --model). The log's ERROR line says why.",
                [{"color": "green", "value": None}, {"color": "red", "value": 1}]), 4, 8)
    g.add(_series("Weight updates by outcome",
                  [_target(f"sum by (model, outcome) (increase(packscore_weights_updates_total{{{SEL}}}[{RATE}]))",
                           "{{model}} {{outcome}}")],
                  "none", "POST /v1/weights answers per interval: ok, or the error type of a failed update (the old "
                          "version keeps serving; alert PackscoreWeightsUpdateFailed).", stack=True), 8, 8)
    g.add(_series("Weight update load and swap", [
        _mean("packscore_weights_load_seconds", "{{model}} load", "A", "model"),
        _mean("packscore_weights_swap_seconds", "{{model}} swap", "B", "model"),
    ], "s", "Mean per update: load, from the request to the new weights ready beside the old (the old version "
            "serves meanwhile); swap, the pause between two forwards."), 8, 8)
    g.add(_series("Rollout mismatch |d|", [
        _target(f"histogram_quantile(0.5, sum by (le, model) "
                f"(rate(packscore_rollout_mean_abs_diff_bucket{{{SEL}}}[{RATE}])))", "{{model}} mean |d| p50", "A"),
        _target(f"histogram_quantile(0.9, sum by (le, model) "
                f"(rate(packscore_rollout_mean_abs_diff_bucket{{{SEL}}}[{RATE}])))", "{{model}} mean |d| p90", "B"),
        _target(f"histogram_quantile(0.9, sum by (le, model) "
                f"(rate(packscore_rollout_max_abs_diff_bucket{{{SEL}}}[{RATE}])))", "{{model}} max |d| p90", "C"),
    ], "none", "Per sequence sent with rollout_logprobs, d = packscore's log-prob - the rollout engine's: the "
               "training/inference drift. A rise after a weight update: the rollout engine and packscore serve "
               "different weights."), 12, 8)
    g.add(_series("Rollout mismatch k3 KL", [
        _mean("packscore_rollout_k3_kl", "{{model}} mean", "A", "model"),
        _target(f"histogram_quantile(0.9, sum by (le, model) "
                f"(rate(packscore_rollout_k3_kl_bucket{{{SEL}}}[{RATE}])))", "{{model}} p90", "B"),
    ], "none", "Per sequence, mean(exp(d) - 1 - d): the k3 estimate of KL(rollout || served model)."), 12, 8)

    g.row("Pods")
    g.add(_series("Ready and workers alive by pod", [
        _target(f"max by (instance) (packscore_ready{{{SEL}}})", "{{instance}} ready", "A"),
        _target(f"max by (instance) (packscore_workers_alive{{{SEL}}})", "{{instance}} workers", "B"),
        _target(f"sum by (instance) (increase(packscore_worker_restarts_total{{{SEL}}}[{RATE}]))",
                "{{instance}} worker restarts", "C"),
    ], "none", "Readiness (0/1), live worker processes and worker-pool restarts (a worker lost and replaced, "
       "which a scrape between may never see as a drop) of each pod."), 24, 8)
    g.add(_info_table("Served model", "packscore_model_info",
                      ["model", "architecture", "dtype", "device", "weights_version"],
                      "What each pod serves: model, architecture, dtype, device, weights version."), 12, 6)
    g.add(_info_table("Kernels", "packscore_kernel_info", ["model", "family", "backend"],
                      "Kernel backend per family. A GPU pod on a reference (CPU-style) backend is a bug."), 8, 6)
    g.add(_stat("Slow kernel fallback", f"max(packscore_slow_kernel_fallback{{{SEL}}})", "none",
                "1 when some pod runs a kernel family on the slow per-sequence reference implementation "
                "(only possible with --allow-slow-kernels).",
                [{"color": "green", "value": None}, {"color": "red", "value": 1}]), 4, 6)
    g.add(_info_table("Parallel layout", "packscore_parallel_info", ["model", "world_size", "dp", "sp", "fsdp"],
                      "Workers of each pod and model: world size, data-parallel groups, sequence-parallel degree, FSDP."),
          24, 6)

    def var(name: str, query: str, label: str) -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DS,
                "definition": query, "query": {"query": query, "refId": f"{name}-query"},
                "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "sort": 1, "hide": 0, "options": []}

    return {
        "uid": "packscore-overview",
        "title": "packscore",
        "description": "Scoring service for RL trainers: traffic, latency, batching, weight updates, rollout "
                       "mismatch and fleet state from the packscore_ metrics.",
        "tags": ["packscore", "gpu", "rl"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            var("job", "label_values(packscore_ready, job)", "Job"),
            var("instance", 'label_values(packscore_ready{job=~"$job"}, instance)', "Instance"),
        ]},
        "panels": g.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
