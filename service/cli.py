"""``packscore serve`` and ``packscore score``: one Settings object, built once here and passed down.

Every option is generated from a field of ``Settings`` (its description is the help text) and
also reads ``PACKSCORE_<OPTION>``; the command line wins over the environment. Nothing from
``model_runtime`` is imported before ``--triton-cache-dir`` has been put into the environment.
"""

from __future__ import annotations

# `python -m service.cli` runs as the console script does: SIGTERM's early handler is set before the imports below
if __name__ == "__main__":
    import sys

    from service.entrypoint import main as _entry_main

    sys.exit(_entry_main())

import argparse
import importlib
import json
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Sequence

from pydantic import SecretStr, ValidationError

from service.entrypoint import Terminated, before_scoring, handle_early_signals
from service.http.errors import validation_reason
from service.http.request_id import configure_logging
from service.settings import Settings
from service.weights_record import WeightsRecord


_MODEL_OPTIONS = (
    "model", "revision", "served_model_name", "dtype", "device", "allow_slow_kernels", "kernels", "triton_cache_dir",
    "expert_gemm", "world_size", "sp", "fsdp", "max_batch_tokens", "max_model_len", "log_level", "prefix_sharing",
    "prefix_min_tokens",
)  # fmt: skip
_SERVE_OPTIONS = _MODEL_OPTIONS + (
    "host", "port", "api_key", "api_key_file", "max_wait_ms", "max_queued_tokens", "max_request_bytes",
    "max_sequences_per_request", "drain_timeout_s", "queue_seconds", "max_admission_wait_s",
    "request_read_timeout_s", "send_timeout_s", "keep_alive_timeout_s", "max_connections", "weights_root",
    "weights_record", "admin_key", "admin_key_file",
)  # fmt: skip
_SCORE_OPTIONS = _MODEL_OPTIONS + ("temperature", "top_k", "return_entropy")
_METAVARS = {
    "model": "PATH_OR_PRESET", "revision": "REV", "served_model_name": "NAME", "device": "DEVICE", "triton_cache_dir": "DIR",
    "expert_gemm": "FILE",
    "host": "HOST", "port": "PORT", "api_key": "KEY", "api_key_file": "FILE", "max_wait_ms": "MS",
    "drain_timeout_s": "SECONDS", "queue_seconds": "SECONDS", "max_admission_wait_s": "SECONDS",
    "request_read_timeout_s": "SECONDS", "send_timeout_s": "SECONDS", "keep_alive_timeout_s": "SECONDS", "temperature": "T", "top_k": "K", "kernels": "FAMILY=BACKEND",
    "weights_root": "DIR", "weights_record": "FILE", "admin_key": "KEY", "admin_key_file": "FILE",
}  # fmt: skip; every other option takes a count, shown as N


