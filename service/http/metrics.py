"""Every metric the service exports, in one per-app registry (never prometheus_client's global one).

The names are an interface: the Grafana dashboard, the Helm chart's alerts and HPA and the table in
docs/deployment.md reference them (tests/e2e/test_e2e_metrics.py, tests/deploy check it). Change one
only together with those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, SupportsFloat

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client import disable_created_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from model_runtime.scoring.backend import ModelInfo

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = tuple(2**i for i in range(6, 20))  # 64 .. 512k tokens
_MISMATCH_BUCKETS = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3, 10)
# A mismatch figure is observed at most this large: past the top bucket it counts the same, and
# a huge one (k3_kl reaches float32's largest) would make the histogram's _sum infinite, or too
# large for later observations to move it, for the rest of the process.
_MISMATCH_OBSERVED_MAX = 1e3
_FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 2.0, 8.0)  # > 1: an oversize sequence

CONTENT_TYPE = CONTENT_TYPE_LATEST
# packscore_rejections_total's reasons, at 0 from the start: every error type the service answers
# (tests/unit/test_metrics_rejection_series.py keeps the two lists equal to those the code raises).
REJECTION_REASONS = (
    "queue_full", "draining", "not_ready", "deadline_exceeded", "client_disconnected", "backend_unavailable",
    "sequence_too_large", "sequence_too_long", "request_too_large", "too_many_sequences", "body_too_large",
    "invalid_value", "malformed_body", "unsupported_content_type", "unsupported_content_encoding", "model_not_found",
    "unauthorized", "model_required", "weights_version_mismatch", "request_timeout", "non_finite_scores",
    "internal_error", "forbidden", "unavailable", "not_found", "method_not_allowed", "http_error", "malformed_request",
)  # fmt: skip
# Those only POST /v1/weights answers: at 0 from the start where that route is served (--weights-root).
WEIGHTS_REJECTION_REASONS = (
    "forbidden_path", "update_unsupported", "update_in_progress", "version_in_use", "incompatible_checkpoint",
    "incomplete_checkpoint", "unreadable_checkpoint", "non_finite_checkpoint",
)  # fmt: skip


# packscore_weights_updates_total's outcomes (service/http/weights.py and app.py count them), all at 0 from
# the start: those of an update that named a served model, and those of one refused before (model="").
UPDATE_OUTCOMES = (
    "ok", "invalid_value", "malformed_body", "forbidden_path", "update_unsupported", "update_in_progress",
    "version_in_use", "incompatible_checkpoint", "incomplete_checkpoint", "unreadable_checkpoint",
    "non_finite_checkpoint", "backend_unavailable", "internal_error",
)  # fmt: skip
UNNAMED_UPDATE_OUTCOMES = (
    "not_ready", "draining", "unsupported_content_type", "unsupported_content_encoding", "body_too_large",
    "request_timeout", "client_disconnected", "malformed_request", "malformed_body", "invalid_value", "model_not_found",
    "model_required", "internal_error",
)  # fmt: skip
# packscore_connections_closed_total's reasons: the answers and closes of service/http/protocol.py itself.
CONNECTION_CLOSE_REASONS = ("too_many_connections", "evicted", "malformed_request", "http_version_not_supported",
                            "request_timeout")

_MODEL = ["model"]  # the served model's name, on every series that belongs to one model


@dataclass(frozen=True)
class ModelMetrics:
    """The series of one served model, bound to its ``model`` label (what the scheduler records)."""

    tokens_scored: Counter
    prefix_tokens_saved: Counter
    queue_wait: Histogram
    forward_seconds: Histogram
    batch_tokens: Histogram
    batch_fill_ratio: Histogram


class Metrics:
    """The metric objects of one app; ``registry`` is what GET /metrics renders.

    Per-model series carry a ``model`` label; the process's own (CPU, memory, file descriptors)
    are ``packscore_process_*``. No ``_created`` series: nothing reads them and they double the
    samples of every counter and histogram.
    """

    def __init__(self) -> None:
        disable_created_metrics()  # a process-wide switch of prometheus_client
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(namespace="packscore", registry=r)
        self.requests = Counter(
            "packscore_requests_total",
            "HTTP answers, by route and status code, each request counted once (499: its client left before the answer).",
            ["route", "status"],
            registry=r,
        )
        # Not a status of packscore_requests_total: such a request was answered (200) and counted there.
        self.send_timeouts = Counter(
            "packscore_send_timeouts_total",
            "Connections closed because the client stopped reading an answer (nothing drained for --send-timeout-s).",
            registry=r,
        )
        self.connections_closed = Counter(
            "packscore_connections_closed_total",
            "Connections the HTTP protocol layer closed itself, by reason: a new one refused 503 over --max-connections "
            "(too_many_connections), an older one closed to make room (evicted), 400 for bytes that are not HTTP/1.1 "
            "(malformed_request), 400 for a request of another HTTP major version, such as HTTP/2.0 (http_version_not_supported), "
            "headers or body not arrived within --request-read-timeout-s (request_timeout).",
            ["reason"],
            registry=r,
        )
        for reason in CONNECTION_CLOSE_REASONS:
            self.connections_closed.labels(reason=reason)
        self.tokens_scored = Counter(
            "packscore_tokens_scored_total",
            "Tokens whose log-probability was returned to requests (positions score_from .. L-1); the readiness pass is not counted.",
            _MODEL,
            registry=r,
        )
        self.prefix_tokens_saved = Counter(
            "packscore_prefix_tokens_saved_total",
            "Tokens not run because sequences of a row shared them as a common prefix (run once per row).",
            _MODEL,
            registry=r,
        )
        self.rejections = Counter(
            "packscore_rejections_total",
            "Requests refused or failed, by reason (the error type: queue_full, sequence_too_large, invalid_value, ...); "
            'the protocol layer\'s own answers under route="other" are in packscore_connections_closed_total instead.',
            ["reason"],
            registry=r,
        )
        for reason in REJECTION_REASONS:  # zero series from the start, so rate() works on a fresh pod
            self.rejections.labels(reason=reason)
        self.request_latency = Histogram(
            "packscore_request_latency_seconds",
            "Time from a request's arrival to its answer, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "packscore_queue_wait_seconds",
            "Time a sequence waited from its request asking for room (in the admission bound) to the start of its forward "
            "(the readiness pass's sequence included).",
            _MODEL,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "packscore_forward_seconds",
            "Duration of one packed forward (the readiness pass's included).",
            _MODEL,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "packscore_batch_tokens",
            "Tokens one packed forward ran (a shared prefix once).",
            _MODEL,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_fill_ratio = Histogram(
            "packscore_batch_fill_ratio",
            "Tokens a forward ran (a shared prefix once) divided by its row budget, --max-batch-tokens (x --sp).",
            _MODEL,
            buckets=_FILL_BUCKETS,
            registry=r,
        )
        self.queued_tokens = Gauge(
            "packscore_queued_tokens", "Tokens admitted but not yet scored (waiting or in a forward).", registry=r
        )
        self.queued_sequences = Gauge(
            "packscore_queued_sequences", "Sequences admitted but not yet scored.", registry=r
        )
        self.ready = Gauge("packscore_ready", "1 when /readyz would answer 200, else 0.", registry=r)
        self.workers_alive = Gauge(
            "packscore_workers_alive",
            "Scoring worker processes alive, summed over the models (a one-process backend counts its world size "
            "while it lives).",
            registry=r,
        )
        # Read from the backends at scrape time: a worker lost and replaced between two scrapes leaves its count.
        self._worker_restarts: Callable[[], dict[str, float]] = dict
        r.register(_WorkerRestarts(lambda: self._worker_restarts()))
        self.model_info = Info("packscore_model", "The served model.", _MODEL, registry=r)  # packscore_model_info
        self.kernel_info = Info("packscore_kernel", "Kernel backend of each family.", [*_MODEL, "family"], registry=r)
        self.slow_kernel_fallback = Gauge(
            "packscore_slow_kernel_fallback",
            "1 when some kernel family on a GPU fell back to a slow per-sequence reference implementation "
            "(--allow-slow-kernels), else 0 (a CPU's reference kernels are no fallback).",
            _MODEL,
            registry=r,
        )
        self.parallel_info = Info("packscore_parallel", "Parallel layout of the workers.", _MODEL, registry=r)
        self.rollout_mean_abs_diff, self.rollout_max_abs_diff, self.rollout_k3_kl = (
            Histogram(
                f"packscore_rollout_{name}",
                f"Per sequence sent with rollout_logprobs and at least one scored position: {what}, "
                "d = packscore's log-prob - the rollout's.",
                ["model"],
                buckets=_MISMATCH_BUCKETS,
                registry=r,
            )
            for name, what in (
                ("mean_abs_diff", "mean |d| over its scored tokens"),
                ("max_abs_diff", "max |d| over its scored tokens"),
                ("k3_kl", "mean(exp(d) - 1 - d), the k3 estimate of KL(rollout || served model)"),
            )
        )
        self.weights_updates = Counter(
            "packscore_weights_updates_total",
            "POST /v1/weights updates, by model and outcome (ok: it serves, its request answered or cut off, "
            "once: a retry answered as before counts nothing; or the error type).",
            ["model", "outcome"],
            registry=r,
        )
        self.weights_load_seconds = Histogram(
            "packscore_weights_load_seconds",
            "Time from a weight update's request to the new weights ready beside the old.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.weights_record_failures = Counter(
            "packscore_weights_record_failures_total",
            "Weight updates that serve but could not be written to --weights-record (a restart would serve the "
            "update recorded before, or --model).",
            ["model"],
            registry=r,
        )
        self.weights_awaited = Gauge(
            "packscore_weights_awaited",
            "1 while the model's --weights-record checkpoint could not be served at start and it waits for a weight "
            "update (scoring nothing; the server not ready), else 0.",
            ["model"],
            registry=r,
        )
        self.weights_swap_seconds = Histogram(
            "packscore_weights_swap_seconds",
            "Pause between two forwards while a weight update swapped the weights.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def watch(
        self,
        *,
        queued_tokens: Callable[[], float],
        queued_sequences: Callable[[], float],
        ready: Callable[[], float],
        workers_alive: Callable[[], float],
        worker_restarts: Callable[[], dict[str, float]] = dict,
    ) -> None:
        """Gauges (and the restart counts, model -> restarts) read at scrape time, so they can never go stale."""
        self.queued_tokens.set_function(queued_tokens)
        self.queued_sequences.set_function(queued_sequences)
        self.ready.set_function(ready)
        self.workers_alive.set_function(workers_alive)
        self._worker_restarts = worker_restarts

    def for_model(self, name: str) -> ModelMetrics:
        return ModelMetrics(*(getattr(self, f).labels(model=name) for f in ModelMetrics.__dataclass_fields__))

    def observe_mismatch(self, model: str, figures: Mapping[str, SupportsFloat]) -> None:
        for histogram, name in ((self.rollout_mean_abs_diff, "mean_abs_diff"), (self.rollout_max_abs_diff, "max_abs_diff"),
                                (self.rollout_k3_kl, "k3_kl")):
            # a Python float: a float32 figure would turn the histogram's float sum into float32
            histogram.labels(model=model).observe(min(float(figures[name]), _MISMATCH_OBSERVED_MAX))

    def describe_model(self, info: ModelInfo, served_name: str) -> None:
        """The model's info series (again after a weight update: its weights_version changed), and its
        scoring series at zero: a dashboard and rate() find them from when the model is loaded."""
        self.for_model(served_name)
        self.model_info.labels(model=served_name).info(
            {
                "architecture": info.architecture,
                "dtype": info.dtype,
                "device": info.device,
                "weights_version": info.weights_version,
            }
        )
        for family, backend in info.kernels.items():
            self.kernel_info.labels(model=served_name, family=family).info({"backend": backend})
        self.slow_kernel_fallback.labels(model=served_name).set(1 if info.slow_kernels else 0)
        parallel = {k: str(info.parallel.get(k, "")).lower() for k in ("world_size", "dp", "sp", "fsdp")}
        self.parallel_info.labels(model=served_name).info(parallel)
        for histogram in (self.rollout_mean_abs_diff, self.rollout_max_abs_diff, self.rollout_k3_kl):
            histogram.labels(model=served_name)  # at zero from the start, so a dashboard finds the series

    def expect_answers(self, routes, score_routes) -> None:
        """The answers the chart's alerts rate (a 500 of any route, the scoring routes' 200 and refusals)
        at 0 from the start: rate() over a series that appears with its first answer never sees that answer."""
        for route in routes:
            self.requests.labels(route=route, status="500")
        for route in score_routes:
            for status in ("200", "429", "503", "504"):
                self.requests.labels(route=route, status=status)

    def expect_updates(self, model: str, *, recorded: bool) -> None:
        """The weight-update series of a model that can be updated (``--weights-root``), at zero from
        the start: ``rate()`` and ``increase()`` miss the first event of a series that appears with it.
        ``recorded``: ``--weights-record`` is set, so a record write can fail."""
        for outcome in UPDATE_OUTCOMES:
            self.weights_updates.labels(model=model, outcome=outcome)
        self.weights_load_seconds.labels(model=model)
        self.weights_swap_seconds.labels(model=model)
        if recorded:
            self.weights_record_failures.labels(model=model)

    def expect_weights_route(self) -> None:
        """Where POST /v1/weights is served (``--weights-root``), at zero from the start: its refusals
        before the body names a served model (``model=""``), and the rejection reasons only it answers."""
        for outcome in UNNAMED_UPDATE_OUTCOMES:
            self.weights_updates.labels(model="", outcome=outcome)
        for reason in WEIGHTS_REJECTION_REASONS:
            self.rejections.labels(reason=reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerRestarts:
    """``packscore_worker_restarts_total{model}``: new worker worlds that scored again after a worker failed."""

    _NAME, _HELP = "packscore_worker_restarts", "Times a model's worker pool replaced its workers after one failed and scored again."

    def __init__(self, counts: Callable[[], dict[str, float]]):
        self._counts = counts

    def describe(self):
        return [CounterMetricFamily(self._NAME, self._HELP, labels=_MODEL)]

    def collect(self):
        family = CounterMetricFamily(self._NAME, self._HELP, labels=_MODEL)
        for model, count in self._counts().items():
            family.add_metric([model], float(count))
        yield family
