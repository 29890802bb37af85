"""Signals of the child processes tests start."""

import signal


def default_sigint() -> None:
    """``preexec_fn`` for a child a test interrupts with SIGINT: its default action, as under a terminal.

    A shell that starts a job in the background without job control has it ignore SIGINT, children
    inherit that, and the offline command keeps an ignored SIGINT ignored (as ``nohup`` asks).
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
