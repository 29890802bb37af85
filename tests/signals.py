"""Signals of the child processes tests start, and the states they leave them in."""

import os
import signal
from pathlib import Path


def default_sigint() -> None:
    """``preexec_fn`` for a child a test interrupts with SIGINT: its default action, as under a terminal.

    A shell that starts a job in the background without job control has it ignore SIGINT, children
    inherit that, and the offline command keeps an ignored SIGINT ignored (as ``nohup`` asks).
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler of its own for ``signum`` (SigCgt in /proc); False once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signum - 1)))


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (``T`` stopped, ``Z`` a zombie), or ``"gone"``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# `sitecustomize` of a child: SIGNUM sent to itself as torch imports one of its own modules, and at the exit whether
# torch's import finished
_SIGNAL_IN_TORCH_IMPORT = """
import atexit, os, signal, sys

class SignalledInTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch.functional":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), %d)
        return None

sys.meta_path.insert(0, SignalledInTorch())
atexit.register(lambda: sys.stderr.write("torch imported: %%s\\n" %% hasattr(sys.modules.get("torch"), "functional")))
"""


def signalled_in_torch_import(site: Path, signum: int, environ: dict) -> dict:
    """``environ`` for a child that sends itself ``signum`` while torch imports (a module of torch's, from
    Python, before torch's import ends), its ``sitecustomize`` written under ``site``; at its exit it writes
    ``torch imported: True`` where torch's import finished, ``False`` where the signal cut it off."""
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SIGNAL_IN_TORCH_IMPORT % signum)
    return {**environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [environ.get("PYTHONPATH")])])}


# A `python -c` run of the console script that sends itself SIGNUM as MODULE is first imported.
_SIGNALLED_ON_IMPORT_RUN = """
import os, sys
from service import entrypoint

class SignalledOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == %r:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), %d)
        return None

sys.meta_path.insert(0, SignalledOnImport())
sys.argv = ["packscore", *sys.argv[1:]]
sys.exit(entrypoint.main())
"""


def signalled_on_import_run(signum: int, module: str = "pydantic") -> str:
    """A script for ``python -c SCRIPT ARGS...`` that runs ``packscore ARGS...`` and sends itself ``signum`` as
    ``module`` is first imported (pydantic: service.cli's first package beyond the standard library)."""
    return _SIGNALLED_ON_IMPORT_RUN % (module, signum)
