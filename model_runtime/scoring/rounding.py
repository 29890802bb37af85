"""Which sequence lengths compute a shared prompt's rows of the narrow products alike.

A sequence's narrow gate products (the Gated DeltaNet's decay and beta projections, the MoE
router and shared-expert gate; ``kernels/gate_projection.py``) run over the whole sequence, as
Hugging Face computes them for one sequence, so their rounding follows the sequence's length:
cuBLAS picks the kernel, and with it the summation order, by the row count. Two members of a
GRPO group whose lengths round the prompt's rows differently cannot share that prompt without
one of them moving (about 1e-2 in a log-prob after the layers, bf16). ``RowRounding`` records,
for every row count, from which row on the products change against one row fewer
(``gate_projection.first_changed_rows``, the minimum over the model's narrow products), and
``split`` cuts a group where that happens inside its shared prefix: every member then computes
the prompt as it would alone.

``measure`` finds it on the model's device once per product shape and keeps it on disk
(``$PACKSCORE_CACHE_DIR``, default ``~/.cache/packscore``), keyed by the GPU, PyTorch and CUDA
versions, the shape and the dtype: about 10 s a shape the first time on an H200.
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


@dataclass(frozen=True)
class RowRounding:
    """``changed[M]``: the first row of any narrow product over ``M`` rows that differs from the
    product over ``M - 1`` rows (``M`` or more: none does)."""

    changed: np.ndarray

    @property
    def max_rows(self) -> int:
        return self.changed.size - 1

    @classmethod
    def exact(cls, max_rows: int) -> "RowRounding":
        """A model whose narrow products never round by row count (or has none)."""
        return cls(np.full(max_rows + 1, _ALWAYS, dtype=np.int64))

    def stable_rows(self, a: int, b: int) -> int:
        """How many first rows every narrow product computes alike at lengths ``a`` and ``b``."""
        if a == b:
            return _ALWAYS
        lo, hi = min(a, b), max(a, b)
        if hi > self.max_rows:
            return 0
        return int(self.changed[lo + 1 : hi + 1].min())

    def split(self, lengths: Sequence[int], shared: int, floor: int, align: int) -> list[tuple[list[int], int]]:
        """``(members, tokens)`` for the parts of a group of sequences of ``lengths`` (indices into
        it) whose first ``shared`` tokens agree: members ordered by length are cut wherever two
        neighbours compute fewer than the shared rows alike, each part sharing what all its members
        compute alike (a multiple of ``align``, at least ``floor``, at most ``shared``). The cut
        point chosen is the one that saves the most tokens; parts of one member are dropped."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        links = [self.stable_rows(lengths[a], lengths[b]) for a, b in zip(order, order[1:])]

        def aligned(rows: int) -> int:
            return min(shared, rows // align * align)

        candidates = {shared} | {aligned(r) for r in links if floor <= aligned(r) < shared}
        best: list[tuple[list[int], int]] = []
        best_saved = 0
        for cut in sorted(candidates, reverse=True):
            parts, part, inner = [], [order[0]], []
            for link, j in zip(links, order[1:]):
                if link < cut:
                    parts.append((part, inner))
                    part, inner = [], []
                else:
                    inner.append(link)
                part.append(j)
            parts.append((part, inner))
            kept = [(p, aligned(min(inner))) for p, inner in parts if len(p) > 1]
            saved = sum((len(p) - 1) * tokens for p, tokens in kept)
            if saved > best_saved:
                best, best_saved = kept, saved
        return best


def narrow_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of every narrow product of ``model`` (modules with ``narrow_weights()``)."""
    return [w for m in model.modules() if hasattr(m, "narrow_weights") for w in m.narrow_weights()]


def measure(model: torch.nn.Module, max_rows: int, cache_dir: str | os.PathLike | None = None) -> RowRounding:
    """``RowRounding`` of ``model``'s narrow products on their device, up to ``max_rows`` rows."""
    from model_runtime.kernels.gate_projection import first_changed_rows

    changed = RowRounding.exact(max_rows).changed
    shapes = {(w.shape[1], w.shape[0], w.dtype, w.device) for w in narrow_weights(model)}
    for in_features, out_features, dtype, device in sorted(shapes, key=str):
        path = _cache_path(cache_dir, device, in_features, out_features, dtype, max_rows)
        rows = _load(path)
        if rows is None:
            log.info("measuring how a [rows, %d] x [%d, %d] %s product rounds by row count, up to %d rows "
                     "(once per GPU and version; kept in %s)", in_features, in_features, out_features, dtype, max_rows, path)
            rows = first_changed_rows(in_features, out_features, dtype, device, max_rows)
            _save(path, rows)
        changed = np.minimum(changed, rows)
    return RowRounding(changed)


def _cache_path(cache_dir, device: torch.device, k: int, n: int, dtype: torch.dtype, max_rows: int) -> Path | None:
    root = cache_dir or os.environ.get("PACKSCORE_CACHE_DIR") or Path.home() / ".cache" / "packscore"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"{gpu}|torch {torch.__version__}|cuda {torch.version.cuda}|{k}x{n}|{dtype}|{max_rows}"
    return Path(root) / "row-rounding" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"


def _load(path: Path | None) -> np.ndarray | None:
    try:
        return np.load(path) if path is not None and path.exists() else None
    except (OSError, ValueError):  # unreadable or torn: measured again
        return None


def _save(path: Path | None, rows: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, rows)
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measured again next start
        log.warning("could not keep the row-rounding table in %s: %s", path, exc)
