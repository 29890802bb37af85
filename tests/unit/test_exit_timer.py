"""The drain's exit timer acts only until the interpreter gets past its wait for other threads: a
line it wrote while the interpreter finalises could abort the process ("Fatal Python error: could
not acquire lock for <stderr> ... possibly due to daemon threads"), and its status 0 would replace
the exit's own."""

import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]

# The timer is due while the interpreter finalises: an atexit step registered before it runs last.
_SCRIPT = """
import atexit, logging, sys, time
logging.basicConfig(level=logging.INFO)
from service.http import server
atexit.register(time.sleep, 1.5)
server._exit_timer(0.5)
sys.exit(3)
"""


def test_the_exit_timer_is_disarmed_once_the_interpreter_finalises():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert "past the drain timeout; exiting" not in done.stderr, done.stderr
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])


def test_the_exit_timer_still_ends_an_exit_a_non_daemon_thread_holds():
    held = _SCRIPT.replace("atexit.register(time.sleep, 1.5)",
                           "import threading; threading.Thread(target=time.sleep, args=(60,)).start()")
    done = subprocess.run([sys.executable, "-c", held], cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "past the drain timeout; exiting" in done.stderr, (done.returncode, done.stderr[-2000:])
