"""``packscore score IN.jsonl -o OUT.jsonl``: the server's engine (validation, scheduler, backend)
without HTTP, for batch jobs. Resumable: ids already in OUT are skipped.

Each result line records what made it (model, weights_version, temperature, dtype, and input_hash
of the line's input) beside the API's result, so that a rerun with other weights, another
temperature or another input under the same id is refused instead of appending results of two
runs to one file; a line without them (an earlier packscore's) is kept unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO, Iterator, NamedTuple

import numpy as np
import orjson
import xxhash

from model_runtime.still_lines import saying_still
from model_runtime.wording import counted
from service.http.encoding import non_finite_score, result_record
from service.http.errors import ApiError
from service.http.rollout import mismatch
from service.http.validation import Limits, ScoreJob, parse_score_request, resolve_model_len
from service.entrypoint import Terminated, before_scoring, hard_exit, terminate_before_scoring
from service.offline_in import InputError, in_lines
from service.offline_out import (OutputError, close_output, cut_torn, lock_output, path_problem, remove_if_empty,
                                 whole_lines, why_full)
from service.offline_progress import progress, tick
from service.scheduling.scheduler import Scheduler
from service.scheduling.tickets import Ticket
from service.settings import Settings

log = logging.getLogger(__name__)


class Done(NamedTuple):
    """A result line of OUT, as much of it as shows which input and options scored it."""

    line: int
    scored: int  # len(logprobs): len(input_ids) - score_from of the line that was scored
    entropy: bool
    top_k: int | None  # k, 0 without top-k ids, None where no position was scored (k not shown)
    run: tuple  # its _RUN_FIELDS, None for each it lacks (a line an earlier packscore wrote)
    input_hash: int | None  # input_digest of the line scored, None where not recorded


# What a result line records of the run that made it, and a rerun checks: the weights by their
# content (a copied checkpoint resumes, another one at the same path does not), not the model's name.
_RUN_FIELDS = ("weights_version", "temperature", "dtype")  # in the order written


def input_digest(job: ScoreJob) -> int:
    """XXH3-64 of what a line asks to score (its ids, score_from and rollout log-probs), recorded
    as ``input_hash`` in its result: a rerun knows a line's result by its input, not by id and
    length alone (ids given as ``line-<number>`` move when lines are inserted)."""
    seq = job.sequences[0]
    h = xxhash.xxh3_64(np.asarray(seq.score_from, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(seq.input_ids, dtype="<i4").tobytes())
    if job.rollout[0] is not None:
        h.update(np.ascontiguousarray(job.rollout[0], dtype="<f4").tobytes())
    return h.intdigest()


def finished_ids(output: Path) -> dict[str, Done]:
    """The result lines of ``output`` by id. A torn last line (no newline: the run was killed
    while writing it) is cut off; any other line that is not a result stops the run with its line
    number, since the good lines after it must be neither dropped nor scored again."""
    if not output.exists():
        return {}
    try:
        return _finished_ids(output)
    except OSError as exc:  # write-only, an I/O error: one line and exit 2, not a traceback
        raise InputError(f"-o {output}: cannot read it back to resume: {exc.strerror or exc}") from None


def _finished_ids(output: Path) -> dict[str, Done]:
    done: dict[str, Done] = {}
    runs: dict[tuple, tuple] = {}  # one tuple shared by every line of a run: OUT may hold millions
    good_end = 0
    repeated: set[str] = set()  # ids found again: counted once each, however often they repeat
    with output.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # only the last line can lack its newline
            try:
                record = orjson.loads(line)
                seq_id = record["id"]
                if not isinstance(seq_id, str):
                    raise TypeError(f"id must be a string, got {seq_id!r}")
                if not isinstance(record["logprobs"], list):  # a string's or object's len would pass for one
                    raise TypeError(f"logprobs must be a list, got {record['logprobs']!r}")
                scored = len(record["logprobs"])
                input_hash = None if record.get("input_hash") is None else int(record["input_hash"], 16)
                top_k = record.get("top_k_ids")
                k = 0 if top_k is None else (len(top_k[0]) if top_k else None)
                run = tuple(record.get(name) for name in _RUN_FIELDS)
                for name, value in zip(_RUN_FIELDS, run):  # a list or object there would stop the run with a traceback
                    if isinstance(value, (list, dict)):
                        raise TypeError(f"{name} must be a string or a number, got {value!r}")
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                reason = f"no {exc} field" if isinstance(exc, KeyError) else str(exc)
                if isinstance(exc, orjson.JSONDecodeError):  # its "line 1 column 1" counts within the line, not OUT
                    reason = "a blank line" if not line.strip() else f"not JSON: {exc.msg}"
                raise InputError(
                    f"{output}:{number}: not a result line ({reason}); remove or repair it, then run again "
                    "(the lines after it are kept)"
                ) from None
            if seq_id in done:
                repeated.add(seq_id)
            done[seq_id] = Done(number, scored, "entropy" in record, k, runs.setdefault(run, run), input_hash)
            good_end += len(line)
    if repeated:  # files joined with cat, or written by two runs at once before OUT was locked
        last = "its last result is" if len(repeated) == 1 else "the last result of each is"
        log.warning("%s holds %s more than once: %s the one checked (every line stays in OUT)", output,
                    counted(len(repeated), "id"), last)
    if good_end != output.stat().st_size:
        log.warning("%s: dropping an incomplete last line (the previous run stopped while writing it)", output)
        with output.open("r+b") as f:
            f.truncate(good_end)
    return done


def _jobs(settings: Settings, input_path: Path, limits: Limits, done: dict[str, Done], run: dict,
          seen: dict[str, int] | None = None) -> Iterator[tuple[int, str, ScoreJob]]:
    """Each line not yet in OUT as a validated one-sequence job; a bad line raises InputError naming
    it, as does a line whose result in OUT was scored from another input or with other options.
    ``run`` is what is known of this run's _RUN_FIELDS (the weights only once the model loaded).
    ``seen`` collects every id of IN, with its line."""
    seen = {} if seen is None else seen
    for number, obj in in_lines(input_path, min(limits.max_model_len, limits.max_request_tokens)):
        seq_id = obj["id"]
        if seq_id in seen:  # checked before the skip of done ids: a rerun refuses what a first run does
            named = "; a line without an id is named line-<number>" if seq_id.startswith("line-") else ""
            raise InputError(f"{input_path}:{number}: id {seq_id!r} appears twice in the input (first on line "
                             f"{seen[seq_id]}{named})")
        seen[seq_id] = number
        body = {
            "sequences": [obj],
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "return_entropy": settings.return_entropy,
        }
        try:
            job = parse_score_request(body, limits, served_name="")
        except ApiError as exc:  # named as the line's own fields: a line is one sequence
            where = (exc.param or "").replace("sequences[0].", "")
            message = (exc.message.replace("sequences[0].", "").replace("Sequence 0 has", "The sequence has")
                       .replace("a field of this request", "a field of a line"))
            if where and not message.startswith(where):  # most messages name the field already
                message = f"{where}: {message}"
            raise InputError(f"{input_path}:{number}: {message}") from None
        if seq_id in done:
            _check_resumed(input_path, number, obj, job, done[seq_id], settings, run)
            continue
        yield number, seq_id, job


def _check_resumed(input_path: Path, number: int, obj: dict, job: ScoreJob, result: Done, settings: Settings,
                   run: dict) -> None:
    """OUT's result for this line must be of this line, this model and these options, else OUT mixes two runs."""
    seq = job.sequences[0]
    scored = len(obj["input_ids"]) - seq.score_from
    k = settings.top_k if result.top_k is not None else result.top_k  # no position scored: any k fits
    found = {"scored positions": result.scored, "entropy": result.entropy, "top_k": result.top_k}
    want = {"scored positions": scored, "entropy": settings.return_entropy, "top_k": k}
    for name, recorded in zip(_RUN_FIELDS, result.run):
        if name in run and recorded is not None:  # not recorded: an earlier packscore's line, kept unchecked
            found[name], want[name] = recorded, run[name]
    if result.input_hash is not None:  # its ids, score_from and rollout log-probs
        found["input_hash"], want["input_hash"] = f"{result.input_hash:016x}", f"{input_digest(job):016x}"
    if found != want:
        what = ", ".join(f"{k} {found[k]} (this run: {want[k]})" for k in found if found[k] != want[k])
        raise InputError(f"{input_path}:{number}: id {obj['id']!r} already has a result in OUT line {result.line} "
                         f"that another input, model or options made: {what}; give another -o, or remove that line")


