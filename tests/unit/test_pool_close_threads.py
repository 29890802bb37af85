"""``close()`` returns only once the pool's own threads can no longer log: a daemon thread writing a
line while the server's interpreter finalises aborts the process ("Fatal Python error: could not
acquire lock for <stderr> ... possibly due to daemon threads", status -6). A real process and real
pipes stand in for a worker; no model."""

import logging
import subprocess
import sys
import threading
import time
from multiprocessing import Pipe

import numpy as np
import pytest

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


def test_close_stops_the_hash_for_restarts_and_waits_for_it(tmp_path, monkeypatch, caplog):
    """An update's hash of its checkpoint (for restarts) runs on a daemon thread that logs when it
    fails, and its reading threads would hold the interpreter's exit until the whole checkpoint is read."""
    from safetensors.numpy import save_file

    from model_runtime.pool.loaded_files import LoadedFiles
    from model_runtime.scoring import content_hash
    from model_runtime.scoring.weights import files_snapshot

    save_file({"w": np.zeros(1 << 20, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(content_hash, "READ_BUFFER", 4096)
    read_at = content_hash._read_at
    reads = threading.Event()

    def slow_disk(fd, view, offset):  # a thousand reads of 10 ms: the hash would take 10 s
        reads.set()
        time.sleep(0.01)
        return read_at(fd, view, offset)

    monkeypatch.setattr(content_hash, "_read_at", slow_disk)
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    loaded = LoadedFiles(tmp_path, files_snapshot(tmp_path), None)
    pool._hash_for_restarts(loaded)
    assert reads.wait(10.0), "the hash never started reading"
    started = time.monotonic()
    pool.close()
    took = time.monotonic() - started
    assert not any(t.is_alive() for t in pool._hashes), f"the hash still runs {took:.1f}s after close() returned"
    assert took < 3.0 and loaded.content is None, (took, loaded.content)
    assert "hashing" not in caplog.text, caplog.text


def test_close_waits_for_every_update_s_hash_still_running(tmp_path, monkeypatch):
    """A second update's hash replaced the first's as the one close() joins: the first, stopped but still
    ending (its last read, a log line), outlived close() and could write while the interpreter finalised."""
    from model_runtime.pool.loaded_files import LoadedFiles
    from model_runtime.scoring.backend import ModelInfo
    from tests.unit.test_pool_update_race import SwappingWorld, checkpoint

    first, second = checkpoint(tmp_path / "first", 2.0), checkpoint(tmp_path / "second", 3.0)
    hashes: list[threading.Thread] = []
    running = threading.Semaphore(0)
    first_ends = threading.Event()  # the first hash, once stopped, ends only when this is set

    def hash(loaded: LoadedFiles, halt: threading.Event | None = None) -> None:
        hashes.append(threading.current_thread())
        running.release()
        halt.wait(30.0)  # it runs until close() stops it
        if loaded.path == first:
            first_ends.wait(30.0)

    monkeypatch.setattr(LoadedFiles, "hash", hash)
    pool = WorkerPool({"world_size": 1, "device": "cpu", "model": str(checkpoint(tmp_path / "old", 1.0))})
    pool.info = ModelInfo("m", "test", 8, 64, "float32", "cpu", "v1", {})
    pool._alive = True
    pool._world = SwappingWorld(pool, die_on_swap=False)
    try:
        pool.update_weights(first, "v2")
        assert running.acquire(timeout=10.0), "the first update's hash never started"
        pool.update_weights(second, "v3")
        assert running.acquire(timeout=10.0), "the second update's hash never started"
        threading.Timer(0.5, first_ends.set).start()
        pool.close()
        assert len(hashes) == 2 and not any(t.is_alive() for t in hashes), "an update's hash outlived close()"
    finally:
        first_ends.set()
        pool.close()


def _close_while_starting(pool: WorkerPool, name: str, monkeypatch) -> tuple[list, list]:
    """Calls ``pool.close()`` from another thread just as the thread named ``name`` is about to
    start, once it is registered for close() to wait for; returns what close() raised and its thread."""
    errors: list[BaseException] = []
    closers: list[threading.Thread] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(name):
            def closing() -> None:
                try:
                    pool.close()
                except BaseException as error:
                    errors.append(error)

            closer = threading.Thread(target=closing)
            closers.append(closer)
            real_start(closer)
            closer.join(1.0)  # it raises meanwhile, or waits for the thread it is to join to start
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return errors, closers


def test_close_as_a_reader_is_registered_waits_for_it_to_start():
    """close() joins the readers it finds: one registered but not yet started made it raise."""
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    rep_recv, worker_end = Pipe(duplex=False)
    world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    world.replies.append(rep_recv)
    pool._world, pool._alive = world, True
    pool._new_pending(world)  # a row in flight: close() kills the worker instead of waiting for it
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            errors, closers = _close_while_starting(pool, "pool-reader", monkeypatch)
            pool._watch(world)
        closers[0].join(10.0)
        assert not errors, f"close() raised: {errors!r}"
        assert not closers[0].is_alive() and not any(t.is_alive() for t in pool._readers), "close() or a reader still runs"
    finally:
        world.stop(graceful=False)
        worker_end.close()


def test_close_as_the_hash_for_restarts_is_registered_waits_for_it_to_start(tmp_path, monkeypatch):
    """close() joins the hash it finds: one registered but not yet started made it raise."""
    from safetensors.numpy import save_file

    from model_runtime.pool.loaded_files import LoadedFiles
    from model_runtime.scoring.weights import files_snapshot

    save_file({"w": np.zeros(16, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    errors, closers = _close_while_starting(pool, "pool-content-hash", monkeypatch)
    pool._hash_for_restarts(LoadedFiles(tmp_path, files_snapshot(tmp_path), None))
    closers[0].join(10.0)
    assert not errors, f"close() raised: {errors!r}"
    assert not closers[0].is_alive() and not any(t.is_alive() for t in pool._hashes), "close() or the hash still runs"


def test_close_as_a_failed_swap_starts_the_restart_loop_waits_for_it_to_start():
    """A world failed from outside its reader (an update's refused swap) starts the restart loop on
    that thread: close() landing between its registration and its start made join() raise."""
    pool = WorkerPool({"world_size": 1, "device": "cpu"})
    world = WorkerWorld(1, pool.dims)
    world.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    pool._world, pool._alive = world, True
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            errors, closers = _close_while_starting(pool, "pool-restart", monkeypatch)
            pool._on_world_failure(world, "worker rank 0 could not swap: a test")
        closers[0].join(10.0)
        assert not errors, f"close() raised: {errors!r}"
        assert not closers[0].is_alive() and not pool._restart_thread.is_alive(), "close() or the restart loop still runs"
    finally:
        world.stop(graceful=False)
