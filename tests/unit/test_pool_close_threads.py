"""``close()`` returns only once the pool's own threads can no longer log: a daemon thread writing a
line while the server's interpreter finalises aborts the process ("Fatal Python error: could not
acquire lock for <stderr> ... possibly due to daemon threads", status -6). A real process and real
pipes stand in for a worker; no model."""

import logging
import subprocess
import sys
import threading
from multiprocessing import Pipe

from model_runtime.pool import messages as msg
from model_runtime.pool.pool import WorkerPool
from model_runtime.pool.procs import WorkerWorld


class _SlowLine(logging.Handler):
    """Holds the thread that writes a line until released: a reader caught mid-line by close()."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.let_go.wait(10.0)


def test_close_waits_for_a_reader_still_writing_a_worker_s_failure():
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    rep_recv, worker_end = Pipe(duplex=False)
    cmd_recv, cmd_send = Pipe(duplex=False)
    world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    world.replies.append(rep_recv)
    world.commands.append(cmd_send)
    pool._world, pool._alive = world, True
    pool._new_pending(world)  # a row in flight: close() kills the worker instead of waiting for it
    slow = _SlowLine()
    logger = logging.getLogger("model_runtime.pool.supervisor")
    logger.addHandler(slow)
    try:
        pool._watch(world)
        worker_end.send_bytes(msg.encode(msg.Failure(request_id=99, kind="internal", message="peer gone", fatal=False)))
        assert slow.entered.wait(10.0), "the reader never logged the worker's failure"
        closer = threading.Thread(target=pool.close)
        closer.start()
        closer.join(1.0)
        returned_mid_line = not closer.is_alive()
        slow.let_go.set()
        closer.join(10.0)
        assert not returned_mid_line, "close() returned while the reader was still writing a log line"
        assert not closer.is_alive() and not any(t.is_alive() for t in pool._readers), "a reader outlived close()"
    finally:
        slow.let_go.set()
        logger.removeHandler(slow)
        world.stop(graceful=False)
        for conn in (worker_end, cmd_recv):
            conn.close()
