"""Which sequence lengths compute a shared prompt's rows of the narrow products alike.

A sequence's narrow gate products (the Gated DeltaNet's decay and beta projections, the MoE
router and shared-expert gate; ``kernels/gate_projection.py``) run over the whole sequence, as
Hugging Face computes them for one sequence, so their rounding follows the sequence's length:
cuBLAS picks the kernel, and with it the summation order, by the row count. Two members of a
GRPO group whose lengths round the prompt's rows differently cannot share that prompt without
one of them moving (about 1e-2 in a log-prob after the layers, bf16). ``RowRounding`` gives every
row count a *kind* (``gate_projection.row_kinds``: row counts of one kind compute every row they
have in common alike, checked on operands that make a change of summation order visible), and
``split`` cuts a group into its members' kinds: every member then computes the prompt as it would
alone. cuBLAS switches among a few kernels as the row count grows, so a kind usually spans many
separate ranges of row counts.

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
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from model_runtime.kernels.cache import packscore_cache_dir

if TYPE_CHECKING:  # imported where used: the pool's HTTP process reads RowRounding without the kernels
    from model_runtime.kernels.gate_projection import RunLimits

log = logging.getLogger(__name__)

# Row counts probed at most: a member longer than this shares only with members of its own length.
MAX_PROBED_ROWS = 32768
# Narrow products with fewer inputs run per segment under ``runs``: over a short sum the probe's
# operands show a change of summation order in few outputs (reversing a sum: 0.4% at 64 inputs,
# 2.6% at 2,048; tests/unit/test_prefix_rounding.py), too few to trust a table that finds one kind.
# Every real model's hidden size is above it; the tiny test model's (64) is below.
MIN_RUN_IN_FEATURES = 1024
PROBE_VERSION = 3  # part of the cache key: a table measured another way is measured again


@dataclass(frozen=True)
class RowRounding:
    """``kinds[M]`` for ``M`` up to ``max_rows``: sequences of ``a`` and ``b`` tokens compute
    every narrow product's common rows alike when ``kinds[a] == kinds[b]`` (entry 0 unused)."""

    kinds: np.ndarray

    @property
    def max_rows(self) -> int:
        return self.kinds.size - 1

    @classmethod
    def exact(cls, max_rows: int) -> "RowRounding":
        """A model whose narrow products never round by row count (or has none)."""
        return cls(np.zeros(max_rows + 1, dtype=np.int64))

    @property
    def steps(self) -> list[int]:
        """The row counts whose kind differs from one row fewer's."""
        return [int(m) + 2 for m in np.flatnonzero(self.kinds[2:] != self.kinds[1:-1])]

    @property
    def runs(self) -> list[list[int]]:
        """``[first row count, kind]`` of every run of one kind (how the worker pool's processes
        hand the table over; ``from_runs`` takes it back)."""
        starts = [1] + self.steps
        return [[m, int(self.kinds[m])] for m in starts] if self.max_rows >= 1 else []

    @classmethod
    def from_runs(cls, runs: Sequence[Sequence[int]], max_rows: int) -> "RowRounding":
        kinds = np.zeros(max_rows + 1, dtype=np.int64)
        for (start, kind), nxt in zip(runs, [*list(runs)[1:], (max_rows + 1, 0)]):
            kinds[int(start):int(nxt[0])] = int(kind)
        kinds[0] = kinds[1] if max_rows >= 1 else 0
        return cls(kinds)

    @property
    def kind_count(self) -> int:
        return int(np.unique(self.kinds[1:]).size)

    def kind(self, length: int):
        """``length``'s kind; past the measured row counts a length is a kind of its own."""
        return int(self.kinds[length]) if length <= self.max_rows else ("length", int(length))

    def alike(self, a: int, b: int) -> bool:
        """Whether sequences of ``a`` and ``b`` tokens compute every narrow product's common rows alike."""
        return a == b or self.kind(a) == self.kind(b)

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        """The members (indices into ``lengths``) of a group cut by kind, parts of one member
        dropped; each part by length, the parts in the order of their shortest member."""
        parts: dict = {}
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            parts.setdefault(self.kind(lengths[i]), []).append(i)
        return [p for p in parts.values() if len(p) > 1]


def narrow_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of every narrow product of ``model`` (modules with ``narrow_weights()``)."""
    return [w for m in model.modules() if hasattr(m, "narrow_weights") for w in m.narrow_weights()]


def measure(model: torch.nn.Module, max_rows: int, cache_dir: str | os.PathLike | None = None,
            device: torch.device | None = None) -> RowRounding:
    """``RowRounding`` of ``model``'s narrow products on ``device`` (default: their weights'),
    up to ``max_rows`` rows (at most ``MAX_PROBED_ROWS``; a row budget fits here as it is). Only
    the weights' shapes and dtypes are read, not their values."""
    max_rows = min(int(max_rows), MAX_PROBED_ROWS)
    shapes = {_shape(w, device) for w in narrow_weights(model)}
    return combine([_shape_kinds(shape, max_rows, cache_dir) for shape in sorted(shapes, key=str)], max_rows)


def prepare_runs(model: torch.nn.Module, max_rows: int, cache_dir: str | os.PathLike | None = None,
                 device: torch.device | None = None) -> dict[str, int]:
    """Measures ``run_limits`` and hands them to the model's layers (``use_run_limits``); returns
    the limit of every module that owns a narrow weight, by module name (for logs and benchmarks)."""
    from model_runtime.kernels.gate_projection import RunLimits

    limits = run_limits(model, max_rows, cache_dir, device)
    use_run_limits(model, limits)
    narrow = {id(w) for w in narrow_weights(model)}
    return {name: limits.rows[RunLimits.shape(module.weight)] for name, module in model.named_modules()
            if isinstance(getattr(module, "weight", None), torch.Tensor) and id(module.weight) in narrow}


