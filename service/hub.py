"""``--model ORG/NAME``: a Hugging Face hub id resolved to a checkpoint directory before anything starts.

The local Hugging Face cache is searched first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, as
huggingface_hub resolves them); where the hub is reachable, the checkpoint's files are downloaded
into that cache. Everything after the command line sees a local directory.

    >>> resolve_model_source("tiny", None)
    'tiny'
    >>> resolve_model_source("Qwen/Qwen3.5-9B", None)  # doctest: +SKIP
    '/root/.cache/huggingface/hub/models--Qwen--Qwen3.5-9B/snapshots/<commit>'
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("packscore")

# What loading reads: nothing else of a repository (tokenizer, images, pickles) is downloaded.
CHECKPOINT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class ModelSourceError(ValueError):
    """``--model`` names nothing that can be served; the message is one line for the CLI."""


def is_hub_id(spec: str) -> bool:
    """``ORG/NAME`` as the hub spells repository ids (a local directory of that name wins)."""
    return bool(_HUB_ID.fullmatch(spec)) and ".." not in spec


def local_kind(spec: str) -> str | None:
    """"a preset" or "a checkpoint directory" for what ``--model`` serves without the hub; else None."""
    from model_runtime.scoring.presets import PRESETS

    if spec in PRESETS:
        return "a preset"
    return "a checkpoint directory" if Path(spec).is_dir() else None


def resolve_model_source(spec: str, revision: str | None) -> str:
    """A preset name or an existing directory unchanged; a hub id -> its snapshot directory.

    ``revision`` (branch, tag or commit) applies to hub ids only. Raises ``ModelSourceError``
    naming the cache searched when the hub id is not cached and the hub cannot be used, and naming
    the hub id when its snapshot lacks config.json, shards its index lists, or every ``*.safetensors``
    (a partial download).
    """
    from model_runtime.scoring.presets import PRESETS

    if local_kind(spec) is not None:
        return spec
    if not is_hub_id(spec):
        raise ModelSourceError(
            f"--model {spec!r} is neither a checkpoint directory, a preset ({', '.join(sorted(PRESETS))}) "
            "nor a Hugging Face hub id (ORG/NAME)"
        )
    # Imported here: the CLI's --help must not pay for it.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    from model_runtime.scoring.checkpoint import INDEX_NAME, indexed_files
    from model_runtime.scoring.checkpoint_error import CheckpointError, quoted_names

    try:  # a mistyped local path such as runs/qwen--sft is no hub id either: say both
        validate_repo_id(spec)
    except HFValidationError as exc:
        raise ModelSourceError(
            f"--model {spec!r} is neither a checkpoint directory, a preset ({', '.join(sorted(PRESETS))}) "
            f"nor a valid Hugging Face hub id ({_first_line(exc)})"
        ) from None

    cache, rev = constants.HF_HUB_CACHE, revision or constants.DEFAULT_REVISION
    where = f"{spec} (revision {rev})"  # not spec@rev: --model takes no such form
    again = f"hf download {spec}" + (f" --revision {revision}" if revision else "")  # what fetches it
    log.info("resolving %s through the Hugging Face cache %s%s", where, cache,
             " (HF_HUB_OFFLINE: cache only)" if constants.HF_HUB_OFFLINE else "")
    try:
        path = snapshot_download(spec, revision=revision, allow_patterns=CHECKPOINT_FILES)
    except (RepositoryNotFoundError, GatedRepoError):
        raise ModelSourceError(
            f"--model {spec}: no such repository on the Hugging Face hub, or it is gated or private "
            "(log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"--model {spec}: the hub has no revision {rev!r} (--revision)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"the hub cannot be used ({_first_line(exc)})"
        raise ModelSourceError(
            f"--model {where}: no such directory, not in the Hugging Face cache {cache}, and {reason}; download it where "
            f"the hub is reachable (`{again}`, same HF_HOME) or pass a checkpoint directory"
        ) from None
    if not (Path(path) / "config.json").is_file():  # absent, or a link whose blob is gone: a partial download too
        raise ModelSourceError(
            f"--model {where}: the cached snapshot {path} has no config.json, likely an incomplete download (or the "
            f"repository is no transformers checkpoint); download it where the hub is reachable (`{again}`, same "
            "HF_HOME) or pass a checkpoint directory"
        )
    try:
        indexed = indexed_files(Path(path))
    except CheckpointError:  # an index that is none, or names odd shards: the checkpoint check says so
        indexed = None
    if indexed is not None and indexed[1]:
        files, absent = indexed
        raise ModelSourceError(
            f"--model {where}: the cached snapshot {path} lacks {len(absent)} of the {len(files)} shards its {INDEX_NAME} "
            f"lists ({quoted_names(absent)}), likely an incomplete download; download it where the hub is reachable "
            f"(`{again}`, same HF_HOME) or pass a checkpoint directory"
        )
    # is_file: a link whose blob is gone holds no weights either
    if not any(p.is_file() for p in Path(path).glob("*.safetensors")):
        raise ModelSourceError(
            f"--model {where}: the cached snapshot {path} has no *.safetensors weights, likely an incomplete download "
            f"(or the repository has none: packscore loads safetensors only); download it where the hub is reachable "
            f"(`{again}`, same HF_HOME) or pass a checkpoint directory"
        )
    log.info("%s is %s", where, path)
    return path


def _first_line(exc: BaseException) -> str:
    text = (str(exc) or type(exc).__name__).strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."
