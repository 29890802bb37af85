"""``packscore score IN.jsonl -o OUT.jsonl``: the server's engine (validation, scheduler, backend)
without HTTP, for batch jobs. Resumable: ids already in OUT are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import deque
from pathlib import Path
from typing import IO, Iterator

import orjson
from tqdm import tqdm

from service.http.encoding import non_finite_score, result_record
from service.http.errors import ApiError
from service.http.rollout import mismatch
from service.http.validation import Limits, ScoreJob, parse_score_request, resolve_model_len
from service.scheduling.scheduler import Scheduler, Ticket
from service.settings import Settings

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A line of IN that cannot be scored; the message names the line."""


def finished_ids(output: Path) -> set[str]:
    """Ids of the result lines of ``output``. A torn last line (no newline: the run was killed
    while writing it) is cut off; any other line that is not a result stops the run with its line
    number, since the good lines after it must be neither dropped nor scored again."""
    if not output.exists():
        return set()
    done: set[str] = set()
    good_end = 0
    with output.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # only the last line can lack its newline
            try:
                seq_id = orjson.loads(line)["id"]
                if not isinstance(seq_id, str):
                    raise TypeError(f"id must be a string, got {seq_id!r}")
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                reason = f"no id: {exc}" if isinstance(exc, KeyError) else str(exc)
                raise InputError(
                    f"{output}:{number}: not a result line ({reason}); remove or repair it, then run again "
                    "(the lines after it are kept)"
                ) from None
            done.add(seq_id)
            good_end += len(line)
    if good_end != output.stat().st_size:
        log.warning("%s: dropping an incomplete last line (the previous run stopped while writing it)", output)
        with output.open("r+b") as f:
            f.truncate(good_end)
    return done


def _lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise InputError(f"{path}:{number}: not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{number}: expected a JSON object with input_ids, got {type(obj).__name__}")
            if obj.get("id") is None:  # absent or null, the API's default
                obj["id"] = f"line-{number}"
            if not isinstance(obj["id"], str):
                raise InputError(f"{path}:{number}: id must be a string, got {obj['id']!r}")
            yield number, obj


def _jobs(settings: Settings, input_path: Path, limits: Limits, done: set[str]) -> Iterator[tuple[int, str, ScoreJob]]:
    """Each line not yet in OUT as a validated one-sequence job; a bad line raises InputError naming it."""
    seen: set[str] = set()
    for number, obj in _lines(input_path):
        seq_id = obj["id"]
        if seq_id in done:
            continue
        if seq_id in seen:
            raise InputError(f"{input_path}:{number}: id {seq_id!r} appears twice in the input")
        seen.add(seq_id)
        body = {
            "sequences": [obj],
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "return_entropy": settings.return_entropy,
        }
        try:
            yield number, seq_id, parse_score_request(body, limits, served_name="")
        except ApiError as exc:  # named as the line's own fields: a line is one sequence
            where = (exc.param or "").replace("sequences[0].", "")
            message = exc.message.replace("sequences[0].", "").replace("Sequence 0 has", "The sequence has")
            raise InputError(f"{input_path}:{number}: {where}: {message}") from None


async def _score_lines(settings: Settings, backend, input_path: Path, out: IO[bytes], done: set[str], bar: tqdm) -> int:
    info = backend.info
    try:
        model_len = resolve_model_len(settings.max_model_len, info.max_model_len, settings.queued_tokens)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    limits = Limits(info.vocab_size, model_len, 1, settings.queued_tokens, 1 << 62)
    # Every line is checked before the first is scored: a bad line stops the run with nothing written.
    # The file is read twice, so that it is never held whole in memory.
    for _ in _jobs(settings, input_path, limits, done):
        pass
    scheduler = Scheduler.from_settings(backend, settings)
    await scheduler.start()
    # Tickets in input order; results are written in that order as soon as the oldest is done.
    window: deque[tuple[int, str, ScoreJob, Ticket]] = deque()
    written = 0

    async def write_oldest() -> None:
        nonlocal written
        number, seq_id, job, ticket = window[0]  # taken off only once written: nothing after it is written before it
        try:
            scores = (await ticket.future)[0]
        except ApiError as exc:
            raise InputError(f"{input_path}:{number}: id {seq_id!r} could not be scored: {exc.message}") from None
        if (where := non_finite_score(scores)) is not None:
            raise InputError(f"{input_path}:{number}: id {seq_id!r} could not be scored: its scores are not finite at "
                             f"{where} (the model's logits overflow float32 or are NaN)")
        record = result_record(seq_id, scores, return_entropy=settings.return_entropy, top_k=settings.top_k)
        if job.rollout[0] is not None:  # as the server answers it
            record["mismatch"] = mismatch(scores.logprobs, job.rollout[0])
        out.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE))
        window.popleft()
        written += 1
        bar.update(1)

    interrupted = False

    try:
        for number, seq_id, job in _jobs(settings, input_path, limits, done):
            while True:
                try:
                    ticket = scheduler.submit(job.sequences)
                    break
                except ApiError:  # the in-flight window is full: write finished results first
                    await write_oldest()
            window.append((number, seq_id, job, ticket))
            while window and window[0][3].done:
                await write_oldest()
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
        raise
    finally:
        # Whatever was scored is kept, also when a later line is bad: the next run resumes after it.
        # Interrupted (Ctrl-C), only what is already scored is written, in order up to the first gap.
        try:
            while window and (not interrupted or window[0][3].done):
                await write_oldest()
        finally:
            await scheduler.close("the offline run stopped")
    return written


def score_file(settings: Settings, input_path: Path, output_path: Path) -> int:
    """Scores every line of ``input_path`` not yet in ``output_path``; returns the exit status."""
    from service.backends import load_backend

    if not input_path.is_file():
        print(f"packscore: error: {input_path} does not exist", file=sys.stderr)
        return 2
    try:
        done = finished_ids(output_path)
    except InputError as exc:
        print(f"packscore: error: {exc}", file=sys.stderr)
        return 2
    total = sum(1 for line in input_path.open("rb") if line.strip())
    log.info("%d sequences in %s, %d already scored in %s", total, input_path, len(done), output_path)
    backend = load_backend(settings)
    try:
        with output_path.open("ab") as out, tqdm(total=total, initial=min(len(done), total), unit="seq") as bar:
            try:
                written = asyncio.run(_score_lines(settings, backend, input_path, out, done, bar))
            finally:
                out.flush()
                os.fsync(out.fileno())
    except InputError as exc:
        print(f"packscore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"packscore: interrupted; the results written to {output_path} are kept, in input order: "
              "the same command resumes after them", file=sys.stderr)
        return 130
    finally:
        backend.close()
    log.info("wrote %d results to %s", written, output_path)
    return 0
