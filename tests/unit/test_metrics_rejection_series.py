"""Every reason a request to /score can be refused or failed with has its packscore_rejections_total
series from the start, at 0: ``rate()`` and ``increase()`` over a series that appears only at its
first event miss that event, on every fresh pod."""

import re
from pathlib import Path

from service.http.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
# Where the answers of /score (and the gate in front of it) are made; the weights route's own are not rejections of scoring.
SOURCES = ["service/http/scoring.py", "service/http/validation.py", "service/http/errors.py",
           "service/http/encoding.py", "service/http/app.py", "service/runtime.py", "service/scheduling"]
ERROR_TYPE = re.compile(r'ApiError\(\s*\d+,\s*"(\w+)"')


def _error_types() -> set[str]:
    found = set()
    for source in SOURCES:
        path = ROOT / source
        for file in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            found |= set(ERROR_TYPE.findall(file.read_text()))
    return found


def test_every_scoring_error_type_has_a_rejection_series_from_the_start():
    types = _error_types()
    assert {"queue_full", "request_timeout", "client_disconnected", "internal_error"} <= types, types  # the scan works
    text = Metrics().render().decode()
    missing = sorted(t for t in types if f'packscore_rejections_total{{reason="{t}"}} 0.0' not in text)
    assert not missing, f"no zero series at start for: {missing}"