def run_limits(model: torch.nn.Module, max_rows: int, cache_dir: str | os.PathLike | None = None,
               device: torch.device | None = None) -> RunLimits:
    """How many rows one product of each narrow weight shape of ``model`` may have and still give
    each segment in it the rows of that segment's own product (read by the ``runs`` backend): the
    row counts up to which the product is of one kind (``uniform_rows``), where a slice's product
    also equals its rows of a longer one (``rows_keep_their_place``) and it sums at least
    ``MIN_RUN_IN_FEATURES`` inputs; 0 elsewhere. Only the weights' shapes and dtypes are read; a
    shape's kinds come from the same disk cache as ``measure``'s."""
    from model_runtime.kernels.gate_projection import RunLimits, rows_keep_their_place, uniform_rows

    max_rows = min(int(max_rows), MAX_PROBED_ROWS)
    limits: dict[tuple, int] = {}
    for weight in narrow_weights(model):
        key = RunLimits.shape(weight)
        if key in limits:
            continue
        shape = _shape(weight, device)
        rows = uniform_rows(_shape_kinds(shape, max_rows, cache_dir)) if shape[0] >= MIN_RUN_IN_FEATURES else 0
        if rows >= 2 and not rows_keep_their_place(shape[0], shape[1], shape[2], shape[3], rows):
            log.warning("a [rows, %d] x [%d, %d] product rounds a row by its place: one product per segment",
                        shape[0], shape[0], shape[1])
            rows = 0
        limits[key] = rows
    if limits:
        log.info("narrow products over runs of segments up to %s rows",
                 ", ".join(f"[{k[0]} -> {k[1]}]: {v}" for k, v in sorted(limits.items(), key=str)))
    return RunLimits(limits)


def use_run_limits(model: torch.nn.Module, limits: RunLimits) -> None:
    """Hands ``limits`` to every layer with narrow products (``use_run_limits``), after checking
    that they name every narrow weight's shape: a shape left out would run per segment unseen."""
    from model_runtime.kernels.gate_projection import RunLimits

    missing = {RunLimits.shape(w) for w in narrow_weights(model)} - set(limits.rows)
    if missing:
        raise ValueError(f"no run limit for the narrow products of shape (in, out, dtype) {sorted(missing, key=str)}")
    for module in model.modules():
        if hasattr(module, "narrow_weights"):
            module.use_run_limits(limits)


def measures_runs(loaded, device: torch.device | None = None) -> bool:
    """Whether the loaded model's narrow products run on CUDA with the ``runs`` backend, whose
    limits ``runs_in_use`` measures (``device``: where it will run, default where it is loaded)."""
    on = torch.device(device) if device is not None else loaded.device
    return on.type == "cuda" and loaded.backends.names.get("gate_projection") == "runs"


def runs_in_use(loaded, max_rows: int, device: torch.device | None = None) -> dict[str, int]:
    """``prepare_runs`` where ``measures_runs`` (the single-process scorer and every pool worker
    ask here); ``{}`` elsewhere, where they run per segment and nothing is measured."""
    if not measures_runs(loaded, device):
        return {}
    return prepare_runs(loaded.model, max_rows, device=device)


def _shape(w: torch.Tensor, device) -> tuple:
    return (w.shape[1], w.shape[0], w.dtype, torch.device(device) if device is not None else w.device)


def _shape_kinds(shape: tuple, max_rows: int, cache_dir) -> np.ndarray:
    """``row_kinds`` of one product shape, from the disk cache when measured before."""
    from model_runtime.kernels.gate_projection import row_kinds

    in_features, out_features, dtype, on = shape
    path = _cache_path(cache_dir, on, in_features, out_features, dtype, max_rows)
    kinds = _load(path, max_rows)
    if kinds is None:
        log.info("measuring how a [rows, %d] x [%d, %d] %s product rounds by row count, up to %d rows "
                 "(once per GPU and version; kept in %s)", in_features, in_features, out_features, dtype, max_rows, path)
        kinds = row_kinds(in_features, out_features, dtype, on, max_rows)
        _save(path, kinds)
    return kinds


def combine(per_shape: Sequence[np.ndarray], max_rows: int) -> RowRounding:
    """One ``RowRounding`` from each product's kinds: alike where every product is alike."""
    if not per_shape:
        return RowRounding.exact(max_rows)
    _, kinds = np.unique(np.stack(per_shape, axis=1), axis=0, return_inverse=True)
    return RowRounding(np.asarray(kinds, dtype=np.int64).reshape(-1))


def _cache_path(cache_dir, device: torch.device, k: int, n: int, dtype: torch.dtype, max_rows: int) -> Path:
    root = cache_dir or packscore_cache_dir()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"{gpu}|torch {torch.__version__}|cuda {torch.version.cuda}|{k}x{n}|{dtype}|{max_rows}|probe {PROBE_VERSION}"
    return Path(root) / "row-rounding" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npy"


def _load(path: Path, max_rows: int) -> np.ndarray | None:
    try:
        kinds = np.load(path) if path.exists() else None
    except (OSError, ValueError):  # unreadable or torn: measured again
        return None
    return kinds if kinds is not None and kinds.shape == (max_rows + 1,) else None


def _save(path: Path, rows: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")  # the pool's ranks may write it at once
        np.save(tmp, rows)
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measured again next start
        log.warning("could not keep the row-rounding table in %s: %s", path, exc)
