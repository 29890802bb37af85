"""Every reason the service can refuse or fail a request with has its packscore_rejections_total
series from the start, at 0: ``rate()`` and ``increase()`` over a series that appears only at its
first event miss that event, on every fresh pod. The reasons are read from the code itself, so a new
error type cannot be left out of the lists the metrics write at 0."""

import ast
from pathlib import Path

from model_runtime.scoring.checkpoint_error import KINDS, CheckpointError
from service.http.metrics import REJECTION_REASONS, WEIGHTS_REJECTION_REASONS, Metrics
from service.http.weights import checkpoint_refused

ROOT = Path(__file__).resolve().parents[2]
# The client package answers nothing of the server's; metrics.py writes the lists at 0, answering nothing.
SOURCES = sorted(p for p in (ROOT / "service").rglob("*.py")
                 if "client" not in p.relative_to(ROOT / "service").parts and p.name != "metrics.py")
# The error types made from a value, each as this test reads it; another such form fails the test.
CHECKPOINT_TYPE, STARLETTE_TYPE = "f'{kind}_checkpoint'", "kinds.get(exc.status_code, 'http_error')"


def _dict_values(tree: ast.AST, name: str) -> set[str]:
    return {v.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            for v in node.value.values if isinstance(v, ast.Constant)}


def _emitted() -> dict[str, set[str]]:
    """Error type -> the files that answer it: every ``ApiError(status, type, ...)`` and every
    ``rejections.labels(reason=...)`` written with a literal reason."""
    found: dict[str, set[str]] = {}
    unknown = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            kind = None
            if isinstance(func, ast.Name) and func.id == "ApiError":
                kind = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "type"), None)
            elif isinstance(func, ast.Attribute) and func.attr == "labels" and "rejections" in ast.unparse(func.value):
                kind = next((k.value for k in node.keywords if k.arg == "reason"), None)
                if kind is not None and ast.unparse(kind) == "error.type":  # error_response: the ApiErrors above
                    continue
            if kind is None:
                continue
            if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                values = {kind.value}
            elif ast.unparse(kind) == STARLETTE_TYPE:
                values = {"http_error"} | _dict_values(tree, "kinds")
            elif ast.unparse(kind) == CHECKPOINT_TYPE:  # checkpoint_refused: every kind packscore raises
                values = {checkpoint_refused(CheckpointError(k, "x")).type for k in KINDS}
            else:
                unknown.append(f"{where}:{node.lineno}: {ast.unparse(kind)}")
                continue
            for value in values:
                found.setdefault(value, set()).add(where)
    assert not unknown, f"error types this test cannot read; spell their values out here: {unknown}"
    return found


def test_the_reasons_written_at_zero_are_every_reason_the_code_answers():
    emitted = _emitted()
    assert {"queue_full", "request_timeout", "client_disconnected", "not_found", "incomplete_checkpoint"} <= set(
        emitted), sorted(emitted)  # the scan works
    listed = set(REJECTION_REASONS) | set(WEIGHTS_REJECTION_REASONS)
    assert not set(emitted) - listed, f"answered but not at 0 from the start: {sorted(set(emitted) - listed)}"
    assert not listed - set(emitted), f"listed but never answered: {sorted(listed - set(emitted))}"
    assert not set(REJECTION_REASONS) & set(WEIGHTS_REJECTION_REASONS)
    # Those written only where --weights-root serves the route are answered by nothing else.
    elsewhere = {r: emitted[r] - {"service/http/weights.py"} for r in WEIGHTS_REJECTION_REASONS}
    assert not any(elsewhere.values()), f"answered outside the weights route: {elsewhere}"


def test_every_reason_has_a_zero_series_from_the_start_the_weights_route_s_where_it_is_served():
    text = Metrics().render().decode()
    missing = sorted(r for r in REJECTION_REASONS if f'packscore_rejections_total{{reason="{r}"}} 0.0' not in text)
    assert not missing, f"no zero series at start for: {missing}"
    assert not [r for r in WEIGHTS_REJECTION_REASONS if f'reason="{r}"' in text], text
    metrics = Metrics()
    metrics.expect_weights_route()
    text = metrics.render().decode()
    missing = sorted(r for r in WEIGHTS_REJECTION_REASONS if f'packscore_rejections_total{{reason="{r}"}} 0.0' not in text)
    assert not missing, f"no zero series with the weights route for: {missing}"
