"""Which sequence lengths compute a shared prompt's rows of the narrow products alike.

A sequence's narrow gate products (the Gated DeltaNet's decay and beta projections, the MoE
router and shared-expert gate; ``kernels/gate_projection.py``) run over the whole sequence, as
Hugging Face computes them for one sequence, so their rounding follows the sequence's length:
cuBLAS picks the kernel, and with it the summation order, by the row count. Two members of a
GRPO group whose lengths round the prompt's rows differently cannot share that prompt without
one of them moving (about 1e-2 in a log-prob after the layers, bf16). ``RowRounding`` records
the row counts at which any narrow product's rows change against one row fewer
(``gate_projection.first_changed_rows``, on operands that make a change of summation order
visible), and ``split`` cuts a group wherever its members' lengths straddle one: every member
then computes the prompt as it would alone.

``measure`` finds it on the model's device once per product shape and keeps it on disk
(``$PACKSCORE_CACHE_DIR``, default ``$XDG_CACHE_HOME/packscore`` or ``~/.cache/packscore``),
keyed by the GPU, PyTorch and CUDA versions, the shape, the dtype and the probe's version.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

# Row counts probed at most: a member longer than this shares only with members of its own length.
MAX_PROBED_ROWS = 32768
_ALWAYS = 1 << 62  # rows that never change
PROBE_VERSION = 2  # part of the cache key: a table measured another way is measured again


@dataclass(frozen=True)
class RowRounding:
    """``changed[M]``: the first row of any narrow product over ``M`` rows seen to differ from the
    product over ``M - 1`` rows (``M`` or more: none did). Two lengths compute a prompt alike only
    when no row count between them changed anything: where the first changed row lies depends on
    the probe's operands (a row whose order changed may still round alike), so it is not trusted."""

    changed: np.ndarray

    def __post_init__(self):
        is_step = self.changed < np.arange(self.changed.size)  # row count M changed some row
        object.__setattr__(self, "_is_step", is_step)
        object.__setattr__(self, "_steps_up_to", np.cumsum(is_step))  # row counts <= M that changed rows

    @property
    def max_rows(self) -> int:
        return self.changed.size - 1

    @classmethod
    def exact(cls, max_rows: int) -> "RowRounding":
        """A model whose narrow products never round by row count (or has none)."""
        return cls(np.full(max_rows + 1, _ALWAYS, dtype=np.int64))

    @property
    def steps(self) -> list[int]:
        """The row counts at which some narrow product's rows change (what ``from_steps`` takes)."""
        return [int(m) for m in np.flatnonzero(self._is_step)]

    @classmethod
    def from_steps(cls, steps: Sequence[int], max_rows: int) -> "RowRounding":
        """The table that ``steps`` describes (how the worker pool's processes hand it over)."""
        changed = cls.exact(max_rows).changed.copy()
        changed[np.asarray(steps, dtype=np.int64)] = 0
        return cls(changed)

    def alike(self, a: int, b: int) -> bool:
        """Whether sequences of ``a`` and ``b`` tokens compute every narrow product's common rows alike."""
        if a == b:
            return True
        if max(a, b) > self.max_rows:
            return False
        return bool(self._steps_up_to[a] == self._steps_up_to[b])

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        """The members (indices into ``lengths``) of a group cut into parts whose lengths compute
        the narrow products alike, parts of one member dropped."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        parts = [[order[0]]]
        for a, b in zip(order, order[1:]):
            if not self.alike(lengths[a], lengths[b]):
                parts.append([])
            parts[-1].append(b)
        return [p for p in parts if len(p) > 1]


def narrow_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of every narrow product of ``model`` (modules with ``narrow_weights()``)."""
    return [w for m in model.modules() if hasattr(m, "narrow_weights") for w in m.narrow_weights()]


def measure(model: torch.nn.Module, max_rows: int, cache_dir: str | os.PathLike | None = None,
            device: torch.device | None = None) -> RowRounding:
    """``RowRounding`` of ``model``'s narrow products on ``device`` (default: their weights'),
    up to ``max_rows`` rows (at most ``MAX_PROBED_ROWS``; a row budget fits here as it is). Only
    the weights' shapes and dtypes are read, not their values."""
    from model_runtime.kernels.gate_projection import first_changed_rows

    max_rows = min(int(max_rows), MAX_PROBED_ROWS)
    changed = RowRounding.exact(max_rows).changed
    shapes = {(w.shape[1], w.shape[0], w.dtype, torch.device(device) if device is not None else w.device)
              for w in narrow_weights(model)}
    for in_features, out_features, dtype, on in sorted(shapes, key=str):
        path = _cache_path(cache_dir, on, in_features, out_features, dtype, max_rows)
        rows = _load(path)
        if rows is None:
            log.info("measuring how a [rows, %d] x [%d, %d] %s product rounds by row count, up to %d rows "
                     "(once per GPU and version; kept in %s)", in_features, in_features, out_features, dtype, max_rows, path)
            rows = first_changed_rows(in_features, out_features, dtype, on, max_rows)
            _save(path, rows)
        changed = np.minimum(changed, rows)
    return RowRounding(changed)


def _cache_path(cache_dir, device: torch.device, k: int, n: int, dtype: torch.dtype, max_rows: int) -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")  # the image points it at its writable /cache volume
    root = cache_dir or os.environ.get("PACKSCORE_CACHE_DIR") or (Path(xdg) if xdg else Path.home() / ".cache") / "packscore"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"{gpu}|torch {torch.__version__}|cuda {torch.version.cuda}|{k}x{n}|{dtype}|{max_rows}|probe {PROBE_VERSION}"
    return Path(root) / "row-rounding" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"


def _load(path: Path) -> np.ndarray | None:
    try:
        return np.load(path) if path.exists() else None
    except (OSError, ValueError):  # unreadable or torn: measured again
        return None


def _save(path: Path, rows: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")  # the pool's ranks may write it at once
        np.save(tmp, rows)
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measured again next start
        log.warning("could not keep the row-rounding table in %s: %s", path, exc)
