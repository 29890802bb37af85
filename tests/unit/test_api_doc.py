"""The API contract ships with the repository: docs/api.md is the contract itself, and every
mention of it in the README and the docs points there."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT.parent / "shared" / "API.md"  # beside the checkout in CI
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]


@pytest.mark.skipif(not CONTRACT.exists(), reason=f"no contract beside the checkout ({CONTRACT})")
def test_docs_api_md_is_the_contract():
    shipped, contract = (ROOT / "docs" / "api.md").read_text(), CONTRACT.read_text()
    if shipped != contract:
        first = next(i for i, (a, b) in enumerate(zip(shipped.splitlines() + [""], contract.splitlines() + [""])) if a != b)
        raise AssertionError(f"docs/api.md differs from {CONTRACT} from line {first + 1}: copy the contract over")


def test_every_mention_of_the_contract_points_at_docs_api_md():
    wrong = []
    for path in DOCS:
        if path.name == "api.md" and path.parent.name == "docs":
            continue
        text = path.read_text()
        for match in re.finditer(r"\[[^\]]*\]\(([^)]*)\)", text):  # links whose target names the contract
            target = match.group(1).split("#")[0]
            if target.lower().endswith("api.md") and (path.parent / target).resolve() != ROOT / "docs" / "api.md":
                wrong.append(f"{path.relative_to(ROOT)}: link {target}")
        bare = re.sub(r"\[[^\]]*\]\([^)]*\)", "", text)  # mentions outside links must name docs/api.md
        for match in re.finditer(r"(\S*)API\.md", bare, flags=re.I):
            if not match.group(0).endswith("docs/api.md"):
                wrong.append(f"{path.relative_to(ROOT)}: '{match.group(0)}'")
    assert not wrong, f"mentions of the contract that do not point at docs/api.md: {wrong}"
    assert (ROOT / "docs" / "api.md").exists()
