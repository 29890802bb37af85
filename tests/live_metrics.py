"""A real server whose GET /metrics carries every series packscore exports, and the metrics table of
docs/deployment.md: what tests/e2e/test_e2e_metrics.py and tests/deploy/test_deploy_live_metrics.py
compare the documentation, the dashboard and the alerts with."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints import save_checkpoint
from tests.e2e.helpers import AUTH, ServerProcess

ROOT = Path(__file__).resolve().parents[1]
METRICS_DOC = ROOT / "docs" / "deployment.md"
SERVED = ("policy", "ref")
_ROW = re.compile(r"^\| `(packscore_\w+)` \| (\w+) \| ([^|]*) \| (.+) \|$")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count")}


@dataclass
class Scrape:
    """One GET /metrics, parsed by prometheus_client's own parser."""

    text: str

    def families(self):
        return list(text_string_to_metric_families(self.text))

    def series(self) -> dict[str, set[str]]:
        """Every sample name, with the label names its samples carry."""
        out: dict[str, set[str]] = {}
        for family in self.families():
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
        return out

    def samples(self) -> set[tuple[str, tuple]]:
        return {(s.name, tuple(sorted(s.labels.items()))) for f in self.families() for s in f.samples}

    def value(self, name: str, **labels: str) -> float | None:
        for family in self.families():
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return None


def scrape(url: str) -> Scrape:
    answer = httpx.get(url + "/metrics", headers=AUTH, timeout=30)
    assert answer.status_code == 200, answer.text
    return Scrape(answer.text)


def full_server(tmp: Path) -> ServerProcess:
    """Two models (``policy``, a checkpoint under --weights-root; ``ref``, the tiny preset) with
    --weights-root and --weights-record: every series of the service has a reason to exist."""
    root = tmp / "root"
    for step in (0, 1):
        save_checkpoint("qwen3_5", root / f"step-{step}", seed=step)
    return ServerProcess(tmp, "--model", f"policy={root / 'step-0'}", "--model", "ref=tiny", "--weights-root",
                         str(root), "--weights-record", str(tmp / "record.json"), "--max-batch-tokens", "512",
                         "--max-wait-ms", "2")


def exercise(url: str) -> None:
    """An update that serves and one refused, and for each model a request with rollout log-probs:
    the series that appear only once something happened now have samples."""
    ok = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "step-1", "version": "s1"}, headers=AUTH,
                    timeout=300)
    assert ok.status_code == 200, ok.text
    refused = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "../x"}, headers=AUTH, timeout=60)
    assert refused.status_code == 403, refused.text
    for model in SERVED:
        body = {"model": model, "sequences": [{"input_ids": [1, 2, 3, 4], "score_from": 2,
                                                "rollout_logprobs": [-1.0, -2.0]}]}
        answer = httpx.post(url + "/score", json=body, headers=AUTH, timeout=120)
        assert answer.status_code == 200, answer.text


@dataclass(frozen=True)
class Documented:
    kind: str  # counter, gauge, histogram or info, as the table says
    labels: frozenset[str]
    meaning: str

    def sample_names(self, name: str) -> list[str]:
        return [name + s for s in _SUFFIXES.get(self.kind, ("",))]


def documented() -> dict[str, Documented]:
    """The rows of the metrics table in docs/deployment.md."""
    text = METRICS_DOC.read_text()
    section = text[text.index("\n## Metrics\n"):]
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line.strip())
        if match:
            name, kind, labels, meaning = match.groups()
            names = frozenset(re.findall(r"`(\w+)`", labels))
            assert names or labels.strip() == "none", line
            assert name not in rows, f"{name} twice in the table"
            rows[name] = Documented(kind, names, meaning.strip())
    return rows