def _optional_inner(annotation):
    """``int | None`` -> int."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _add_options(parser: argparse.ArgumentParser, names: Sequence[str], *, one_model: bool = False) -> None:
    for name in names:
        field = Settings.model_fields[name]
        option = "--" + name.replace("_", "-")
        shown_default = "" if field.default is None else f"; default {field.default}"
        description = field.description
        if one_model and name == "model":  # offline scoring runs one model, named as serve names one
            description = (description.split("; several models:")[0] + "; NAME=PATH_OR_PRESET writes NAME in each "
                           "result line's model field, as --served-model-name does")
        if one_model and name == "served_model_name":  # offline, no client: the name goes into OUT
            description = "name written in each result line's model field (default: the model's)"
        if one_model and name == "kernels":  # offline, no HTTP: the load's log line names what runs
            description = description.replace("/v1/models shows what runs", "the log's 'loaded' line shows what runs")
        # argparse formats help with %: a literal one in a description must reach it doubled
        help_text = f"{description} [env PACKSCORE_{name.upper()}{shown_default}]".replace("%", "%%")
        kind = _optional_inner(field.annotation)
        if kind is bool:
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(option, choices=typing.get_args(kind), default=argparse.SUPPRESS, help=help_text)
        elif name == "model":  # repeatable: several served models, NAME=PATH_OR_PRESET each
            parser.add_argument(option, metavar=_METAVARS["model"], action="append", default=argparse.SUPPRESS, help=help_text)
        else:
            # Values stay strings here: Settings converts and validates them, as it does the environment.
            parser.add_argument(option, metavar=_METAVARS.get(name, "N"), default=argparse.SUPPRESS, help=help_text)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packscore")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _output_path(text: str) -> Path:
    """``-o``'s file; Path drops a trailing slash, which would make ``-o results/`` a file named results."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text} ends in a slash, so names a directory: give a file, such as "
                                         f"{text.rstrip('/' + os.sep) or '.'}/out.jsonl")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packscore",
        description="Per-token log-probability and entropy scoring for RL trainers (Qwen3.5 / Qwen3-Next).",
        epilog="Every option also reads the environment variable shown in brackets; the command line wins.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve the HTTP API (POST /score and /v1/score, POST /v1/weights, /health, /healthz, /readyz, /metrics, "
        "/v1/models, /docs)",
        description="Serve the HTTP API of docs/api.md. With no --model it serves the built-in tiny preset on "
        "127.0.0.1:8000. SIGTERM drains: readiness turns 503, new requests get 503, admitted requests "
        "finish within --drain-timeout-s, then the process exits 0.",
    )
    _add_options(serve, _SERVE_OPTIONS)
    score = commands.add_parser(
        "score",
        help="score a JSONL file offline (no HTTP), resumable",
        description="Score IN.jsonl into OUT.jsonl with the same engine as the server, without HTTP. Each input "
        'line is one sequence object as in the API: {"id": "...", "input_ids": [...], "score_from": 1}; a line '
        "without an id (or with a null one) gets line-<number>. Every line is checked before the first is scored: "
        "a bad one stops the run, naming its line and field, with nothing written. Each output line is the API's "
        "JSON result for it (with mismatch where the line sends rollout_logprobs) and what made it: model, "
        "weights_version, temperature, dtype and input_hash (of its ids, score_from and rollout_logprobs). Ids "
        "already in OUT are skipped, so an interrupted run resumes where it stopped; an id whose result in OUT came "
        "from another input, other weights or other options is refused. "
        "IN must be a regular file (it is read more than once: not stdin or a pipe).",
    )
    score.add_argument("input", type=Path, metavar="IN.jsonl", help="sequences to score, one JSON object per line")
    score.add_argument("-o", "--output", type=_output_path, required=True, metavar="OUT.jsonl", help="where results go (appended); a regular file, read back to resume: not - (stdout) or a pipe")
    _add_options(score, _SCORE_OPTIONS, one_model=True)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    # An option the command lacks keeps its default, never its variable: one environment (the
    # image sets PACKSCORE_HOST and PACKSCORE_PORT) serves both commands, each reading its own.
    options = _SERVE_OPTIONS if args.command == "serve" else _SCORE_OPTIONS
    for name in Settings.model_fields.keys() - set(options):
        given[name] = Settings.model_fields[name].get_default(call_default_factory=True)
    if "model" in given:  # the repeated option as one value: itself, or a JSON list of several
        models = given["model"]
        given["model"] = models[0] if len(models) == 1 else json.dumps(models)
    # a key given on the command line wins over the other form of it in the environment
    for key, other in (("api_key", "api_key_file"), ("admin_key", "admin_key_file"),
                       ("api_key_file", "api_key"), ("admin_key_file", "admin_key")):
        if given.get(key) is not None:
            given.setdefault(other, None)
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        reason = validation_reason(first)
        if not field:  # a rule across options (--model's list, --sp and --world-size): it names them itself
            parser.error(reason + _from_environment(reason, given))
        where = "--" + field.replace("_", "-")
        if field not in given and f"PACKSCORE_{field.upper()}" in os.environ:
            where += f" (from PACKSCORE_{field.upper()})"  # the value came from the environment
        parser.error(f"{where}: {reason}")
    if args.command == "score" and len(specs := settings.model_specs()) > 1:  # before any hub id downloads
        reason = f"--model: packscore score scores with one model, not {len(specs)} ({', '.join(specs)}); give one --model"
        parser.error(reason + _from_environment(reason, given))
    return args, settings


