"""Helpers shared by the deployment checks (Dockerfile, Helm chart, Grafana dashboard).

Every tool these tests use comes from the `deploy` extra (pip install -e '.[deploy]').
A missing tool is an error, never a skip: the imports below fail the run.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm  # Helm v4's Go SDK, bundled as a native library
import yaml

from service.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "packscore"
RELEASE = "ps"
NAMESPACE = "rl"


def _serve_options() -> frozenset[str]:
    """Every option string the real `packscore serve` parser accepts (--help excluded)."""
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return frozenset(o for o in sub.choices["serve"]._option_string_actions if o.startswith("--") and o != "--help")


# From service/cli.py itself, so a value set using any real option (--weights-root) passes.
CLI_OPTIONS = _serve_options()


def exported_series() -> dict[str, tuple[str, frozenset[str]]]:
    """Every series name GET /metrics can carry, with its family's type and the labels the
    service puts on it, read from service/http/metrics.py itself: no server is started."""
    from prometheus_client.metrics import MetricWrapperBase

    from service.http.metrics import Metrics
    from service.testing import FakeBackend

    metrics = Metrics()
    metrics.describe_model(FakeBackend().info, "m")  # an info series' labels are its values' keys: written here
    # prometheus_client keeps a metric's label names on the metric object only.
    labels = {m._name: set(m._labelnames) for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)}
    suffixes = {"counter": ["_total"], "gauge": [""], "info": ["_info"], "histogram": ["_bucket", "_sum", "_count"]}
    series = {}
    for family in metrics.registry.collect():
        written = {k for sample in family.samples for k in sample.labels} - {"le"}
        for suffix in suffixes[family.type]:
            le = {"le"} if suffix == "_bucket" else set()
            series[family.name + suffix] = (family.type, frozenset(labels.get(family.name, set()) | written | le))
    return series


def vector_selectors(parsed: Any) -> list[Any]:
    """Every series selector (``promql_parser.VectorSelector``) of a parsed PromQL expression."""
    import promql_parser

    found = []

    def visit(node, *_):
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(parsed, visit)
    return found


def load_module(path: Path) -> ModuleType:
    """Import a script that is not part of an installed package."""
    spec = importlib.util.spec_from_file_location(f"deploycheck_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def find_tool(name: str) -> str:
    """A console script of the deploy extra: next to this interpreter first, then PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    assert found, f"{name} not found; install the deploy extra: pip install -e '.[deploy]'"
    return found


def render_chart(values: dict[str, Any] | None = None, chart: Path = CHART) -> dict[str, str]:
    """Render with Helm itself (schema validation included), as `helm template` would."""
    with helm.Chart.load(chart) as c:
        return c.render(copy.deepcopy(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every non-empty Kubernetes object the chart renders, NOTES.txt excluded."""
    docs = []
    for name, text in sorted(render_chart(values).items()):
        if not name.endswith(".yaml"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def pod_spec(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return one(manifests(values), "Deployment")["spec"]["template"]["spec"]


def container(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (c,) = pod_spec(values)["containers"]
    return c


def arg_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


# Value sets that together switch on every template branch; used by the schema and
# lint checks. Each one is also a plausible real deployment.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "qwen9b-pvc-all-features": {
        "image": {"repository": "registry.example.com/ml/packscore", "tag": "0.1.0"},
        "imagePullSecrets": [{"name": "regcred"}],
        "model": {"path": "/models/Qwen3.5-9B",
                  "source": {"type": "pvc", "pvc": {"claimName": "models", "subPath": "qwen"}}},
        "parallel": {"worldSize": 8, "sp": 2, "fsdp": True},
        "server": {"maxBatchTokens": 65536, "maxWaitMs": 5, "maxQueuedTokens": 4_000_000,
                   "maxRequestBytes": 268_435_456, "maxModelLen": 262_144, "dtype": "bfloat16",
                   "drainTimeoutS": 120, "allowSlowKernels": False, "extraArgs": ["--device", "cuda"]},
        "preStopSleepS": 5,
        "apiKey": {"secretName": "packscore-api-key", "secretKey": "api-key"},
        "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
        "envFrom": [{"configMapRef": {"name": "packscore-extra"}}],
        "cache": {"sizeLimit": "16Gi", "existingClaim": "triton-cache"},
        "runtimeClassName": "nvidia",
        "priorityClassName": "rl-critical",
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                              "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "packscore"}}}}]}},
        "podAnnotations": {"example.com/owner": "rl"},
        "podLabels": {"team": "rl"},
        "service": {"type": "ClusterIP", "port": 8000, "annotations": {"example.com/lb": "internal"}},
        "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                           "alertLabels": {"team": "rl"}, "alerts": {"queueWaitHigh": {"seconds": 10}},
                           "extraRules": [{"record": "packscore:tokens_scored:rate5m",
                                           "expr": "sum by (model) (rate(packscore_tokens_scored_total[5m]))"}]},
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetQueuedTokens": 1_000_000},
        "networkPolicy": {"enabled": True, "from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "trainers"}}},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        ]},
    },
    "hostpath-4gpu": {
        "gpus": 4,
        "model": {"path": "/models/Qwen3.5-9B",
                  "source": {"type": "hostPath", "hostPath": {"path": "/mnt/nvme/models", "type": "Directory"}}},
        "serviceAccount": {"create": False, "name": ""},
        "podDisruptionBudget": {"enabled": False},
    },
    "nfs-1gpu": {
        "gpus": 1,
        "model": {"path": "/models/Qwen3.5-0.8B",
                  "source": {"type": "nfs", "nfs": {"server": "nfs.storage.svc", "path": "/export/models"}}},
        "service": {"type": "NodePort", "port": 8000},
    },
    "weights-updates-1gpu": {
        "gpus": 1,
        "model": {"path": "/ckpt/step-000000", "source": {"type": "none"}},
        "apiKey": {"secretName": "packscore-api-key", "secretKey": "api-key"},
        "weights": {"enabled": True, "mountPath": "/ckpt",
                    "source": {"type": "pvc", "pvc": {"claimName": "rl-checkpoints", "subPath": "run-42"}},
                    "adminKey": {"secretName": "packscore-admin-key", "secretKey": "admin-key"}},
    },
}
