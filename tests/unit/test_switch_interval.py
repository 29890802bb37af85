"""A process that serves forwards shortens the GIL switch interval (model_runtime.scoring.backend)."""

import subprocess
import sys


def test_a_local_backend_and_a_pool_worker_shorten_the_switch_interval_and_never_lengthen_it():
    code = """
import sys
from model_runtime.scoring.backend import FORWARD_SWITCH_INTERVAL_S, LocalBackend, favour_forward_threads
from model_runtime.scoring.loading import load_model
from model_runtime.scoring.scorer import Scorer
assert sys.getswitchinterval() > FORWARD_SWITCH_INTERVAL_S
LocalBackend(Scorer(load_model("tiny"), max_batch_tokens=64))
assert sys.getswitchinterval() == FORWARD_SWITCH_INTERVAL_S, sys.getswitchinterval()
sys.setswitchinterval(FORWARD_SWITCH_INTERVAL_S / 4)
favour_forward_threads()
assert sys.getswitchinterval() == FORWARD_SWITCH_INTERVAL_S / 4, sys.getswitchinterval()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
