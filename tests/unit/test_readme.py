"""The README stays true: CI runs its test command, and its figures are those of the files it names."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_quick_start_has_exactly_two_commands():
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    assert "packscore serve" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert quick_start_commands()[1] in ci.splitlines(), "'.ci/run' must run the README's test command verbatim"


def _numbers_in(path: Path) -> list[float]:
    return [float(t.replace(",", "")) for t in re.findall(r"\d[\d,]*(?:\.\d+)?(?:e-?\d+)?", path.read_text())]


def _shown(figure: str, values: list[float]) -> bool:
    """Whether one of values rounds to figure at the precision it is written with."""
    mantissa, _, exponent = figure.replace(",", "").lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    half = 0.5 * 10 ** (int(exponent or 0) - decimals)
    return any(abs(v - float(figure.replace(",", ""))) <= half * (1 + 1e-9) for v in values)


def test_headline_figures_come_from_the_results_files_their_row_names():
    # a figure whose file is not named in its row cannot be checked by a reader: name the file
    section = (ROOT / "README.md").read_text().split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()]
    rows = [r for r in rows if len(r) == 3 and r[2].startswith("`")]
    assert len(rows) >= 5, rows
    wrong = []
    for what, figure, results in rows:
        files = [p for pattern in re.findall(r"`([^`]+)`", results) for p in sorted((ROOT / "bench" / "results").glob(pattern))]
        assert files, f"{what}: no results file matches {results}"
        values = [v for path in files for v in _numbers_in(path)]
        figures = (re.findall(r"(\d+\.\d+)x\b", figure) + re.findall(r"(\d[\d,]*) tokens/s", figure)
                   + re.findall(r"(0\.\d+) of the measured peak", figure) + re.findall(r"\d(?:\.\d+)?e-\d+", figure)
                   + re.findall(r"padded batches: (\d\.\d+)", figure))
        wrong += [f"{what}: {f} is in none of {[p.name for p in files]}" for f in figures if not _shown(f, values)]
    assert not wrong, wrong


def test_status_range_of_the_9b_peak_fraction_spans_the_headline_runs():
    text = (ROOT / "README.md").read_text()
    low, high = re.search(r"measured matmul peak on the 9B \((0\.\d{3})-(0\.\d{3})", text).groups()
    row = next(line for line in text.split("## Headline numbers", 1)[1].splitlines() if line.startswith("| 9B, default |"))
    suites = [ROOT / "bench" / "results" / name for name in re.findall(r"`([^`]+-suite\.json)`", row)]
    fractions = [json.loads(path.read_text())["qwen3.5-9b"]["mfu_of_measured_peak"] for path in suites]
    assert (low, high) == (f"{min(fractions):.3f}", f"{max(fractions):.3f}"), (low, high, fractions)
