"""Signals of the child processes tests start, and the states they leave them in."""

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
