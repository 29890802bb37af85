"""`packscore --help`, `serve --help` and `--version` answer without importing torch or the server's
stack: what makes them fast (the independent check times them; speed is not asserted here). A signal while
`serve` imports torch."""

import os
import signal
import subprocess
import sys

import pytest

from tests.signals import default_sigint, signalled_in_torch_import, signalled_on_import_run

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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_serve_signalled_while_torch_imports_exits_as_before_serving_never_aborting(tmp_path, sig):
    """Ctrl-C's KeyboardInterrupt raised inside torch's import, where its C++ init runs Python, aborted the
    process now and then (``terminate called after throwing ...``, SIGABRT): it is held until the imports under way
    end (a load thread's too), then acts: KeyboardInterrupt before uvicorn runs, else uvicorn's stop (130).
    SIGTERM there exits at once with its line and 0."""
    env = signalled_in_torch_import(tmp_path / "site", sig, {k: v for k, v in os.environ.items()
                                                            if not k.startswith("PACKSCORE_")})
    run = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", "0"],
                         capture_output=True, text=True, timeout=60, preexec_fn=default_sigint, env=env)
    lines = run.stderr.splitlines()
    assert "terminate called" not in run.stderr, run.stderr[-2000:]
    if sig == signal.SIGINT:  # sent again once the imports under way end: before uvicorn runs, or by its stop
        assert run.returncode in (-signal.SIGINT, 130), f"exit {run.returncode}:\n{run.stderr[-2000:]}"
        assert "torch imported: False" not in lines, run.stderr[-2000:]  # a stop by uvicorn may end with os._exit
    else:  # os._exit: no atexit line
        assert "Uvicorn running" not in run.stderr, run.stderr[-2000:]
        assert run.returncode == 0, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
        assert lines[-1] == "packscore: SIGTERM before the server started; nothing was admitted, exiting", lines[-3:]


def test_ctrl_c_is_held_while_torch_imports_only_where_it_was_pythons_default():
    from service.entrypoint import handle_early_signals, interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        for argv, found, then in [(["serve"], signal.default_int_handler, interrupt),
                                  (["score", "in.jsonl"], signal.default_int_handler, interrupt),
                                  (["--version"], signal.default_int_handler, signal.default_int_handler),
                                  (["score", "in.jsonl"], signal.SIG_IGN, signal.SIG_IGN)]:  # `cmd &`, nohup
            signal.signal(signal.SIGINT, found)
            handle_early_signals(argv)
            assert signal.getsignal(signal.SIGINT) is then, (argv, found)
    finally:
        signal.signal(signal.SIGINT, before)


_SWALLOWED_RUN = """
import os, signal, sys, time
from service import entrypoint

entrypoint.handle_early_signals(sys.argv[1:])

class Swallows:  # as a C extension calling Python (pydantic-core) reports an exception and goes on
    def __del__(self):
        os.kill(os.getpid(), int(sys.argv[2]))
        time.sleep(0.2)  # the handler runs here: its exception is unraisable, the process goes on

Swallows()
try:
    time.sleep(5)
    print("went on")
except KeyboardInterrupt as stop:
    print("stopped by", type(stop).__name__)
"""


@pytest.mark.parametrize("sig,stopped_by", [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Terminated")],
                         ids=["sigint", "sigterm"])
def test_a_signal_whose_exception_was_swallowed_is_sent_again(sig, stopped_by):
    """Where code that calls Python from C reports the handler's exception as unraisable and goes on, the run
    would go on as if no Ctrl-C or SIGTERM came: the signal is sent again, for the next Python code to raise."""
    run = subprocess.run([sys.executable, "-c", _SWALLOWED_RUN, "score", str(int(sig))], capture_output=True,
                         text=True, timeout=60, preexec_fn=default_sigint)
    assert run.stdout.splitlines() == [f"stopped by {stopped_by}"], f"exit {run.returncode}: {run.stdout}\n{run.stderr}"


@pytest.mark.parametrize("argv,line", [
    (["score", "in.jsonl", "-o", "out.jsonl"], "packscore: interrupted before scoring began; OUT is as it was"),
    (["serve", "--host", "127.0.0.1", "--port", "0"], "packscore: interrupted before the server started; nothing was "
                                                      "admitted"),
], ids=["score", "serve"])
def test_ctrl_c_during_the_first_imports_exits_130_with_a_line(tmp_path, argv, line):
    """Before the command's own handling took over, Ctrl-C gave a KeyboardInterrupt traceback (about a fifth of
    score's Ctrl-Cs in its first seconds)."""
    argv = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv]
    run = subprocess.run([sys.executable, "-c", signalled_on_import_run(signal.SIGINT), *argv], capture_output=True,
                         text=True, timeout=60, preexec_fn=default_sigint)
    assert run.returncode == 130 and "Traceback" not in run.stderr, f"exit {run.returncode}:\n{run.stderr[-2000:]}"
    assert run.stderr.splitlines()[-1] == line, run.stderr[-2000:]
