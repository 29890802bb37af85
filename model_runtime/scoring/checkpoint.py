"""The checkpoint check shared by the start and by weight updates (minimal stand-in; see issue 18).

``check_checkpoint`` reads ``config.json`` and the safetensors headers only (never a pickle,
never a tensor's bytes) and raises ``CheckpointError`` whose ``kind`` says what is wrong:
``unsupported`` (not a safetensors checkpoint of a supported architecture), ``incomplete``
(a tensor the model needs is missing, or one it does not use is left over) or ``incompatible``
(a shape differs from the served model's).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Tensors a served text model never loads: a vision tower and multi-token-prediction heads.
IGNORED_TENSORS = re.compile(r"^(model\.visual\.|visual\.|mtp\.)")
KINDS = ("unsupported", "incomplete", "incompatible")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; ``kind`` is one of ``KINDS``."""

    def __init__(self, kind: str, message: str):
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint error kind {kind!r}; known: {KINDS}")
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class CheckpointSpec:
    path: Path
    model_type: str
    tensors: dict[str, tuple[int, ...]]  # name -> shape, from the safetensors headers
    files: tuple[str, ...]  # the safetensors files, sorted


def check_checkpoint(path: Path, *, expected: dict[str, tuple[int, ...]] | None = None) -> CheckpointSpec:
    """Checks ``path`` holds a supported safetensors checkpoint (and, given ``expected`` names ->
    shapes in checkpoint naming, exactly those tensors beside the ignored ones)."""
    from safetensors import SafetensorError, safe_open

    from model_runtime.model.architectures import UnsupportedModelError, architecture_for

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError("unsupported", f"{path.name} is not a checkpoint directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError("unsupported", f"{path.name} has no config.json")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
        architecture_for(model_type)
    except (ValueError, UnsupportedModelError, AttributeError) as error:
        raise CheckpointError("unsupported", f"{path.name}/config.json: {error}") from None
    files = tuple(sorted(f.name for f in path.glob("*.safetensors")))
    if not files:
        raise CheckpointError("unsupported", f"{path.name} has no *.safetensors files; only safetensors are read")
    tensors: dict[str, tuple[int, ...]] = {}
    for name in files:
        try:
            with safe_open(path / name, framework="pt") as f:
                for key in f.keys():
                    tensors[key] = tuple(f.get_slice(key).get_shape())
        except (SafetensorError, OSError) as error:
            raise CheckpointError("unsupported", f"{name} is not a readable safetensors file: {error}") from None
    if expected is not None:
        missing = [n for n in expected if n not in tensors]
        left = sorted(n for n in tensors if n not in expected and not IGNORED_TENSORS.match(n))
        if missing or left:
            what = []
            if missing:
                what.append(f"missing {len(missing)} tensors the model needs: {', '.join(missing[:5])}")
            if left:
                what.append(f"{len(left)} tensors the model does not use: {', '.join(left[:5])}")
            raise CheckpointError("incomplete", f"{path.name}: " + "; ".join(what))
        wrong = [f"{n} {list(tensors[n])} (served: {list(s)})" for n, s in expected.items() if tuple(tensors[n]) != tuple(s)]
        if wrong:
            raise CheckpointError("incompatible", f"{path.name}: {len(wrong)} tensors differ in shape: {', '.join(wrong[:5])}")
    return CheckpointSpec(path, model_type, tensors, files)
