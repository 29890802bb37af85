"""The documents point at what exists: every relative link, its #anchor, every backticked path of
the repository and every results file they name. A benchmark history row records a past run and
may name what has since gone; it is left as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md",
        ROOT / "deploy" / "helm" / "packscore" / "README.md"]
RESULTS = ROOT / "bench" / "results"
_HISTORY_ROW = re.compile(r"^\| \d+ \|")  # docs/benchmarks.md: one past run per row
_TOP = ("bench/", "service/", "model_runtime/", "tests/", "deploy/", "docs/", ".ci/")
_RESULTS_NAME = re.compile(r"^(h[12]00|prefix-sharing|http-burst|burst-packing|weights-cpu)[\w.*-]*\.(json|md)$")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+\s+(.*)$", path.read_text(), flags=re.M)}


def _exists(token: str, doc: Path) -> bool:
    if any(c in token for c in "*?["):
        return any(ROOT.glob(token)) or any(doc.parent.glob(token))
    return (ROOT / token).exists() or (doc.parent / token).exists()


def _lines(doc: Path):
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if not _HISTORY_ROW.match(line):
            yield number, line


def test_relative_links_and_their_anchors_exist():
    wrong = []
    for doc in DOCS:
        for number, line in _lines(doc):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                path, _, anchor = target.partition("#")
                resolved = (doc.parent / path).resolve() if path else doc
                if not resolved.exists():
                    wrong.append(f"{doc.relative_to(ROOT)}:{number}: link to {target}: no such file")
                elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                    wrong.append(f"{doc.relative_to(ROOT)}:{number}: link to {target}: no such heading")
    assert not wrong, "\n".join(wrong)


def test_backticked_repository_paths_exist():
    wrong = []
    for doc in DOCS:
        for number, line in _lines(doc):
            for token in re.findall(r"`([^`\s]+)`", line):
                token = token.split("::")[0].rstrip(":,.")
                if "<" in token or "{" in token or "$" in token:
                    continue  # a placeholder, not a path
                if token.startswith(_TOP) and not _exists(token.rstrip("/"), doc):
                    wrong.append(f"{doc.relative_to(ROOT)}:{number}: `{token}`")
                elif "/" not in token and _RESULTS_NAME.match(token) and not any(RESULTS.glob(token)):
                    wrong.append(f"{doc.relative_to(ROOT)}:{number}: `{token}` is not in bench/results")
    assert not wrong, "paths the documents name that do not exist:\n" + "\n".join(wrong)
