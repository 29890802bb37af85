"""Every bench module run as a script answers ``--help``: its options are read through argparse, never
from ``sys.argv`` by position, where ``--help`` would be taken for a file name."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scripts() -> list[Path]:
    """The bench modules with an ``if __name__ == "__main__":`` block."""
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body):
            found.append(path)
    return found


def test_every_bench_script_parses_its_arguments_with_argparse():
    scripts = _scripts()
    assert len(scripts) > 10, scripts  # the scan finds them
    positional = [str(p.relative_to(ROOT)) for p in scripts if "argparse" not in p.read_text()]
    assert not positional, f"bench scripts that read sys.argv themselves (no --help): {positional}"


def test_the_report_answers_help():
    done = subprocess.run([sys.executable, "-m", "bench.report", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stdout + done.stderr
