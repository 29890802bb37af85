"""The service and the model runtime stay free of pyflakes warnings: an unused import is a name
kept for callers that import it from the wrong module, or code nothing runs any more."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_service_and_model_runtime_have_no_pyflakes_warnings():
    api = pytest.importorskip("pyflakes.api")
    reporter = pytest.importorskip("pyflakes.reporter")
    warnings, errors = [], []

    class Collect(reporter.Reporter):
        def __init__(self):
            pass

        def flake(self, message):
            warnings.append(str(message))

        def syntaxError(self, filename, msg, lineno, offset, text):
            errors.append(f"{filename}:{lineno}: {msg}")

        def unexpectedError(self, filename, msg):
            errors.append(f"{filename}: {msg}")

    api.checkRecursive([str(ROOT / "service"), str(ROOT / "model_runtime")], Collect())
    assert not warnings and not errors, "\n".join(errors + warnings)
