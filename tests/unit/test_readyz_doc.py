"""docs/usage.md lists every status a 503 from /readyz can name, and only those: read from
service/runtime.py (its start's phases), service/readiness.py (what ``readiness()`` answers) and
service/draining.py (the drain's phase), so a new phase or reason cannot go undocumented."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _answered() -> set[str]:
    code = "".join((ROOT / "service" / name).read_text() for name in ("runtime.py", "readiness.py", "draining.py"))
    found = set(re.findall(r'_advance\("(\w+)"\)', code)) | set(re.findall(r'self\.phase = "(\w+)"', code))
    for line in re.findall(r"return False, (.+)", code):
        found |= set(re.findall(r'"(\w+)"', line))
    found |= set(re.findall(r'\(False, "(\w+)"\)', code))
    return found - {"ready"}


def _documented() -> set[str]:
    text = (ROOT / "docs" / "usage.md").read_text()
    start = text.index("A `/readyz` of 503 names its reason in `status`:")
    paragraph = text[start:text.index("\n\n", start)]
    words = set(re.findall(r"`([a-z_]+)`", paragraph)) - {"status"}
    # the paragraph also names a route's error type and headers in backticks: not statuses
    return words - {"not_ready"}


def test_every_readyz_status_is_in_the_usage_doc_and_no_other():
    answered, documented = _answered(), _documented()
    assert {"loading", "probe_pending", "restart_failed", "draining"} <= answered, answered  # the scan works
    assert not answered - documented, f"/readyz answers these, docs/usage.md does not list them: {sorted(answered - documented)}"
    assert not documented - answered, f"docs/usage.md lists these, /readyz never answers them: {sorted(documented - answered)}"