def _from_environment(reason: str, given: dict) -> str:
    """`` (--sp from PACKSCORE_SP, ...)``: the options ``reason`` names whose values came from the environment."""
    named = [name for name in Settings.model_fields if name not in given and f"PACKSCORE_{name.upper()}" in os.environ
             and re.search(rf"--{name.replace('_', '-')}(?![\w-])", reason)]
    options = [f"--{n.replace('_', '-')} from PACKSCORE_{n.upper()}" for n in named]
    return f" ({', '.join(options)})" if options else ""


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # this process's command line (a script's own `cli.main()`), not a caller's
        handle_early_signals(sys.argv[1:])
    args, settings = parse_settings(argv)
    try:
        return _run(args, settings)
    except KeyboardInterrupt as exc:
        if args.command != "score":
            raise
        # before scoring began (imports, the checks, loading the model): a line, not a traceback
        if isinstance(exc, Terminated):
            print(f"packscore: {before_scoring(args.output)}", file=sys.stderr)
            return 143
        print(f"packscore: interrupted before scoring began; {args.output} is as it was", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(settings.log_level)
    if settings.triton_cache_dir is not None:
        # Triton and Inductor read their cache directories when the first kernel compiles: set
        # both before any kernel module is imported (importing this helper imports no Triton).
        from model_runtime.kernels.cache import configure_kernel_cache

        os.environ.pop("TRITON_CACHE_DIR", None)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        configure_kernel_cache(settings.triton_cache_dir)
    given = vars(args)  # the options given on the command line: a refusal of one from the environment names it
    if settings.expert_gemm is not None:
        if not settings.expert_gemm.is_file():
            reason = f"--expert-gemm {settings.expert_gemm}: no such file"
            print(f"packscore: error: {reason}{_from_environment(reason, given)}", file=sys.stderr)
            return 2
    try:
        settings = _check_model_and_key(settings)
        # read and checked before anything loads, with --model as configured
        record = WeightsRecord.from_settings(settings) if args.command == "serve" else None
        _check_device(settings)
        settings = _resolve_hub_model(settings)  # may download: after the cheap checks
        _check_checkpoint(settings)
        _check_kernels(settings)
    except (ValueError, OSError, ImportError) as exc:
        print(f"packscore: error: {exc}{_from_environment(str(exc), given)}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(settings, record)
    (spec,) = settings.model_specs().items()  # several were refused by parse_settings
    settings = settings.for_model(*spec)
    from service.offline import score_file

    return score_file(settings, args.input, args.output)


def _resolve_hub_model(settings: Settings) -> Settings:
    """A hub id --model becomes its local snapshot directory, served under the hub id's name."""
    from service.hub import resolve_model_source

    specs = settings.model_specs()
    if None not in specs:  # several, or one NAME=: each resolved, served under its given name
        resolved = {name: resolve_model_source(spec, settings.revision) for name, spec in specs.items()}
        return settings.model_copy(update={"model": json.dumps(resolved)})
    path = resolve_model_source(settings.model, settings.revision)
    if path == settings.model:  # a preset or a directory
        return settings
    return settings.model_copy(update={"model": path, "served_model_name": settings.served_model_name or settings.model})


def _check_checkpoint(settings: Settings) -> None:
    """config.json and the safetensors headers against the model, and --max-model-len against
    its context, before the port is bound."""
    from model_runtime.scoring.presets import PRESETS

    from model_runtime.scoring.checkpoint import check_checkpoint
    from service.http.validation import resolve_model_len

    for spec in settings.model_specs().values():  # every served model, each refused on its own
        if spec in PRESETS:
            context = PRESETS[spec].config.get("max_position_embeddings")
        else:
            context = check_checkpoint(Path(spec)).max_model_len
        resolve_model_len(settings.max_model_len, context, settings.queued_tokens)


def _check_device(settings: Settings) -> None:
    """A ``--device`` this machine does not have is refused before the port is bound (the model loads after)."""
    if not settings.device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(settings.device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} CUDA device{'' if count == 1 else 's'}" if count else f"no CUDA device (torch {torch.__version__})"
        raise ValueError(f"--device {settings.device}: this machine has {have}; give another --device, or auto")


def _check_kernels(settings: Settings) -> None:
    """A ``--kernels`` pin this device cannot run, or a family with no fast kernel installed on
    CUDA (``fla`` missing) without ``--allow-slow-kernels``, is refused before the model loads or
    the port is bound."""
    overrides = settings.kernels
    if overrides:
        from model_runtime.kernels.registry import check_overrides

        check_overrides(settings.device_type, overrides, settings.expert_gemm)
    if settings.device_type == "cuda" and not settings.allow_slow_kernels:
        from model_runtime.kernels.registry import SlowKernelError, check_fast_kernels

        try:
            check_fast_kernels("cuda", overrides=overrides, worker_pool=settings.uses_worker_pool)
        except SlowKernelError as exc:
            raise ValueError(str(exc)) from None


def _check_model_and_key(settings: Settings) -> Settings:
    """Fails before anything slow for mistakes that loading would only find minutes later; the
    settings with each key file read once (it may be a pipe a secret injector writes once)."""
    api_key = settings.resolved_api_key()  # an unreadable or empty key file
    admin_key = settings.resolved_admin_key()
    if admin_key is not None and admin_key == api_key:  # /v1/weights refuses the scoring key: not if they are one
        raise ValueError("the admin key (--admin-key / --admin-key-file) is the API key: the scoring key would also "
                         "update weights; give the admin key a value of its own, or leave it unset to let the API "
                         "key rule /v1/weights")
    _check_revision(settings)
    if settings.weights_root is not None and not settings.weights_root.is_dir():
        raise ValueError(f"--weights-root {str(settings.weights_root)!r} is not a directory")
    if settings.uses_worker_pool:
        try:
            importlib.import_module("model_runtime.pool.pool")  # imported now to fail before loading
        except ImportError as exc:
            raise ImportError(
                f"--world-size {settings.world_size} / --sp {settings.sp} / --fsdp need the worker pool "
                f"(model_runtime.pool.pool.start_pool), which is not available in this build: {exc}"
            ) from None
    return settings.model_copy(update={
        "api_key": None if api_key is None else SecretStr(api_key), "api_key_file": None,
        "admin_key": None if admin_key is None else SecretStr(admin_key), "admin_key_file": None,
    })


def _check_revision(settings: Settings) -> None:
    """--revision with no hub id to apply it to: refused, not silently ignored (a local directory of a hub
    id's name wins over the hub, so ``--model Qwen/X --revision R`` would serve that directory)."""
    from service.hub import is_hub_id, local_kind

    if settings.revision is None:
        return
    kinds = {spec: local_kind(spec) for spec in settings.model_specs().values()}
    if not all(kinds.values()):
        return
    what = "; ".join(f"--model {spec} is {kind}" + (" (it wins over the hub id of that name)" if is_hub_id(spec) and
                     kind != "a preset" else "") for spec, kind in kinds.items())
    raise ValueError(f"--revision {settings.revision} applies to a Hugging Face hub id --model, and {what}, with no "
                     "revisions: drop --revision, or give a hub id")


def serve(settings: Settings, record: WeightsRecord | None = None) -> int:
    from service.backends import backend_loaders
    from service.http.app import create_app
    from service.http.server import run_server

    app = create_app(settings, backend_loaders(settings), record)
    return run_server(app, settings)
