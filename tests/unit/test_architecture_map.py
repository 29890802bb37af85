"""docs/architecture.md's tree is the module map: every module it names exists where it says, and
every module of service/ and model_runtime/ is named in its folder's entry."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
_CONTINUATION = 30  # a line indented this far continues the entry above it


def _entries() -> dict[str, str]:
    """Each path the tree names (folders end with /) -> its entry's text, description included."""
    block = DOC.read_text().split("```\n", 2)[1]
    entries: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, folder) of the folders enclosing the line
    last: list[str] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= _CONTINUATION:
            for path in last:
                entries[path] += " " + line.strip()
            continue
        names, _, text = line.strip().partition("  ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "".join(folder for _, folder in stack)
        last = [prefix + name.strip() for name in names.split(",")]
        for path in last:
            entries[path] = text.strip()
        if names.endswith("/"):
            stack.append((indent, names))
    return entries


def test_every_module_the_map_names_exists():
    missing = [p for p in _entries() if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, f"docs/architecture.md names what is not in the tree: {missing}"


def test_every_module_is_in_the_map():
    entries = _entries()
    client = entries["service/client/"]
    unnamed = []
    for package in ("service", "model_runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py":
                continue
            if rel.startswith("service/client/"):  # its own distribution: named in the client/ entry
                if not re.search(rf"\b{re.escape(path.name)}\b", client):
                    unnamed.append(rel)
            elif rel not in entries:
                unnamed.append(rel)
    assert not unnamed, f"modules docs/architecture.md's tree does not name: {unnamed}"
