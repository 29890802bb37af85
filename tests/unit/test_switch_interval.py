"""The scorer in the serving process shortens the GIL switch interval (favour_forward_threads);
a LocalBackend a library user builds leaves the interpreter as it was."""

import subprocess
import sys


def test_the_served_scorer_shortens_the_switch_interval_and_a_plain_local_backend_does_not():
    code = """
import sys
from model_runtime.scoring.backend import FORWARD_SWITCH_INTERVAL_S, LocalBackend, favour_forward_threads
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
from service.backends import load_backend
from service.settings import Settings
default = sys.getswitchinterval()
assert default > FORWARD_SWITCH_INTERVAL_S
LocalBackend(Scorer(load_model("tiny"), max_batch_tokens=64))
assert sys.getswitchinterval() == default, sys.getswitchinterval()
load_backend(Settings(model="tiny", device="cpu"))  # packscore serve's and score's
assert sys.getswitchinterval() == FORWARD_SWITCH_INTERVAL_S, sys.getswitchinterval()
sys.setswitchinterval(FORWARD_SWITCH_INTERVAL_S / 4)
favour_forward_threads()  # never lengthens it
assert sys.getswitchinterval() == FORWARD_SWITCH_INTERVAL_S / 4, sys.getswitchinterval()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
