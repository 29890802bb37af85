"""A worker pool's rank reading a weight update beside the served weights says when its read begins, still
every ``still_lines.EVERY_S`` while it runs, and when it ended (or stopped, refused): the rank's side of the
server's "weights update of NAME" and "NAME now serves V" lines, on a real tiny checkpoint and the rank's
real reply pipe."""

import logging
import time
from multiprocessing import Pipe

import model_runtime.still_lines as still_lines
from model_runtime.pool import messages as msg
from model_runtime.pool import worker
from model_runtime.scoring import weights
from model_runtime.scoring.loading import load_model
from tests.checkpoints import rewrite_checkpoint, save_checkpoint

_EVERY_S = 0.1


def _updates(tmp_path):
    loaded = load_model(str(save_checkpoint("qwen3_5", tmp_path / "ck")), device="cpu")
    answers, sent = Pipe(duplex=False)
    return worker._WeightUpdates(loaded, 3, worker._Replies(sent), "v0"), answers


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "packscore.worker"]


def test_a_rank_reading_an_update_says_when_it_begins_still_and_when_it_ended(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(still_lines, "EVERY_S", _EVERY_S)
    caplog.set_level(logging.INFO, logger="packscore.worker")
    updates, answers = _updates(tmp_path)
    update = save_checkpoint("qwen3_5", tmp_path / "step-1", seed=1)
    real, at_read = weights.read_parameters, []

    def read_parameters(*args, **kwargs):  # a large checkpoint: minutes, here a few intervals
        time.sleep(3.5 * _EVERY_S)
        tensors = real(*args, **kwargs)
        at_read.extend(_said(caplog))
        return tensors

    monkeypatch.setattr(weights, "read_parameters", read_parameters)
    updates.load(msg.LoadWeights(request_id=7, path=str(update)))
    done = msg.decode(answers.recv_bytes())
    time.sleep(4 * _EVERY_S)
    lines = _said(caplog)
    assert isinstance(done, msg.WeightsDone) and done.ok and (done.request_id, done.rank) == (7, 3), done
    assert lines[0].startswith(f"reading the update of ck from {update}: "), lines
    assert lines[0].endswith(" GiB, as float32 on cpu"), lines
    assert lines[1:3] == ["still reading the update of ck: 0.1 s", "still reading the update of ck: 0.2 s"], lines
    assert lines[:-1] == at_read and lines[-1].startswith("read the update of ck in "), lines  # none once it ended
    assert float(lines[-1].removeprefix("read the update of ck in ").removesuffix("s")) >= 3.5 * _EVERY_S, lines


def test_a_rank_whose_update_is_refused_says_it_stopped_reading(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="packscore.worker")
    updates, answers = _updates(tmp_path)
    incomplete = rewrite_checkpoint(tmp_path / "ck", tmp_path / "step-2",
                                    edit_tensors=lambda t: {k: v for k, v in t.items() if not k.endswith("norm.weight")})
    updates.load(msg.LoadWeights(request_id=8, path=str(incomplete)))
    done = msg.decode(answers.recv_bytes())
    lines = _said(caplog)
    assert isinstance(done, msg.WeightsDone) and not done.ok and done.kind == "incomplete", done
    assert len(lines) == 2 and lines[0].startswith(f"reading the update of ck from {incomplete}: "), lines
    assert lines[1].startswith("stopped reading the update of ck after "), lines
    assert lines[1].endswith("s: the checkpoint was refused (incomplete)"), lines


def _start_refused(monkeypatch, caplog, error: Exception) -> list[str]:
    def fails(start, replies):
        raise error

    monkeypatch.setattr(worker, "_setup", fails)
    monkeypatch.setattr(worker.logging, "basicConfig", lambda **kw: None)  # the rank's own format would drop caplog's handler
    commands, send_commands = Pipe(duplex=False)
    _, replies = Pipe(duplex=False)
    send_commands.send_bytes(msg.encode(msg.Start(
        rank=1, world_size=2, sp=1, fsdp=True, master_port=1, generation=1, model="ck", device="cpu", dtype="auto",
        max_batch_tokens=64, allow_slow_kernels=False, kernels={}, served_model_name="", timeout_s=1.0)))
    with caplog.at_level(logging.INFO, logger="packscore.worker"):
        assert worker.serve(commands, worker._Replies(replies)) == 1
    return _said(caplog)


def test_a_rank_that_cannot_start_names_itself_once(monkeypatch, caplog):
    """Its lines logged 'rank=1 rank 1 refused the checkpoint: ...': the format's prefix already names the rank."""
    from model_runtime.scoring.checkpoint_error import CheckpointError

    said = _start_refused(monkeypatch, caplog, CheckpointError("non_finite", "ck: 1 weight tensor holds NaN"))
    assert said == ["refused the checkpoint: ck: 1 weight tensor holds NaN"], said
    caplog.clear()
    assert _start_refused(monkeypatch, caplog, RuntimeError("no device")) == ["failed to start"]
