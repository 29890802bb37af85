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


_LAYERS = {"kernels": 0, "model": 1, "scoring": 2, "parallel": 3, "pool": 4}


def _imported(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    import ast

    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(path.relative_to(ROOT).with_suffix("").parts[: -node.level]) if node.level else []
            names.append(".".join(base + ([node.module] if node.module else [])))
    return names


def test_the_import_directions_the_map_states_hold():
    """docs/architecture.md: model_runtime never imports service; inside it kernels <- model <- scoring
    <- parallel <- pool, the one exception the kernels' import of model/packing.py."""
    wrong = []
    for path in sorted((ROOT / "model_runtime").rglob("*.py")):
        layer = path.relative_to(ROOT / "model_runtime").parts[0]
        for name in _imported(path):
            parts = name.split(".")
            if parts[0] == "service":
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            elif parts[0] == "model_runtime" and len(parts) > 1 and layer in _LAYERS:
                above = parts[1] in _LAYERS and _LAYERS[parts[1]] > _LAYERS[layer]
                if above and not (layer == "kernels" and name == "model_runtime.model.packing"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in sorted((ROOT / "model_runtime" / "model").glob("packing.py")):
        wrong += [f"packing.py imports {n}" for n in _imported(path) if n.split(".")[0] in ("model_runtime", "service")]
    for path in sorted((ROOT / "service" / "client").rglob("*.py")):
        wrong += [f"{path.relative_to(ROOT)} imports {n}" for n in _imported(path)
                  if n.split(".")[0] in ("service", "model_runtime", "torch")]
    assert not wrong, "\n".join(wrong)