async def _score_lines(settings: Settings, backend, input_path: Path, limits: Limits, out: IO[bytes],
                       done: dict[str, Done], run: dict, bar, sigterm: _Sigterm) -> int:
    scheduler = Scheduler.from_settings(backend, settings)  # started below, once Ctrl-C and SIGTERM are this loop's
    # Tickets in input order; results are written in that order as soon as the oldest is done.
    window: deque[tuple[int, str, ScoreJob, Ticket]] = deque()
    written = 0
    write_failed = False
    loop = asyncio.get_running_loop()
    stop, abandon = loop.create_future(), loop.create_future()  # set by a first and a second Ctrl-C
    terminated = False  # SIGTERM: stop and abandon at once, a preempted job's grace is short
    finished = False  # every line written to OUT

    async def write_oldest() -> None:
        nonlocal written, write_failed
        number, seq_id, job, ticket = window[0]  # taken off only once written: nothing after it is written before it
        if not ticket.done:
            await asyncio.wait((ticket.future, stop), return_when=asyncio.FIRST_COMPLETED)
        if stop.done():  # Ctrl-C: the forwards under way finish and are written, the rest never start
            await _finish_started(scheduler, [entry[3] for entry in window], abandon)
            if not ticket.done or ticket.future.cancelled() or ticket.future.exception() is not None:
                raise _Stopped
        try:
            scores = ticket.future.result()[0]
        except ApiError as exc:
            raise InputError(f"{input_path}:{number}: id {seq_id!r} could not be scored: {exc.message}") from None
        if (where := non_finite_score(scores)) is not None:
            raise InputError(f"{input_path}:{number}: id {seq_id!r} could not be scored: its scores are not finite at "
                             f"{where} (the model's logits overflow float32 or are NaN)")
        # what made it first, then the API's result
        record = {"id": seq_id, "model": backend.info.name, **{name: run[name] for name in _RUN_FIELDS},
                  "input_hash": f"{input_digest(job):016x}"}
        record.update(result_record(seq_id, scores, return_entropy=settings.return_entropy, top_k=settings.top_k))
        if job.rollout[0] is not None:  # as the server answers it
            record["mismatch"] = mismatch(scores.logprobs, job.rollout[0])
        try:
            out.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE))
        except OSError as exc:
            write_failed = True
            raise OutputError(exc.errno, exc.strerror or str(exc)) from None
        window.popleft()
        written += 1

    def _count_scored(tokens: int, future: asyncio.Future) -> None:  # run by the loop, as the bar's refresh is
        if not future.cancelled() and future.exception() is None:
            bar.update(1, tokens)

    def on_sigint() -> None:  # run by the loop, so never in the middle of a write
        if not stop.done():
            print("packscore: interrupted: writing what the forwards under way score (Ctrl-C again to stop at "
                  "once without it)", file=sys.stderr)
            stop.set_result(None)
        elif not abandon.done():
            abandon.set_result(None)

    def on_sigterm() -> None:  # what is finished is written and flushed, the forward under way is not waited for
        nonlocal terminated
        if finished:  # every line is written: OUT's last flush goes on
            sigterm.came = True
            return
        terminated = True
        release_sigterm(signal.SIG_DFL if sigterm.ours else sigterm_before)  # a second one ends the process at once
        for future in (stop, abandon):
            if not future.done():
                future.set_result(None)

    def release_sigterm(then) -> None:  # asyncio's removal leaves SIG_DFL: ``then`` takes over, no SIGTERM between
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            if loop.remove_signal_handler(signal.SIGTERM):
                signal.signal(signal.SIGTERM, then)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    sigterm_before = signal.getsignal(signal.SIGTERM)  # None: a handler set outside Python, left to it
    handlers = [(signal.SIGINT, on_sigint)] + ([(signal.SIGTERM, on_sigterm)] if sigterm_before is not None else [])
    for signum, handler in handlers:
        if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored (a script's `cmd &`, nohup): it stays so
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: not this run's to handle
                loop.add_signal_handler(signum, handler)
    ticker = asyncio.create_task(tick(bar))  # cancelled below; asyncio.run cancels it too, before the bar closes
    try:
        await scheduler.start()  # in the try: a Ctrl-C or SIGTERM while it starts is this loop's stop, which closes it
        for number, seq_id, job in _jobs(settings, input_path, limits, done, run):
            if stop.done():
                break
            while True:
                try:
                    ticket = scheduler.submit(job.sequences)
                    break
                except ApiError:  # the in-flight window is full: write finished results first
                    await write_oldest()
                    if stop.done():  # Ctrl-C while it waited: this line is not taken
                        raise _Stopped
            # Counted when scored, not when written: lines are written in input order, so one long first line
            # held every result behind it and the rate and time left read as if nothing was being scored.
            ticket.future.add_done_callback(functools.partial(_count_scored, len(job.sequences[0].input_ids)))
            window.append((number, seq_id, job, ticket))
            while window and window[0][3].done:
                await write_oldest()
        else:
            while window:
                await write_oldest()
            finished = True
    except _Stopped:
        pass
    finally:
        # Whatever was scored is kept, also when a later line is bad: the next run resumes after it.
        # Interrupted (Ctrl-C), what is scored is written, in order up to the first line left unscored.
        try:
            while window and not write_failed:
                await write_oldest()
        except _Stopped:
            pass
        finally:
            await scheduler.close("the offline run stopped")
            # A forward thread still alive at exit (a forward running, or one queued before the close) aborts the
            # process in torch's C++ teardown (SIGABRT, not 130 or 1): let it end, unless a second Ctrl-C said not to.
            while scheduler.threads_alive and not abandon.done():
                await asyncio.sleep(0.02)
            loop.remove_signal_handler(signal.SIGINT)
            release_sigterm(sigterm if sigterm.ours else sigterm_before)  # held from here until the model is closed
            ticker.cancel()  # its next step is its CancelledError: no refresh once this returns
    if stop.done() and not finished:
        raise Interrupted(abandoned=abandon.done(), forward_running=scheduler.threads_alive, terminated=terminated,
                          written=written)
    return written


class _Sigterm:
    """SIGTERM once scoring ended, where its handler is ours (the default, or the entry point's before scoring):
    noted, not acted on, until the model is closed, so that OUT's last flush and a worker pool's stop are not cut
    short; the exit is 143 then. Installed by the scoring loop as it ends, and for the model's close."""

    def __init__(self):
        found = signal.getsignal(signal.SIGTERM)
        self.ours = found is signal.SIG_DFL or found is terminate_before_scoring
        self.came = False

    def __call__(self, signum, frame) -> None:
        self.came = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Installs it for the block where SIGTERM's handler is ours, leaving the default after it."""
        if signal.getsignal(signal.SIGTERM) is terminate_before_scoring:  # stopped before scoring began
            signal.signal(signal.SIGTERM, self)
        try:
            yield
        finally:
            if signal.getsignal(signal.SIGTERM) is self:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Stopped(Exception):
    """Ctrl-C came before the oldest line's result, which will not come."""


class Interrupted(Exception):
    """Ctrl-C stopped the run; ``abandoned``: a second one did not wait for the forwards under way;
    ``terminated``: SIGTERM stopped it, without waiting for them."""

    def __init__(self, *, abandoned: bool, forward_running: bool, terminated: bool = False, written: int = 0):
        super().__init__("interrupted")
        self.abandoned, self.forward_running, self.terminated = abandoned, forward_running, terminated
        self.written = written  # results this run wrote to OUT


async def _finish_started(scheduler: Scheduler, tickets: list[Ticket], abandon: asyncio.Future) -> None:
    """Drops the tickets whose forward has not begun and waits for the others' results, or for ``abandon``."""
    error = ApiError(503, "unavailable", "Interrupted before its forward began.")
    for ticket in tickets:
        if not all(item.started for item in ticket.items):
            scheduler.fail(ticket, error)
    running = [ticket.future for ticket in tickets if not ticket.done]
    while running and not abandon.done():
        await asyncio.wait((*running, abandon), return_when=asyncio.FIRST_COMPLETED)
        running = [future for future in running if not future.done()]


def score_file(settings: Settings, input_path: Path, output_path: Path) -> int:
    """Scores every line of ``input_path`` not yet in ``output_path``; returns the exit status."""
    created = not output_path.exists()
    made = Path(os.path.realpath(output_path))  # a dangling symlink's target: the file removed, the user's link kept
    try:
        problem = path_problem(input_path, output_path)
        lock = None if problem is not None else lock_output(output_path)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM as OUT was made, before its removal below could
        if created:
            remove_if_empty(made)
        raise
    if problem is not None:
        print(f"packscore: error: {problem}", file=sys.stderr)
        return 2
    if lock is None:
        print(f"packscore: error: -o {output_path}: another packscore score is writing it; wait for it to end "
              "or give another -o", file=sys.stderr)
        return 2
    with lock:
        code = None
        try:
            code = _score_file(settings, input_path, output_path)
        finally:  # also where Ctrl-C or SIGTERM stopped it before scoring began
            if code != 0 and created and made.stat().st_size == 0:  # a first run that wrote nothing: no OUT
                made.unlink()
        return code


def _score_file(settings: Settings, input_path: Path, output_path: Path) -> int:
    from service.backends import load_backend, model_name

    seen: dict[str, int] = {}
    try:
        done = finished_ids(output_path)
        # Every line is checked but for the model's own limits (vocabulary, context) before it loads.
        # A line longer than any context the run allows is named as the sequence it is, not as a request to split.
        loose = Limits(None, settings.queued_tokens, 1, settings.queued_tokens, 1 << 62)
        todo = tokens = 0  # the tokens, for the time left: a forward's time follows them, not its lines
        for _, _, job in _jobs(settings, input_path, loose, done, {"temperature": settings.temperature}, seen):
            todo, tokens = todo + 1, tokens + len(job.sequences[0].input_ids)
    except InputError as exc:
        print(f"packscore: error: {exc}", file=sys.stderr)
        return 2
    total, resumed = len(seen), len(seen) - todo
    if foreign := len(done.keys() - seen):
        whose, it_is = ("whose id is", "it is") if foreign == 1 else ("whose ids are", "they are")
        log.warning("%s holds %s %s not in %s (kept as %s)", output_path, counted(foreign, "result"), whose, input_path,
                    it_is)
    log.info("%s in %s, %d already scored in %s", counted(total, "sequence"), input_path, resumed, output_path)
    if total == 0:  # a wrong path, or a shard left empty: exit 0 as with nothing left to score, but said
        log.warning("%s holds no sequences (it is empty or its lines are blank): nothing to score", input_path)
    if todo == 0:
        log.info("nothing left to score")
        return 0
    # of IN's lines only: a result whose id IN lacks is kept as it is, never checked against this run
    if unrecorded := sum(1 for seq_id, result in done.items() if None in result.run and seq_id in seen):
        does, it, it_is, it_was = ("does", "it", "it is", "it was") if unrecorded == 1 else \
            ("do", "them", "they are", "they were")
        log.warning("%s: %s %s not record the temperature, weights_version and dtype that made %s (an earlier packscore "
                    "wrote %s): %s kept unchecked, so give the --temperature, --model and --dtype %s scored with",
                    output_path, counted(unrecorded, "result"), does, it, it, it_is, it_was)
    if settings.model == "tiny":  # the default, so that a first try runs anywhere; its scores mean nothing
        log.warning("scoring with the built-in tiny preset (random weights, for trying packscore out): give --model "
                    "for the scores of a real model")
    from model_runtime.scoring.backend import BackendUnavailableError
    from model_runtime.scoring.checkpoint_error import CheckpointError

    try:
        with saying_still(log, f"loading {model_name(settings)}"):  # before any event loop: minutes for a large model
            backend = load_backend(settings)
    except CheckpointError as exc:  # refused once loaded (NaN weights, the loading report): one line, as serve
        print(f"packscore: error: {exc}", file=sys.stderr)
        return 2
    except BackendUnavailableError as exc:  # a worker pool that did not start: its message names the rank and why
        print(f"packscore: error: could not start: {exc}; {output_path} is as it was", file=sys.stderr)
        return 1
    code, stopped, sigterm = None, None, _Sigterm()
    try:
        code = _score_loaded(settings, backend, input_path, output_path, done, total, resumed, tokens, sigterm)
    except (KeyboardInterrupt, Interrupted) as exc:
        stopped = exc
    finally:
        with sigterm.held():
            code = _close_backend(backend, code, stopped, input_path, output_path, (total, resumed), sigterm)
    return code


def _close_backend(backend, code: int | None, stopped: BaseException | None, input_path: Path,
                   output_path: Path, scored: tuple[int, int] = (0, 0), sigterm: _Sigterm | None = None) -> int | None:
    """Closes ``backend``, Ctrl-C held meanwhile; returns the exit status: ``code``, or 130 (143 for SIGTERM)
    with the line that says what OUT keeps where a signal stopped the run (``stopped``) or came once every
    line was written (``sigterm``'s, noted until the model closed, or Ctrl-C while it closed). ``scored``:
    the lines of IN, and those of them in OUT before this run."""
    with _ctrl_c_held() as held:
        backend.close()  # a pool's workers stop: also after a second Ctrl-C, which does not wait for their forward
        # every line was in OUT before it came: Ctrl-C in the close, or SIGTERM held over OUT's last flush and the close
        if stopped is None and code == 0 and (held or (sigterm is not None and sigterm.came)):
            status, how = (130, "interrupted while closing the model") if held else \
                (143, "terminated (SIGTERM) once every line was scored")
            print(f"packscore: {how}; every line of {input_path} is in {output_path} (the same command has nothing "
                  "left to score)", file=sys.stderr)
            return status
        if stopped is None:
            return code
        if isinstance(stopped, Terminated):  # before the scoring loop took SIGTERM over: nothing of this run in OUT
            status, line = 143, before_scoring(output_path)
        elif getattr(stopped, "terminated", False):
            held = _in_out(scored[1] + stopped.written, scored[0], input_path, output_path)
            status, line = 143, (f"terminated (SIGTERM); {held}, in input order (a forward under way was not waited "
                                 "for): the same command resumes after them")
        else:
            how = "stopped at once, without the forward under way" if getattr(stopped, "abandoned", False) else "interrupted"
            status, line = 130, (f"{how}; the results written to {output_path} are kept, in input order: "
                                 "the same command resumes after them")
        print(f"packscore: {line}", file=sys.stderr)
        if getattr(stopped, "forward_running", False):  # torch's teardown under a running forward aborts (SIGABRT)
            hard_exit(status)
        return status


def _score_loaded(settings: Settings, backend, input_path: Path, output_path: Path, done: dict[str, Done], total: int,
                  resumed: int, tokens: int, sigterm: _Sigterm) -> int:
    """Scores into OUT with the loaded ``backend``; the exit status of a run that ends or fails. Ctrl-C
    raises (Interrupted, or KeyboardInterrupt outside the scoring loop): the results written are kept."""
    try:
        info = backend.info
        try:
            model_len = resolve_model_len(settings.max_model_len, info.max_model_len, settings.queued_tokens)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        limits = Limits(info.vocab_size, model_len, 1, settings.queued_tokens, 1 << 62)
        run = {"weights_version": info.weights_version, "temperature": settings.temperature, "dtype": info.dtype}
        # The model's limits and weights, before the first line is scored: a bad line stops the run with
        # nothing written. The file is read again, so that it is never held whole in memory.
        for _ in _jobs(settings, input_path, limits, done, run):
            pass
        out = output_path.open("ab")
        start = os.fstat(out.fileno()).st_size  # where this run's lines begin
        try:
            # closed after OUT: a stopped run's bar is left at the lines OUT holds, as the line after it counts them
            with progress(total, resumed, tokens, lambda: whole_lines(output_path, start)) as bar:
                try:
                    written = asyncio.run(_score_lines(settings, backend, input_path, limits, out, done, run, bar,
                                                          sigterm))
                finally:
                    close_output(out)
        finally:
            out.close()  # where the bar did not start; a closed file's close does nothing
    except InputError as exc:
        print(f"packscore: error: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:
        cut_torn(output_path, start)
        kept = whole_lines(output_path, start)
        held = ("the results written before are kept" if kept is None else
                f"{_in_out(resumed + kept, total, input_path, output_path)}, in input order")
        why, what_to_do = why_full(exc)
        print(f"packscore: error: cannot write {output_path}: {exc.strerror}{why}; {held}: {what_to_do}, then run "
              "the same command to resume after them", file=sys.stderr)
        return 1
    log.info("wrote %s to %s", counted(written, "result"), output_path)
    return 0


def _in_out(count: int, total: int, input_path: Path, output_path: Path) -> str:
    """"K of the N lines of IN are in OUT", in the singular where K or N is 1."""
    return f"{count} of the {counted(total, 'line')} of {input_path} {'is' if count == 1 else 'are'} in {output_path}"


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[list[int]]:
    """Ctrl-C during the block is noted in the list it yields, not raised: a worker pool's close cut short
    by one would leave its workers running until they notice this process is gone."""
    held: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, None) or threading.current_thread() is not threading.main_thread():
        yield held  # ignored (a script's `cmd &`), installed outside Python, or not this thread's to handle
        return
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


