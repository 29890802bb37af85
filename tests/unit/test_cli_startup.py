"""`packscore --help`, `serve --help` and `--version` answer without importing torch or the server's
stack: what makes them fast (the independent check times them; speed is not asserted here)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "huggingface_hub", "model_runtime.scoring.loading")

PROBE = """
import contextlib, io, runpy, sys
sys.argv = ["packscore", *sys.argv[1:]]
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        runpy.run_module("service.cli", run_name="__main__")
except SystemExit as exc:
    code = exc.code
heavy = [m for m in %r if m in sys.modules]
print(code, ",".join(heavy) or "-", out.getvalue().splitlines()[0] if out.getvalue() else "")
""" % (HEAVY,)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["score", "--help"], ["--version"]], ids=" ".join)
def test_help_and_version_import_nothing_heavy(argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    code, heavy, first_line = out.stdout.strip().split(" ", 2)
    assert code in ("0", "None") and heavy == "-", f"exit {code}; imported {heavy}"
    if argv == ["--version"]:
        assert first_line.startswith("packscore "), first_line
    else:
        assert first_line.startswith("usage: packscore"), first_line
