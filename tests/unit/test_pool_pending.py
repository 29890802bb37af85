"""A pool row settled by two threads at once (its reader's reply, its world's failure) keeps the first."""

import threading
import time

from model_runtime.pool.replies import Pending
from model_runtime.scoring.backend import BackendUnavailableError


class SlowCheck(threading.Event):
    """An event whose ``is_set`` answers late, as a thread switch after the check would."""

    def is_set(self) -> bool:
        value = super().is_set()
        time.sleep(0.05)
        return value


def test_two_settlers_at_once_leave_the_first_ones_outcome_whole():
    pending = Pending(request_id=1, generation=1, deadline=time.monotonic() + 60, done=SlowCheck())
    failure = BackendUnavailableError("the worker pool is restarting")
    first = threading.Thread(target=pending.settle, kwargs={"reply": "scores"})
    second = threading.Thread(target=pending.settle, kwargs={"error": failure})
    first.start()
    time.sleep(0.01)
    second.start()
    first.join()
    second.join()
    assert (pending.reply, pending.error) == ("scores", None), (pending.reply, pending.error)
